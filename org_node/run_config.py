"""What a run is and how this node runs it: the ``[engine]`` and ``[training]`` tables of
the node config (:class:`EngineConfig`, :class:`TrainingConfig`), the accepted run
(:class:`RunPlan`) and its federation-wide key (:func:`run_key`).

Every value is checked when the dataclass is built; an error is an
:class:`EngineError` whose ``field`` names the ``table.key`` at fault.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from coordinator_free.validate import check_integer, check_keys, check_number

from org_node.dp_spec import NOISE_FOR, DpMechanism, DpMechanismError

__all__ = [
    "ATTEMPTS",
    "QUORUM_WAIT_DEFAULT_S",
    "QUORUM_WAIT_MAX_S",
    "WORKER_MODES",
    "EngineConfig",
    "EngineError",
    "RunPlan",
    "TrainingConfig",
    "UpdateRejected",
    "run_key",
]

ATTEMPTS = 4096
"""Protocol rounds reserved per training round: attempt ``a`` of round ``r`` runs as
protocol round ``r * ATTEMPTS + a`` (the one constant the engine, the node's round
engine and the audit report share). A round waiting for a quorum makes at most this
many attempts: with the backoff capped at ``quorum_backoff_max_s`` (30 s) that is more
than a day, the longest ``quorum_wait_s`` a run spec may ask for."""

QUORUM_WAIT_MAX_S = 86400.0
"""The longest ``quorum_wait_s`` a run spec may ask for (one day)."""

QUORUM_WAIT_DEFAULT_S = 3600.0
"""How long one round waits for a quorum when the run spec does not say."""


class EngineError(Exception):
    """A run the engine cannot carry out as configured; the message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class UpdateRejected(EngineError):
    """A local update that must not enter the secure sum (shape, names, NaN/Inf)."""


