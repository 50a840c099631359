"""The run engine: one org's side of a federated run, round after round.

``docs/ARCHITECTURE.md``, "A round", is what :meth:`RunEngine.run` does for each round
``r`` of a run, once :meth:`RunEngine.prepare` has the round-0 model (from the saved
state, or from the trainer) and, when the trainer asks for them, the federation's
secure sum of its pre-training statistics:

1. **train** — the local job (:class:`LocalTrainer`; on a node the org's local worker,
   :class:`~org_node.trainers.local.WorkerTrainer`) starts from the global model
   ``M[r]`` (under a compression, plus this org's residual: what it has not sent
   yet) and hands back ``delta = local - start``, its weight (examples seen) and its
   step count ``tau``;
2. **check** — names, shapes and finiteness of the update against the global model
   (:class:`UpdateRejected` names the offending field; a NaN update is never sent);
3. **pack** — FedNova normalization (Wang et al., "Tackling the Objective
   Inconsistency Problem in Heterogeneous Federated Optimization", NeurIPS 2020,
   eq. 7): the org contributes ``w * delta / tau``, ``w * tau`` and ``w`` inside one
   secure vector (:mod:`org_node.update_packing`), so that orgs on a time budget
   (fewer steps) do not bias the model and no org reveals its weight or steps;
4. **protect** — without DP the vector is quantized by the shared
   :class:`~secure_agg.codec.FixedPointCodec`; with DP (the run spec's ``epsilon`` and
   agreed ``dp`` mechanism, which must be this org's own) the budget is checked
   *before* the round at the least noise a completed round carries (hard stop,
   :class:`~org_node.privacy.BudgetExceeded`), :func:`~org_node.privacy.protect_update`
   clips it and adds this org's Skellam noise share, and once the sum is out the
   round is charged for the noise of its survivors; with the run spec's
   ``compression`` (never with DP) the :class:`~org_node.compressor.Compressor`
   encodes it instead (random-k, q8, error feedback: :mod:`org_node.compression`);
5. **aggregate** — the vector goes to the run's
   :class:`~coordinator_free.rounds.SecureSum` (masked backend: the leaderless
   :class:`~coordinator_free.rounds.RoundEngine`) and every survivor gets the same
   sum; a failed attempt is retried under a later protocol round number
   (``r * ATTEMPTS + attempt``): a round without a quorum waits for one with a bounded
   backoff, joins the attempt its peers run, and fails the run only after the run
   spec's ``quorum_wait_s`` (:mod:`org_node.quorum`);
6. **step** — the strategy runs on the decoded sum, identically on every node;
7. **verify** — the new model's SHA-256 is exchanged with the survivors
   (:meth:`SecureSum.check_model_hash`): any difference stops the run;
8. **persist** — the engine state (round, model, strategy state, DP accountant) is
   written atomically to ``state_dir`` every round, and pushed as erasure-coded shards
   (the ``checkpoint`` callback, :class:`~coordinator_free.checkpoints.CheckpointReplicator`)
   every ``checkpoint_every`` rounds. A node that restarts resumes from its last state
   (:meth:`RunEngine.resume`), one that lost its disk from the recovered shards.

Backends. The engine sums through one :class:`~coordinator_free.rounds.SecureSum`,
chosen when it is built: the masked backend runs through the round engine
(:class:`~coordinator_free.rounds.MaskedSecureSum`, which encodes with the run's codec
and DP noise). The round engine's ring adds ring arrays only, so the CKKS backend
(:mod:`secure_agg.ckks`) runs through :class:`~coordinator_free.rounds.ckks.CkksAggregator`
instead: a chain of ciphertext additions that ends at a per-round key holder, which
returns the sum to each participant encrypted under that participant's own key.
Steps 6-8 are the same for both.

Harness-only debug export (:mod:`org_node.debug_export`): never on by default, never for a
real deployment.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from coordinator_free.rounds import MaskedSecureSum, RoundEngine, RoundFailed, SecureSum
from coordinator_free.sealed import atomic_write

from org_node.compression import CompressionError
from org_node.compressor import compressor_for
from org_node.debug_export import DebugExport
from org_node.privacy import (
    BudgetExceeded,
    RdpAccountant,
    protect_update,
    run_privacy,
    skellam_round_for,
)
from org_node.quorum import QuorumWait, back_off, backoff_s
from org_node.run_config import (
    ATTEMPTS,
    EngineConfig,
    EngineError,
    RunPlan,
    TrainingConfig,
    UpdateRejected,
    run_key,
)
from org_node.run_state import (
    EngineState,
    Model,
    RoundReport,
    RunOutcome,
    check_update,
    model_from_bytes,
    model_hash,
    model_to_bytes,
)
from org_node.strategies import Strategy, StrategyError, make_strategy
from org_node.training.exchange import LocalResult
from org_node.update_packing import pack_update, packing_scale, unpack_sum
from secure_agg.codec import FixedPointCodec
from secure_agg.dp import clip_l2
from secure_agg.errors import SecAggError

__all__ = [
    "ATTEMPTS",
    "EngineConfig",
    "EngineError",
    "EngineState",
    "LocalTrainer",
    "RoundReport",
    "RunEngine",
    "RunFailed",
    "RunOutcome",
    "RunPlan",
    "TrainingConfig",
    "UpdateRejected",
    "check_update",
    "model_from_bytes",
    "model_hash",
    "model_to_bytes",
    "run_key",
]

logger = logging.getLogger(__name__)

STATS_CLIP = float(2**40)
"""Largest magnitude of one org's pre-training statistic in the secure sum."""

