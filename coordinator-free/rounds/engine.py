"""The round engine: one org's side of leaderless secure-aggregation rounds.

Every org node runs one :class:`RoundEngine`. There is no coordinator: each stage is a
signed exchange among the participants, and every decision that must be shared is
settled by the agreement (:mod:`~coordinator_free.rounds.agreement`). A round of
:meth:`RoundEngine.run_round` (``docs/ARCHITECTURE.md``, "A round", steps 1, 3-5;
Bonawitz et al., CCS'17, §4) is a pipeline of stages over one
:class:`~coordinator_free.rounds.context.StageContext`:

ready (:mod:`~coordinator_free.rounds.ready`) → share → agree on the participants
(:mod:`~coordinator_free.rounds.share`) → mask → reduce, each ring attempt followed
by the agreement on its outcome (:mod:`~coordinator_free.rounds.reduce`) → unmask
(:mod:`~coordinator_free.rounds.unmask`) → done.

Fewer than ``t`` orgs at any stage fail the round with :class:`RoundFailed`, its stage
and a reason; a node whose round fails tells the others (``round.leave``) so that none
waits out a timeout for it. After the strategy steps, :meth:`RoundEngine.check_model_hash`
compares the next model's digest with the participants'
(:mod:`~coordinator_free.rounds.model_hash`).

The cost per node is about ``(n - 1) / 2`` small signed requests (and as many
replies) for the ready stage, whose readies carry each org's shares sealed a round
ahead (:mod:`~coordinator_free.rounds.ahead`; the share stage's requests go only to
the pairs whose shares could not ride, every pair in a first round; the pairwise
shares of Bonawitz et al. make ``O(n)`` bytes inherent; from ``RoundConfig.ready_relay_from`` members on the
readies are relayed in ``ceil(log2 n)`` requests, :mod:`~coordinator_free.rounds.ready_relay`), ``ceil(log2 n)`` for the seeds (or ``(n - 1) / 2`` for the
releases), plus about ``2 (n - 1) / n`` times the vector along the ring. Above
``RoundConfig.secagg_plus_above`` members the masked sum runs as SecAgg+ (Bell et al.,
CCS'20, §3): ShareKeys go to the ``k = O(log n)`` graph neighbours only, each node
masks with ``k`` pairwise seeds and reconstructs each secret from ``k // 2 + 1``
neighbourhood shares, so the share stage costs ``O(k)`` messages per node and the
cryptography ``O(n k)`` instead of ``O(n^2)``; the sum stays exact: every survivor's
pairwise masks cancel or are removed from its neighbours' reconstructed keys.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterable

import numpy as np
from coordinator_free.endpoint import Endpoint, Handler
from coordinator_free.errors import Refused
from coordinator_free.ring import RingReducer
from coordinator_free.ring.wire import NARROW_BITS
from coordinator_free.rounds import wire
from coordinator_free.rounds.agreement import Agreement
from coordinator_free.rounds.ahead import AheadKeys
from coordinator_free.rounds.config import RoundConfig, StageHook
from coordinator_free.rounds.context import StageContext
from coordinator_free.rounds.mask_stream import helper as mask_helper
from coordinator_free.rounds.mask_stream import uses_helper
from coordinator_free.rounds.messenger import Messenger, refusal_kind
from coordinator_free.rounds.model_hash import ModelHashes
from coordinator_free.rounds.prepared import MaskList, MaskPreparer
from coordinator_free.rounds.ready import ReadyStage
from coordinator_free.rounds.ready_relay import ReadyRelay
from coordinator_free.rounds.reduce import ReduceStage
from coordinator_free.rounds.results import (
    MASKS_PREPARED,
    RoundFailed,
    RoundObserver,
    RoundProgress,
    RoundResult,
)
from coordinator_free.rounds.session import SessionFactory, endpoint_signer, secagg_sessions
from coordinator_free.rounds.share import ShareStage
from coordinator_free.rounds.state import Admission, Counters, RoundTable
from coordinator_free.rounds.sums import SumServer
from coordinator_free.rounds.unmask import UnmaskStage
from coordinator_free.wire import Envelope

from secure_agg.codec import FixedPointCodec

__all__ = ["RoundEngine"]


class RoundEngine:
    """Runs leaderless secure-aggregation rounds for one org over its :class:`Endpoint`.

    peers: the federation's members (the manifest's list, the same on every node: it
    is ``U0`` of the masked sum); this org may be among them. session_factory builds
    this org's masked-sum session for a round. live: optionally, the members not known
    to have failed (the membership layer's view, suspects included): the ready stage
    stops waiting before its deadline once at least ``t`` members are ready and every
    missing one has left this view (confirmed dead), and a ring step pings a
    predecessor it waits on as soon as that one leaves the view.
    hook: the simulator's fault-injection seam. observer: called with each
    :class:`RoundObservation` (stage times, arrivals, refusals, dropouts); more can be
    added with :meth:`add_observer`. admit: the runs peers may open rounds of, and
    their participants (:data:`~coordinator_free.rounds.state.Admission`); ``None``
    admits every run of every member.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        peers: Callable[[], Iterable[str]],
        session_factory: SessionFactory,
        config: RoundConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
        hook: StageHook | None = None,
        live: Callable[[], Iterable[str]] | None = None,
        observer: RoundObserver | None = None,
        admit: Admission | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.observers: list[RoundObserver] = [observer] if observer is not None else []
        self.peers = peers
        self.session_factory = session_factory
        self.config = config or RoundConfig()
        self.clock = clock
        self.hook = hook
        self.live = live
        self.ring = RingReducer(endpoint)
        self._net = Messenger(endpoint, self.config, self.observers)
        self._table = RoundTable(endpoint.org_id, self.config, self.ring, admit)
        self._agreement = Agreement(self._net, self._table, self.config)
        self._sums = SumServer(self._net, self._table, self.config)
        relay = ReadyRelay(self._table, self._net, endpoint.federation, *endpoint_signer(endpoint))
        # the keys shares are sealed to a round ahead: in this node's memory only
        self.ahead_keys = AheadKeys()
        self._ready = ReadyStage(
            self._table, endpoint.federation, peers, session_factory, relay, self.ahead_keys
        )
        # the masks of each run's next round, expanded while its update trains
        self._prepared = MaskPreparer()
        self._next_masks: dict[str, tuple[int, Callable[[], MaskList], int]] = {}
        self.prepare_on_done = True
        """Whether the masks of a run's next round start expanding as soon as a round
        completes; a caller that times rounds of many nodes sharing cores turns it off
        and calls :meth:`prepare_masks` once all are done (in a deployment each org has
        its cores to itself)."""
        self._share = ShareStage(self._table, self.config, self._agreement, self._prepared)
        self._reduce = ReduceStage(self.ring, self._agreement, self._sums)
        self._unmask = UnmaskStage(self._table, self.config, self.ring, self._sums)
        self.model_hashes = ModelHashes(self._net, self.config, self._table.last_done)
        for kind, handler in (
            (wire.KIND_READY, self._ready.on_ready),
            (wire.KIND_READIES, relay.on_readies),
            (wire.KIND_VIEW, self._agreement.on_view),
            (wire.KIND_SHARE, self._share.on_share),
            (wire.KIND_UNMASK, self._unmask.on_unmask),
            (wire.KIND_TOKEN, self._agreement.on_token),
            (wire.KIND_LEAVE, self._on_leave),
            (wire.KIND_MODEL, self.model_hashes.on_model),
            (wire.KIND_TOTAL, self._sums.on_total),
            (wire.KIND_PART, self._sums.on_part),
            (wire.KIND_SEED, self._unmask.on_seed),
            (wire.KIND_PERMIT, self._unmask.on_permit),
        ):
            endpoint.on(kind, self._observed(kind, handler))

    @classmethod
    def secure(
        cls,
        endpoint: Endpoint,
        peers: Callable[[], Iterable[str]],
        config: RoundConfig | None = None,
        *,
        codec: FixedPointCodec | None = None,
        hook: StageHook | None = None,
        live: Callable[[], Iterable[str]] | None = None,
        admit: Admission | None = None,
    ) -> RoundEngine:
        """An engine running :mod:`secure_agg`'s masked sum, signed with the endpoint's
        identity; ``codec`` encodes float inputs (``codec.max_summands`` >= members)."""
        return cls(
            endpoint,
            peers,
            secagg_sessions(*endpoint_signer(endpoint), codec=codec),
            config,
            hook=hook,
            live=live,
            admit=admit,
        )

    @property
    def org_id(self) -> str:
        return self.endpoint.org_id

    def add_observer(self, observer: RoundObserver) -> None:
        """Also call ``observer`` with every :class:`RoundObservation` from now on."""
        self.observers.append(observer)

    def progress(self, run: str) -> RoundProgress | None:
        """The newest round of ``run`` this node is running now, and what it waits for;
        None when none runs. Call it on the engine's event loop."""
        return self._table.progress(run)

    def open_rounds(self) -> list[tuple[str, int]]:
        """The ``(run, round)`` pairs this engine holds state for (buffered or running)."""
        return self._table.open_rounds()

    def later_attempt(self, run: str, after: int, until: int) -> int | None:
        """The newest protocol round ``after < r < until`` of ``run`` that a peer runs
        and this node does not, as the peer's ``ready`` buffered here says; None when
        none. A caller that numbers the attempts of one of its rounds consecutively
        finds the attempt its peers are at (attempt alignment)."""
        return self._table.later_ready(run, after, until)

    def close_run(self, run: str) -> None:
        """``run`` ended at this node: drop everything held for it (round states, ring
        buffers, kept sums and releases, model hashes) and refuse its late messages
        until this node runs one of its rounds again (a failed run an admin resumes)."""
        self._table.close_run(run)
        self._sums.forget_run(run)
        self._unmask.forget_run(run)
        self.model_hashes.forget_run(run)
        self._prepared.forget_run(run)
        self._next_masks.pop(run, None)
        self.ahead_keys.forget_run(run)

    async def masks_prepared(self, run: str) -> int | None:
        """Once the masks this node expands for its next round of ``run`` are ready:
        that round's protocol number (``None``: none are prepared). A caller that times
        rounds waits for it before its next timing, as an org node's next update
        trains meanwhile."""
        await self._prepared.settled(run)
        return self._prepared.pending(run)

    # -- the round ----------------------------------------------------------------------

    async def run_round(
        self,
        run: str,
        round: int,
        vector: np.ndarray,
        *,
        deadline: float | None = None,
        ring_bits: int = 0,
    ) -> RoundResult:
        """Take part in round ``round`` of ``run`` with ``vector``; every survivor gets the same sum.

        ``deadline`` is the clock time (``clock()``) by which ``ready`` messages must
        be seen; ``None`` means ``ready_timeout`` from now. ``ring_bits`` (every member
        passes the same) narrows the ring of a ``uint16`` vector to one of
        :data:`~coordinator_free.ring.wire.NARROW_BITS` (16, or 0, is the storage's own
        width): only those low bits of each
        masked element travel, packed, and the sum is right modulo ``2^ring_bits``
        (the caller reads it so; the bits above are not meaningful). Raises :class:`RoundFailed`
        with the stage and the reason when the round cannot complete. Whatever the
        outcome, the round is closed afterwards: its late messages are refused and the
        next round starts clean.
        """
        if not run:
            raise ValueError("run must be a non-empty string")
        if ring_bits and (vector.dtype != np.uint16 or ring_bits not in (*NARROW_BITS, 16)):
            raise ValueError(
                f"a {ring_bits}-bit ring needs a uint16 vector and a width in {NARROW_BITS}"
            )
        table = self._table
        if (run, round) in table.running:
            raise RoundFailed("ready", f"round {round} of {run!r} is already running here")
        table.advance(run, round)  # a node that fell behind moves its window along
        table.keep_window(run, round)
        try:
            state = table.state(run, round)
        except Refused as exc:
            raise RoundFailed("ready", f"round {round} of {run!r} cannot start: {exc}") from None
        table.running.add((run, round))
        if uses_helper(self.config.mask_helper) and mask_helper().pid is None:
            self._net.spawn(asyncio.to_thread(mask_helper().warm))  # up by the share stage
        # the masked vector travels as ring elements of at most 8 bytes; a ring started
        # with U1 pending and dropped is one attempt more
        wire_bytes = max(vector.nbytes, 8 * vector.size)
        self.ring.expect(run, round, wire_bytes, self.config.max_reduce_attempts + 1)
        state.started = asyncio.get_running_loop().time()
        self._net.observe("round", run, round, "ready")
        try:
            ctx = StageContext(
                state,
                vector,
                deadline,
                self.config,
                self._net,
                self.clock,
                self.hook,
                self.live,
                ring_bits=ring_bits,
            )
            return await self._run(ctx)
        except RoundFailed as exc:
            self._net.observe("failed", run, round, exc.stage, detail=exc.reason)
            # tell the others at once, so that none waits out a timeout for this node
            await self._net.broadcast(
                Counters(),
                sorted(set(self.peers()) - {self.org_id}),
                wire.KIND_LEAVE,
                b"",
                run=run,
                round=round,
                stage="leave",
                timeout=self.config.send_timeout / 4,
            )
            raise
        finally:
            table.running.discard((run, round))
            self._sums.forget_waits(run, round)
            table.finish(run, round)

    async def _run(self, ctx: StageContext) -> RoundResult:
        """The stages, in order (``docs/ARCHITECTURE.md``, "A round")."""
        try:
            await self._ready.run(ctx)
            await self._share.run(ctx)
            await self._share.agree(ctx)
            await self._reduce.mask(ctx)
            await self._reduce.run(ctx)
            total = await self._unmask.run(ctx)
        finally:
            if ctx.mask_stream is not None:  # the round ended before its ring
                ctx.mask_stream.close()
            if ctx.u1_pending is not None:  # the round ended with U1 still pending
                ctx.u1_pending.cancel()
        return await self._done(ctx, total)

    def _prepare_next(self, ctx: StageContext) -> None:
        """Note how to expand the masks of this node's next round of the run, when that
        round's keys are known (:mod:`~coordinator_free.rounds.prepared`), and start
        it unless the caller starts it (:attr:`prepare_on_done`)."""
        cap = self.config.prepared_masks_bytes
        masking = self.ahead_keys.masking(ctx.run)
        if cap is None or masking is None or ctx.maybe_session is None:
            return
        later = self.config.attempts_end(ctx.round)
        s_pks = self.ahead_keys.masking_keys(ctx.run, ctx.u0)
        make = functools.partial(ctx.session.masks_for, later, masking, s_pks)
        self._next_masks[ctx.run] = (later, make, cap)
        if self.prepare_on_done:
            self.prepare_masks(ctx.run)

    def prepare_masks(self, run: str) -> None:
        """Start expanding the masks of this node's next round of ``run``, off the loop:
        their key agreements and their sum (nothing when the last round of ``run`` left
        none to prepare, or it was started already)."""
        job = self._next_masks.pop(run, None)
        if job is not None:
            self._prepared.start(run, *job)

    async def _done(self, ctx: StageContext, total: np.ndarray) -> RoundResult:
        """The round completed: what it gives the org node."""
        self._prepare_next(ctx)
        await ctx.enter("done")
        u1, u3 = ctx.u1, ctx.members
        order1 = tuple(ctx.state.ring_order(u1))
        # a member left out of U1 after the ring started (rounds.early) is observed as
        # dropped too, though no participant: no key of it was rebuilt
        for org in sorted((u1 - u3) | ctx.left_out):
            ctx.observe("dropped", "unmask", peer=org)
        counters = ctx.counters
        sent = counters.sent()
        self._net.observe(
            "completed",
            ctx.run,
            ctx.round,
            "done",
            seconds=time.perf_counter() - ctx.t_round,
            bytes=sent,
            detail=MASKS_PREPARED if ctx.masks_prepared else "",
        )
        return RoundResult(
            run=ctx.run,
            round=ctx.round,
            sum=total,
            participants=order1,
            survivors=tuple(o for o in order1 if o in u3),
            dropped=tuple(sorted(u1 - u3)),
            threshold=ctx.t,
            bytes_sent=sent,
            messages_sent=counters.messages_sent + counters.ring.messages_sent,
            ring_bytes_sent=counters.ring.bytes_sent,
            ring_attempts=ctx.attempt + ctx.dropped,
            stage_times=ctx.times,
            neighbours=ctx.k,
            masks_prepared=ctx.masks_prepared,
        )

    # -- handlers -----------------------------------------------------------------------

    def _observed(self, kind: str, handler: Handler) -> Handler:
        """``handler``, reporting each message's arrival time and each refusal."""
        stage = kind.partition(".")[2]
        net, table = self._net, self._table

        async def observed(env: Envelope) -> bytes | None:
            arrived = asyncio.get_running_loop().time()  # a share's reply may wait
            try:
                reply = await handler(env)
            except Refused as exc:
                net.observe(
                    refusal_kind(exc), env.run, env.round, stage, peer=env.sender, detail=str(exc)
                )
                raise
            if net.observers:
                if kind == wire.KIND_LEAVE:
                    net.observe("left", env.run, env.round, stage, peer=env.sender)
                else:
                    state = table.get(env.run, env.round)
                    net.arrival(
                        env.run,
                        env.round,
                        stage,
                        env.sender,
                        len(env.payload),
                        started=state.started if state is not None else None,
                        at=arrived,
                    )
            return reply

        return observed

    async def _on_leave(self, env: Envelope) -> bytes:
        state = self._table.state(env.run, env.round, env.sender)
        state.inbox.put(("gone",), env.sender, b"")
        return b""

    # -- the next model's hash ------------------------------------------------------------

    async def publish_model_hash(
        self, run: str, round: int, digest: bytes, peers: Iterable[str]
    ) -> set[str]:
        """Send the SHA-256 of this node's next model to ``peers``; return those not reached."""
        return await self.model_hashes.publish(run, round, digest, peers)

    async def compare_model_hash(
        self, run: str, round: int, digest: bytes, peers: Iterable[str], *, timeout: float
    ) -> frozenset[str]:
        """Wait for ``peers``' model hashes; raise :class:`ModelHashMismatch` on any
        difference (see :meth:`ModelHashes.compare`)."""
        return await self.model_hashes.compare(run, round, digest, peers, timeout=timeout)

    async def check_model_hash(
        self, run: str, round: int, digest: bytes, peers: Iterable[str], *, timeout: float
    ) -> frozenset[str]:
        """Publish this node's model hash, then compare with the peers' (both above)."""
        return await self.model_hashes.check(run, round, digest, peers, timeout=timeout)