@dataclass(frozen=True)
class EngineConfig:
    """How this node runs rounds (the ``[engine]`` table of the node config).

    strategy / strategy_options: the federated strategy (``fedavg``, ``fedprox``,
        ``fedadam``, ...) and its options; every participant must use the same.
    weighting: ``examples`` (an org's weight is the examples it trained on) or
        ``uniform`` (weight 1).
    fednova: normalize each update by its step count (FedNova); off gives FedAvg's
        plain weighted mean of the deltas.
    ring_bits: width of the ring ``Z_2^b`` the secure sum runs in (32 or 64).
    clip: per-coordinate clip of the fixed-point codec, in float units; must cover the
        largest packed coordinate (``weight * tau`` with FedNova).
    frac_bits: codec fraction bits; None picks the most that fit (24 under DP).
    model_seed: seed of the round-0 model (the same on every node).
    checkpoint_every: push erasure-coded state every this many rounds (0: never).
    ready_timeout_s: how long a round waits for every participant's ``ready``.
    owner_unmask_from: from this many participants on, each unmasks only the chunks
        of the sum it holds (``RoundConfig.owner_unmask_from``); 0 turns it off. Every
        participant must use the same.
    mask_helper: where this node expands its masks (``RoundConfig.mask_helper``):
        ``process`` (a helper process, streamed into the ring), ``thread`` (a worker
        thread before the ring) or ``auto`` (the helper from four cores on). The sum is
        the same either way: each participant chooses its own.
    prepared_masks_mb: when a round completes, expand the masks of this node's next
        round of the run while its next update trains, into one ring array of at most
        this many MiB held until that round (``RoundConfig.prepared_masks_bytes``); 0
        turns it off. The sum is the same either way: each participant chooses its own.
    ring_first: where the participants are agreed by the token, start the ring
        at once when this node saw every participant ready and holding its shares,
        the ring's completion settling the participants with no message
        (``RoundConfig.ring_first``); ``false`` runs the token and waits for
        its decision. Each participant chooses its own.
    model_hash_timeout_s: how long the model-hash check waits for the survivors.
    max_attempts: attempts of the secure sum of the pre-training statistics before the
        run fails (at most ``ATTEMPTS``); a training round instead waits for a quorum
        up to the run spec's ``quorum_wait_s``.
    quorum_backoff_s / quorum_backoff_max_s: a round that found no quorum tries again
        after ``quorum_backoff_s``, doubling each time up to ``quorum_backoff_max_s``
        (at once when a peer already runs a later attempt).
    l2_clip / noise_multiplier / delta / noise_for: this org's DP mechanism (with
        ``frac_bits``, 24 when unset): L2 bound of the packed vector, noise std of the
        sum over ``l2_clip``, the delta at which epsilon is accounted, and for whom each
        org's noise share is sized (``participants`` or ``threshold``). A run with an
        epsilon carries its mechanism in its spec (:class:`org_node.dp_spec.DpMechanism`);
        the node proposes runs with this one and refuses a run with any other.
    """

    strategy: str = "fedavg"
    strategy_options: Mapping[str, Any] = field(default_factory=dict)
    weighting: str = "examples"
    fednova: bool = True
    ring_bits: int = 64
    clip: float = 1.0e6
    frac_bits: int | None = None
    model_seed: int = 0
    checkpoint_every: int = 1
    ready_timeout_s: float = 30.0
    owner_unmask_from: int = 8
    mask_helper: str = "auto"
    prepared_masks_mb: int = 64
    ring_first: bool = True
    model_hash_timeout_s: float = 30.0
    max_attempts: int = 3
    quorum_backoff_s: float = 1.0
    quorum_backoff_max_s: float = 30.0
    l2_clip: float = 1.0e4
    noise_multiplier: float = 1.0
    delta: float = 1e-5
    noise_for: str = "participants"

    def __post_init__(self) -> None:
        from org_node.strategies import StrategyError, make_strategy  # numpy: on use only

        s = "engine"
        try:
            make_strategy(self.strategy, self.strategy_options)
        except StrategyError as exc:
            raise EngineError(f"{s}.strategy", str(exc)) from None
        if self.weighting not in ("examples", "uniform"):
            raise EngineError(f"{s}.weighting", "expected 'examples' or 'uniform'")
        if not isinstance(self.fednova, bool):
            raise EngineError(f"{s}.fednova", "expected true or false")
        if self.ring_bits not in (32, 64):
            raise EngineError(f"{s}.ring_bits", "expected 32 or 64")
        check_number(f"{s}.clip", self.clip, EngineError)
        if self.frac_bits is not None:
            check_integer(f"{s}.frac_bits", self.frac_bits, EngineError)
        check_integer(f"{s}.model_seed", self.model_seed, EngineError)
        check_integer(f"{s}.checkpoint_every", self.checkpoint_every, EngineError)
        check_number(f"{s}.ready_timeout_s", self.ready_timeout_s, EngineError)
        check_integer(f"{s}.owner_unmask_from", self.owner_unmask_from, EngineError)
        if 0 < self.owner_unmask_from < 3:
            raise EngineError(f"{s}.owner_unmask_from", "expected 0 (off) or at least 3")
        if self.mask_helper not in ("auto", "process", "thread"):
            raise EngineError(f"{s}.mask_helper", "expected 'auto', 'process' or 'thread'")
        check_integer(f"{s}.prepared_masks_mb", self.prepared_masks_mb, EngineError)
        if not isinstance(self.ring_first, bool):
            raise EngineError(f"{s}.ring_first", "expected true or false")
        check_number(f"{s}.model_hash_timeout_s", self.model_hash_timeout_s, EngineError)
        check_integer(f"{s}.max_attempts", self.max_attempts, EngineError, low=1)
        if self.max_attempts > ATTEMPTS:
            raise EngineError(f"{s}.max_attempts", f"at most {ATTEMPTS}")
        check_number(f"{s}.quorum_backoff_s", self.quorum_backoff_s, EngineError)
        check_number(f"{s}.quorum_backoff_max_s", self.quorum_backoff_max_s, EngineError)
        if self.quorum_backoff_max_s < self.quorum_backoff_s:
            raise EngineError(f"{s}.quorum_backoff_max_s", "must be at least quorum_backoff_s")
        check_number(f"{s}.l2_clip", self.l2_clip, EngineError)
        check_number(
            f"{s}.noise_multiplier", self.noise_multiplier, EngineError, low=0, open_low=False
        )
        check_number(f"{s}.delta", self.delta, EngineError)
        if self.delta >= 1:
            raise EngineError(f"{s}.delta", "must be < 1")
        if self.noise_for not in NOISE_FOR:
            raise EngineError(f"{s}.noise_for", f"expected one of {', '.join(NOISE_FOR)}")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> EngineConfig:
        """Build from a TOML table; unknown keys are an error naming the key."""
        return cls(**check_keys(cls, values, "engine", EngineError))