STATE_FILE = "engine-state.bin"


class RunFailed(Exception):
    """The run stopped: a round found no quorum within the spec's ``quorum_wait_s``
    (or the statistics' sum failed ``max_attempts`` times), or the model hashes differ."""


class _CaughtUp(Exception):
    """A failed attempt found the federation ahead; the engine adopted its model."""


# --------------------------------------------------------------------------- the local job


class LocalTrainer(Protocol):
    """The local job: train from the global model, return the update (run in a thread).

    A trainer may also offer, and the engine then uses: ``initial_model() -> Model``
    (the round-0 model, when the engine is given none), ``statistics() -> array | None``
    and ``use_statistics(array)`` (this org's share of statistics the federation sums
    securely before round 1, and the sum), ``close()`` (the run is over here).
    """

    def train(
        self, global_state: Mapping[str, np.ndarray], round: int, options: Mapping[str, Any]
    ) -> LocalResult: ...


@dataclass(frozen=True)
class _Aggregate:
    total: np.ndarray
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    attempts: int
    bytes_sent: int
    waited_s: float = 0.0
    ring_bytes_sent: int = 0


Checkpoint = Callable[[bytes, int], Awaitable[Any]]
CatchUp = Callable[[str, int], Awaitable[tuple[int, Model] | None]]
"""``catch_up(run_key, round)``: a newer agreed ``(round, model)`` of the run, or None."""