WORKER_MODES = ("persistent", "per-round")


@dataclass(frozen=True)
class TrainingConfig:
    """The local job's settings (the ``[training]`` table; :class:`LocalJobSpec` fields,
    and how the local worker runs).

    local_steps / time_budget_s: a step count, a time budget (a slow org), or both.
    partition_index / num_partitions / partition_seed / dirichlet_alpha: which share of
        a bundled task's data this org trains on (demos and tests); a Flower app sees
        them as ``partition-id`` / ``num-partitions`` in its ``node_config``.
    worker: ``persistent`` keeps the local worker (torchrun ranks, or the Flower
        client's process) for the whole run and restarts it only if it dies;
        ``per-round`` starts a fresh one every round.
    round_timeout_s: how long one round's local training may take before the worker is
        stopped and the round fails at this org.
    start_timeout_s: how long the worker may take to start and build the round-0 model.
    node_config: extra entries of this org's Flower ``node_config`` (and task context).
    """

    local_steps: int | None = 10
    time_budget_s: float | None = None
    batch_size: int = 32
    lr: float = 1e-3
    optimizer: str = "adamw"
    momentum: float = 0.0
    weight_decay: float = 0.0
    seed: int = 0
    device: str = "cpu"
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    partition_index: int = 0
    num_partitions: int = 1
    partition_seed: int = 0
    dirichlet_alpha: float | None = None
    evaluate: bool = True
    worker: str = "persistent"
    round_timeout_s: float = 3600.0
    start_timeout_s: float = 300.0
    node_config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from org_node.training import LocalJobSpec, SpecError

        try:
            LocalJobSpec(task="tabular", **self.job_fields())
        except SpecError as exc:
            raise EngineError(f"training.{exc.field}", str(exc)) from None
        if self.worker not in WORKER_MODES:
            raise EngineError("training.worker", f"expected one of {', '.join(WORKER_MODES)}")
        check_number("training.round_timeout_s", self.round_timeout_s, EngineError)
        check_number("training.start_timeout_s", self.start_timeout_s, EngineError)
        if not isinstance(self.node_config, Mapping):
            raise EngineError("training.node_config", "must be a table of names to values")
        for key, value in self.node_config.items():
            if not isinstance(value, bool | int | float | str):
                raise EngineError(
                    f"training.node_config.{key}", "expected a boolean, number or string"
                )

    def job_fields(self) -> dict[str, Any]:
        """The :class:`LocalJobSpec` fields among these settings."""
        values = asdict(self)
        for name in ("worker", "round_timeout_s", "start_timeout_s", "node_config"):
            values.pop(name)
        return values

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> TrainingConfig:
        return cls(**check_keys(cls, values, "training", EngineError))


@dataclass(frozen=True)
class RunPlan:
    """What this node runs: the federation-wide run key and the accepted run spec.

    ``participants`` are the orgs that take part in its rounds: the spec's, or those
    that consented when a spec's ``quorum`` let the run start without the others.
    """

    run_key: str
    trainer: str
    rounds: int
    participants: tuple[str, ...]
    backend: str = "masked"
    threshold: int = 2
    epsilon: float | None = None
    name: str = ""
    spec: Mapping[str, Any] = field(default_factory=dict, compare=False)
    quorum_wait_s: float = QUORUM_WAIT_DEFAULT_S
    dp: DpMechanism | None = None
    compression: str = "none"

    def check_runnable(self, org_id: str, *, has_ckks: bool) -> None:
        """Refuse a plan this org cannot run: an unknown backend, CKKS without the node's
        aggregator or with an epsilon, or an org that is not a participant."""
        if self.backend == "ckks":
            if not has_ckks:
                raise EngineError("backend", "a CKKS run needs the node's CkksAggregator")
            if self.epsilon is not None:
                raise EngineError(
                    "epsilon", "DP noise shares need the masked backend; CKKS runs take no epsilon"
                )
        elif self.backend != "masked":
            raise EngineError("backend", f"unknown backend {self.backend!r}")
        if org_id not in self.participants:
            raise EngineError("participants", f"{org_id!r} is not a participant")

    @classmethod
    def from_spec(
        cls, name: str, spec: Mapping[str, Any], members: Sequence[str] | None = None
    ) -> RunPlan:
        """The plan of the run ``name`` with the (accepted) run spec ``spec``; ``members``:
        the participants that consented to a run started at its quorum (default: all)."""
        everyone = tuple(sorted(spec["participants"]))
        taking_part = everyone if members is None else tuple(sorted(set(members)))
        threshold = int(spec.get("threshold", 2))
        if not set(taking_part) <= set(everyone):
            strangers = ", ".join(sorted(set(taking_part) - set(everyone)))
            raise EngineError("participants", f"{strangers} are not among the run's participants")
        if len(taking_part) < threshold:
            raise EngineError(
                "participants",
                f"{len(taking_part)} members take part, fewer than the threshold {threshold}",
            )
        return cls(
            name=name,
            spec=dict(spec),
            run_key=run_key(name, spec),
            trainer=str(spec["trainer"]),
            rounds=int(spec["rounds"]),
            participants=taking_part,
            backend=str(spec.get("backend", "masked")),
            threshold=threshold,
            epsilon=None if spec.get("epsilon") is None else float(spec["epsilon"]),
            quorum_wait_s=float(spec.get("quorum_wait_s") or QUORUM_WAIT_DEFAULT_S),
            dp=_dp_of(spec),
            compression=str(spec.get("compression") or "none"),
        )


def _dp_of(spec: Mapping[str, Any]) -> DpMechanism | None:
    """The spec's DP mechanism (None for a run without one)."""
    if spec.get("dp") is None:
        return None
    try:
        return DpMechanism.from_dict(spec["dp"])
    except DpMechanismError as exc:
        raise EngineError("dp", str(exc)) from None


def run_key(name: str, spec: Mapping[str, Any]) -> str:
    """The federation-wide id of a run: SHA-256 of its name and canonical spec (32 hex).

    Each org records the run under its own local id; orgs that accepted the same name
    and spec take part in the same rounds.
    """
    defaults = {
        "backend": "masked",
        "threshold": 2,
        "epsilon": None,
        "trainer_hash": None,
        "quorum": None,
        "dp": None,
    }
    body: dict[str, Any] = defaults | {"data": None, "config": {}} | dict(spec)
    body["participants"] = sorted(body.get("participants", ()))
    if body.get("epsilon") is not None:
        body["epsilon"] = repr(float(body["epsilon"]))
    if body.get("dp") is not None:
        body["dp"] = DpMechanism.from_dict(body["dp"]).key_body()
    wait = body.pop("quorum_wait_s", None)
    if wait is not None and float(wait) != QUORUM_WAIT_DEFAULT_S:
        # only a wait other than the default enters the key: a spec from before the
        # field keeps its key
        body["quorum_wait_s"] = repr(float(wait))
    if body.get("compression", "none") in (None, "none"):
        body.pop("compression", None)  # likewise: only a compression enters the key
    if body.get("data") is not None:
        from org_node.datasets import DataSpec

        body["data"] = DataSpec.from_dict(body["data"]).to_dict()
    from coordinator_free.manifest import canonical_json

    digest = hashlib.sha256(canonical_json({"name": name, "spec": body})).hexdigest()
    return digest[:32]