class RunEngine:
    """One org's rounds of one run (see the module docstring)."""

    def __init__(
        self,
        plan: RunPlan,
        config: EngineConfig,
        *,
        rounds: RoundEngine,
        trainer: LocalTrainer,
        state_dir: Path,
        checkpoint: Checkpoint | None = None,
        on_round: Callable[[RoundReport], Awaitable[None] | None] | None = None,
        debug_export: Path | None = None,
        catch_up: CatchUp | None = None,
        ckks: SecureSum | None = None,
        initial_model: Model | None = None,
        rng: np.random.Generator | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        plan.check_runnable(rounds.org_id, has_ckks=ckks is not None)
        self.plan = plan
        self.config = config
        self.rounds = rounds
        self.trainer = trainer
        self.state_dir = Path(state_dir)
        self.checkpoint = checkpoint
        self.on_round = on_round
        self.debug_export = DebugExport(debug_export, rounds.org_id, plan.run_key)
        self.catch_up = catch_up
        self.rng = rng if rng is not None else np.random.default_rng()
        self.clock = clock
        # what the engine does now and since when (clock time): see :attr:`activity`
        self.activity: tuple[str, float] = ("starting", clock())
        # the round's wait for a quorum while one lasts (the ``quorum`` activity)
        self.quorum: QuorumWait | None = None
        self.strategy: Strategy = make_strategy(config.strategy, config.strategy_options)
        self.codec, self.dp, self.budget = run_privacy(plan, config)
        self.compressor = compressor_for(plan, self.codec)  # None: compression none
        # the backend, chosen once: the round's sums and the statistics' go through it
        self.secure_sum, self.stats_sum = self._backend(ckks)
        self.state = EngineState(
            plan.run_key,
            0,
            {k: np.asarray(v, dtype=np.float32) for k, v in (initial_model or {}).items()},
            self.strategy.state_dict(),
            self.budget.accountant.state_dict() if self.budget and self.budget.accountant else None,
            plan={"name": plan.name, "spec": dict(plan.spec), "members": list(plan.participants)},
        )

    def _backend(self, ckks: SecureSum | None) -> tuple[SecureSum, SecureSum]:
        """The secure sums of the round's updates and of the statistics: CKKS for both,
        or the masked sum with this engine's codec (and DP noise) and a 64-bit one."""
        if ckks is not None and self.plan.backend == "ckks":
            return ckks, ckks
        # the codec's own decode lets a 64-bit sum be decoded in its own memory
        decode = self.codec.decode if self.compressor is None else self.compressor.decode
        secure_sum = MaskedSecureSum(
            self.rounds, clip=self.codec.clip, encode=self._protect, decode=decode
        )
        n = len(self.plan.participants)
        stats = FixedPointCodec(bits=64, clip=STATS_CLIP, max_summands=n)
        return secure_sum, MaskedSecureSum.with_codec(self.rounds, stats, self.rng)

    # -- persistence ----------------------------------------------------------------

    @property
    def state_path(self) -> Path:
        return self.state_dir / STATE_FILE

    def save_state(self) -> bytes:
        """Write the engine state atomically; returns its bytes."""
        self.state.strategy = self.strategy.state_dict()
        if self.budget is not None and self.budget.accountant is not None:
            self.state.accountant = self.budget.accountant.state_dict()
        if self.compressor is not None:
            self.state.compression = self.compressor.to_bytes()
        data = self.state.to_bytes()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(self.state_path, data)
        return data

    def restore(self, data: bytes) -> None:
        """Continue from a saved (or recovered) state of this run."""
        state = EngineState.from_bytes(data)
        if state.run_key != self.plan.run_key:
            raise EngineError("state", f"state of run {state.run_key}, not {self.plan.run_key}")
        if self.state.model:
            check_update(state.model, self.state.model)
        try:
            self.strategy.load_state_dict(state.strategy)
        except StrategyError as exc:
            raise EngineError("state.strategy", str(exc)) from None
        if self.budget is not None:
            acct = RdpAccountant()
            if state.accountant is not None:
                acct.load_state_dict(state.accountant)
            self.budget.accountant = acct
        if self.compressor is not None and state.compression is not None:
            try:
                self.compressor.load(state.compression)
            except CompressionError as exc:
                raise EngineError("state.compression", str(exc)) from None
        self.state = state

    def resume(self) -> bool:
        """Restore from ``state_dir`` if a state was saved there; whether one was."""
        if not self.state_path.exists():
            return False
        self.restore(self.state_path.read_bytes())
        return True

    # -- before round 1 -------------------------------------------------------------

    async def prepare(self) -> None:
        """Make the engine ready for its next round: the round-0 model from the trainer
        when there is no saved state (the engine was given none), then the federation's
        statistics when the trainer asks for them (summed once, kept in the state)."""
        self._doing("starting")
        if not self.state.model:
            source = getattr(self.trainer, "initial_model", None)
            if source is None:
                raise EngineError("trainer", "no initial model: the trainer builds none")
            model = await asyncio.to_thread(source)
            self.state.model = {k: np.asarray(v, dtype=np.float32) for k, v in model.items()}
            if not self.state.model:
                raise EngineError("trainer", "the trainer's initial model holds no arrays")
            check_update(self.state.model, self.state.model)
            self.debug_export.initial(self.state.model)
        local_stats = getattr(self.trainer, "statistics", None)
        if local_stats is None:
            return
        if self.state.statistics is None:
            mine = await asyncio.to_thread(local_stats)
            if mine is None:
                return
            self.state.statistics = await self._sum_statistics(np.asarray(mine, np.float64))
            await asyncio.to_thread(self.save_state)
        self.trainer.use_statistics(self.state.statistics)  # type: ignore[attr-defined]

    async def _sum_statistics(self, local: np.ndarray) -> np.ndarray:
        """The secure sum of every participant's statistics vector (run ``KEY:stats``).

        These are released to every participant without DP noise, so a run with an
        epsilon refuses them. The masked sum uses a 64-bit ring of its own with room for
        values up to 2^40 per participant.
        """
        if self.dp is not None:
            raise EngineError(
                "trainer",
                "the trainer asks for statistics summed without DP noise, which a run with "
                "an epsilon cannot release (the tabular trainer: set config standardize=false)",
            )
        if local.ndim != 1 or not local.size or not np.isfinite(local).all():
            raise UpdateRejected("statistics", "expected a non-empty finite float vector")
        run = f"{self.plan.run_key}:stats"
        bound = self.stats_sum.bound_per_participant(len(self.plan.participants))
        if float(np.max(np.abs(local))) > bound:
            way_out = ", or use the masked backend" if bound < STATS_CLIP else ""
            raise UpdateRejected(
                "statistics",
                f"a statistic exceeds {bound:g}, the {self.stats_sum.name} sum's range per "
                f"participant: scale the data down{way_out} (the tabular trainer: or "
                "standardize=false)",
            )
        vector = self.stats_sum.encode(local)

        async def attempt(a: int) -> np.ndarray:
            summed = await self.stats_sum.run_round(
                run,
                a,
                vector,
                participants=self.plan.participants,
                threshold=self.plan.threshold,
                deadline=self.clock() + self.config.ready_timeout_s,
            )
            return summed.total

        return await self._retry("statistics", attempt)

    async def _retry(
        self, what: str, attempt: Callable[[int], Awaitable[np.ndarray]]
    ) -> np.ndarray:
        last: RoundFailed | None = None
        for a in range(self.config.max_attempts):
            try:
                return await attempt(a)
            except RoundFailed as exc:
                logger.warning("%s: %s attempt %d failed: %s", self.org, what, a, exc)
                last = exc
        raise RunFailed(f"the {what} sum failed {self.config.max_attempts} times: {last}")

    def close(self) -> None:
        """The run is over at this node: let the trainer release its worker."""
        closer = getattr(self.trainer, "close", None)
        if closer is not None:
            closer()

    # -- one round ------------------------------------------------------------------

    def _train(self, model: Model, round: int) -> LocalResult:
        """The local job (in a worker thread), from the agreed model (under a
        compression, plus what this org has not sent yet:
        :meth:`Compressor.local_start`)."""
        start = model if self.compressor is None else self.compressor.local_start(model)
        return self.trainer.train(start, round, self.strategy.local_config())

    def _pack(self, result: LocalResult) -> np.ndarray:
        packed = pack_update(
            result,
            sorted(self.state.model),
            weighting=self.config.weighting,
            fednova=self.config.fednova,
        )
        if self.dp is not None:  # DP clips anyway: first, so the range check sees the clip
            packed, _factor = clip_l2(packed, self.dp.l2_clip)
        bound = self.secure_sum.bound_per_participant(len(self.plan.participants))
        if float(np.max(np.abs(packed))) > bound:
            raise UpdateRejected(
                "update",
                f"a packed coordinate exceeds {bound:g}, the {self.secure_sum.name} sum's range "
                "per participant: use uniform weighting or fewer local steps (the masked "
                "backend: or raise engine.clip)",
            )
        return packed

    def _protect(self, packed: np.ndarray) -> np.ndarray:
        if self.compressor is not None:  # never with DP (RunSpec refuses it)
            return self.compressor.encode(packed, self.rng)
        if self.dp is not None:
            ring, _factor = protect_update(packed, codec=self.codec, dp=self.dp, rng=self.rng)
            return ring
        return self.codec.encode(packed, self.rng)

    async def _aggregate(self, round: int, vector: np.ndarray) -> _Aggregate:
        """The secure sum of this round (decoded). An attempt that fails is tried again
        under a later protocol round: at once when a peer already runs a later attempt
        of this round (attempt alignment), otherwise after a bounded exponential
        backoff; the run fails only once the round has waited the run spec's
        ``quorum_wait_s`` (:mod:`org_node.quorum`)."""
        base = round * ATTEMPTS
        attempt = self._later_attempt(base - 1, base)  # join peers already further on
        wait = QuorumWait(round + 1, self.clock(), self.plan.threshold)
        while True:
            wait.attempt = attempt + 1
            try:
                summed = await self.secure_sum.run_round(
                    self.plan.run_key,
                    base + attempt,
                    vector,
                    participants=self.plan.participants,
                    threshold=self.plan.threshold,
                    deadline=self.clock() + self.config.ready_timeout_s,
                    ring_bits=0 if self.compressor is None else self.compressor.ring_bits(),
                )
            except RoundFailed as exc:
                logger.warning("%s: round %d attempt %d failed: %s", self.org, round, attempt, exc)
                if await self.try_catch_up():
                    self.quorum = None
                    raise _CaughtUp from None
                attempt = await self._wait_for_quorum(wait, base, attempt, exc)
                continue
            self.quorum = None
            return _Aggregate(
                summed.total,
                summed.survivors,
                summed.dropped,
                attempt + 1,
                summed.bytes_sent,
                wait.waited(self.clock()) if wait.failures else 0.0,
                summed.ring_bytes_sent,
            )

    def _later_attempt(self, after: int, base: int) -> int:
        """The attempt (0-based) of the round at ``base`` that peers run after protocol
        round ``after``, if their ``ready`` is buffered here; else ``after + 1 - base``."""
        later = self.rounds.later_attempt(self.plan.run_key, after, base + ATTEMPTS)
        return (after + 1 if later is None else later) - base

    async def _wait_for_quorum(
        self, wait: QuorumWait, base: int, attempt: int, failed: RoundFailed
    ) -> int:
        """After a failed attempt: fail the run once the round waited ``quorum_wait_s``,
        otherwise back off (shown as the ``quorum`` activity) and return the next
        attempt, joining at once a later one that peers run."""
        superseded = failed.reason.startswith("superseded")
        if not superseded:
            wait.failures += 1
            wait.missing, wait.reason = failed.missing, str(failed)
        now = self.clock()
        if wait.waited(now) >= self.plan.quorum_wait_s or attempt + 1 >= ATTEMPTS:
            raise RunFailed(
                f"round {wait.round} found no quorum of {wait.threshold} in "
                f"{wait.waited(now):.0f} s ({wait.failures} attempts, quorum_wait_s "
                f"{self.plan.quorum_wait_s:g}); last: {failed}"
            )
        self.quorum = wait
        self._doing("quorum")
        cfg = self.config
        delay = backoff_s(wait.failures, cfg.quorum_backoff_s, cfg.quorum_backoff_max_s)
        wait.next_at = now + (0.0 if superseded else delay)
        run, until = self.plan.run_key, base + ATTEMPTS
        found = await back_off(
            wait, self.clock, lambda: self.rounds.later_attempt(run, base + attempt, until)
        )
        later = base + attempt if found is None else found - 1  # a peer runs it: join
        return min(ATTEMPTS - 1, max(attempt + 1, self._later_attempt(later, base)))

    def _doing(self, what: str) -> None:
        """Note what the engine does from now on (``starting``, ``training``,
        ``aggregating``, ``quorum`` (waiting for one: :attr:`quorum`), ``verifying``,
        ``checkpointing``, ``paused``), unless it already does it."""
        if self.activity[0] != what:
            self.activity = (what, self.clock())

    @property
    def org(self) -> str:
        return self.rounds.org_id

    async def run_one_round(self) -> RoundReport:
        """Train, protect, aggregate, step, verify and persist round ``state.round``."""
        r = self.state.round
        model = self.state.model
        names = sorted(model)
        charge = self._charge_for(model)  # BudgetExceeded: hard stop before the round
        t_round = time.monotonic()
        self._doing("training")
        result = await asyncio.to_thread(self._train, model, r)
        t_trained = time.monotonic()
        check_update(result.update, model)
        packed = self._pack(result)
        self.debug_export.update(r, packed)
        await self.debug_export.held(r)
        if self.compressor is not None:  # the round's support: hashes the model, off the loop
            await asyncio.to_thread(
                self.compressor.start_round,
                self.plan.run_key,
                r,
                model,
                packing_scale(result, weighting=self.config.weighting, fednova=self.config.fednova),
            )
        try:
            vector = self.secure_sum.encode(packed)
        except SecAggError as exc:
            raise UpdateRejected("update", str(exc)) from None
        if self.compressor is not None:  # what the sum carries of this org (harness check)
            self.debug_export.update(r, self.compressor.contribution())
        t_sum = time.monotonic()
        self._doing("aggregating")
        try:
            agg = await self._aggregate(r, vector)
        except Exception:
            if charge is not None:  # the protected update may be out: the least noise
                charge(self.plan.threshold)
                await asyncio.to_thread(self.save_state)
            raise
        secure_sum_s = time.monotonic() - t_sum
        epsilon = None if charge is None else charge(len(agg.survivors))
        attempts = agg.attempts
        summed, weight = unpack_sum(
            agg.total,
            model,
            fednova=self.config.fednova,
            public_count=len(agg.survivors) if self.dp is not None else None,
        )
        params = [model[k] for k in names]
        new_params = self.strategy.step(params, summed, weight)
        new_model = dict(zip(names, (np.asarray(p) for p in new_params), strict=True))
        digest = model_hash(new_model)
        protocol_round = r * ATTEMPTS + attempts - 1
        self._doing("verifying")
        await self.secure_sum.check_model_hash(
            self.plan.run_key,
            protocol_round,
            digest,
            agg.survivors,
            timeout=self.config.model_hash_timeout_s,
        )
        if self.compressor is not None:
            self.compressor.commit(len(agg.survivors))
        self.state.model = new_model
        self.state.round = r + 1
        await self._persist(r + 1)
        metrics = {k: float(v) for k, v in result.metrics.items() if math.isfinite(v)}
        metrics.setdefault("local_compute_s", t_trained - t_round)
        metrics["secure_sum_s"] = secure_sum_s
        metrics["quorum_wait_s"] = agg.waited_s
        metrics["ring_bytes_sent"] = float(agg.ring_bytes_sent)
        metrics["round_s"] = time.monotonic() - t_round
        report = RoundReport(
            run_key=self.plan.run_key,
            round=r + 1,
            model_hash=digest.hex(),
            survivors=agg.survivors,
            dropped=agg.dropped,
            attempts=attempts,
            local_steps=result.steps,
            examples=result.num_examples,
            metrics=metrics,
            epsilon_spent=epsilon,
            bytes_sent=agg.bytes_sent,
        )
        if self.on_round is not None:
            done = self.on_round(report)
            if done is not None:
                await done
        return report

    async def _persist(self, done: int) -> None:
        """Save the state after round ``done`` (it fsyncs: off the loop) and, every
        ``checkpoint_every`` rounds, push it as shards (a lost checkpoint never stops
        training)."""
        data = await asyncio.to_thread(self.save_state)
        every = self.config.checkpoint_every
        if self.checkpoint is not None and every and done % every == 0:
            self._doing("checkpointing")
            try:
                await self.checkpoint(data, done)
            except Exception as exc:
                logger.warning("%s: checkpoint of round %d failed: %s", self.org, done, exc)

    def _charge_for(self, model: Model) -> Callable[[int], float] | None:
        """For a run with DP: check that a round fits the budget at the least noise a
        completed round can carry (``threshold`` survivors' shares; raises
        :class:`BudgetExceeded`), and return what charges the round for the noise of
        its survivors, once released (the epsilon spent after it). None without DP."""
        if self.budget is None or self.dp is None:
            return None
        budget, noise = self.budget, self.dp
        dim = sum(int(np.size(v)) for v in model.values()) + 1 + int(self.config.fednova)
        budget.check(skellam_round_for(noise, dim, self.plan.threshold))
        return lambda survivors: budget.record(skellam_round_for(noise, dim, survivors))

    async def try_catch_up(self) -> bool:
        """Adopt a newer model the other participants agreed on (a node back from a
        crash or a partition rejoins at the current round); whether it did.

        Only a strategy whose state is the round counter alone (FedAvg, FedProx) can
        jump rounds: its next step depends on the model only. Others raise
        :class:`RunFailed`, since their moments cannot be rebuilt from the model.
        """
        if self.catch_up is None:
            return False
        found = await self.catch_up(self.plan.run_key, self.state.round)
        if found is None:
            return False
        round, model = found
        if round <= self.state.round or round > self.plan.rounds:
            return False
        check_update(model, self.state.model)
        if self.compressor is not None and self.compressor.keeps_agreed_state:
            raise RunFailed(
                f"compression {self.plan.compression}: its q8 ranges cannot be caught up"
            )
        if any(v is not None for v in self.strategy.state_dict()["arrays"].values()):
            raise RunFailed(
                f"the federation is at round {round}, this node at {self.state.round}, and "
                f"strategy {self.strategy.name!r} keeps state that cannot be caught up"
            )
        state = self.strategy.state_dict() | {"round": round}
        self.strategy.load_state_dict(state)
        self.state.model = {k: np.asarray(v, dtype=np.float32) for k, v in model.items()}
        self.state.round = round
        self.save_state()
        logger.info("%s: caught up with the federation at round %d", self.org, round)
        return True

    async def run(self, *, paused: asyncio.Event | None = None) -> RunOutcome:
        """Run the remaining rounds; waits between rounds while ``paused`` is set.

        Before each round, and when a round's attempt fails, the node catches up
        with a newer model the others agreed on (:meth:`try_catch_up`). Returns
        ``completed`` or ``budget_exhausted``; raises :class:`RunFailed`,
        :class:`UpdateRejected` or :class:`~coordinator_free.rounds.ModelHashMismatch`.
        """
        await self.prepare()
        while self.state.round < self.plan.rounds:
            while paused is not None and paused.is_set():
                self._doing("paused")
                await asyncio.sleep(0.1)
            await self.try_catch_up()
            if self.state.round >= self.plan.rounds:
                break
            try:
                await self.run_one_round()
            except _CaughtUp:
                continue
            except RunFailed:
                if not await self.try_catch_up():
                    raise
            except BudgetExceeded as exc:
                self.state.status = "budget_exhausted"
                self.save_state()
                return RunOutcome(
                    "budget_exhausted",
                    self.state.round,
                    model_hash(self.state.model).hex(),
                    str(exc),
                )
        self.state.status = "completed"
        self.save_state()
        return RunOutcome("completed", self.state.round, model_hash(self.state.model).hex())
