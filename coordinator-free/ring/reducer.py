"""The ring all-reduce of one node: :class:`RingReducer`, its handlers and its variants.

The reducer registers ``agg.chunk``, ``agg.sum``, ``agg.abort`` and ``agg.ping`` on the
node's endpoint and keeps, per open round, the chunks that arrived before anyone waited
for them. Each variant (:meth:`~RingReducer.allreduce`, its halves
:meth:`~RingReducer.reduce_scatter` and :meth:`~RingReducer.all_gather_sum`, and
:meth:`~RingReducer.star_allreduce`) is told about its attempt by the same keyword
options (:class:`RingCall`), runs its steps (:mod:`.steps`) over a :class:`~.link.Link`
and, when the ring breaks, tells the members that must stop to abort (every member,
or in the all-gathers those the break cuts off, each from the step its chunks stop
at: ``agg.abort`` carries the ring id, that step and whom it blames).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Required, TypedDict, TypeVar, Unpack

import numpy as np
from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import RefusalReason, Refused, TransportError
from coordinator_free.ring import steps
from coordinator_free.ring.link import (
    ChunkKey,
    Link,
    RingAborted,
    RingBroken,
    RingStats,
    RoundBox,
)
from coordinator_free.ring.steps import Place, StepHook
from coordinator_free.ring.wire import (
    ACK,
    HEADER,
    KIND_ABORT,
    KIND_CHUNK,
    KIND_PING,
    KIND_SUM,
    PHASE_SUM,
    PHASES,
    VERSION,
    ring_id,
)
from coordinator_free.wire import Envelope

__all__ = [
    "GatherOptions",
    "RingCall",
    "RingOptions",
    "RingReducer",
    "Scattered",
    "StarOptions",
]

_T = TypeVar("_T")

RING_DTYPES = (np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.uint64))
"""The ring arrays the reducer sums (:mod:`secure_agg.ring`'s 16-, 32- and 64-bit rings)."""


@dataclass(frozen=True)
class RingCall:
    """What every ring variant is told about the attempt it runs (its keyword options).

    run, round: the round the chunks belong to (it must be open, or is opened).
    attempt: the attempt number, bound with the ordered members into the ring id.
    stage: the stage the chunks are sent in (the envelope's, for the audit log).
    timeout: bounds each step's wait for the predecessor's chunk and each send.
    stats: counts what this member sends (a fresh :class:`RingStats` by default).
    on_step: ``on_step(phase, step)``, awaited before each step: the simulator's
        fault-injection seam.
    start_grace: added to the first wait: the members do not all start at the same
        moment (each leaves the previous stage when it has heard enough).
    feed: a part of the input that arrives while the ring runs (:class:`~.steps.InputFeed`):
        added to each chunk just before it first leaves, or all of it before a chain or
        a star starts.
    alive: ``alive(org)``, the membership layer's view: a wait pings a sender as soon
        as it is no longer believed alive (see :meth:`~.link.Link.receive`).
    bits: the ring's width when it is narrower than a ``uint16`` vector's storage
        (one of :data:`~.wire.NARROW_BITS`; 0: the dtype's): the members add modulo
        ``2^16`` and send only the low ``bits`` of each element, packed, so the sum is
        right modulo ``2^bits`` (the caller reduces it). Every member passes the same.
    """

    run: str
    round: int
    attempt: int = 0
    stage: str = "reduce"
    timeout: float = 10.0
    stats: RingStats | None = None
    on_step: StepHook | None = None
    start_grace: float = 0.0
    alive: Callable[[str], bool] | None = None
    bits: int = 0
    feed: steps.InputFeed | None = None


class _AttemptOptions(TypedDict, total=False):
    run: Required[str]
    round: Required[int]
    attempt: int
    stage: str
    timeout: float
    stats: RingStats | None
    bits: int
    feed: steps.InputFeed | None


class StarOptions(_AttemptOptions, total=False):
    """The options of :meth:`RingReducer.star_allreduce` (see :class:`RingCall`)."""

    start_grace: float


class GatherOptions(_AttemptOptions, total=False):
    """The options of :meth:`RingReducer.all_gather_sum` (see :class:`RingCall`)."""

    on_step: StepHook | None
    alive: Callable[[str], bool] | None


class RingOptions(StarOptions, GatherOptions, total=False):
    """The options of :meth:`RingReducer.allreduce` and :meth:`RingReducer.reduce_scatter`."""


@dataclass(frozen=True)
class Scattered:
    """What :meth:`RingReducer.reduce_scatter` leaves a member.

    acc: a vector of the input's length in which chunk ``own`` holds the complete sum
    that this member reduced and chunk ``held`` the complete sum its predecessor
    reduced (a copy, so a chunk outlives one of its holders); the other chunks hold
    partial sums, meaningless. bounds: the chunks' ``[lo, hi)``, from
    :func:`~.wire.chunk_bounds`. filled: the chunks complete so far (``own`` and
    ``held``, then each one :meth:`RingReducer.all_gather_sum` receives).
    """

    acc: np.ndarray
    own: int
    held: int
    bounds: list[tuple[int, int]]
    filled: set[int] = field(default_factory=set)


class RingReducer:
    """Ring all-reduce for one node: registers ``agg.chunk`` / ``agg.abort`` on its endpoint.

    A round is opened with :meth:`open` before any member can send its chunks (the
    round engine does it before its ``ready``), so early chunks are buffered, up to
    ``max_buffered_bytes`` per round and ``member_bytes`` per sender and round (until
    :meth:`expect` sizes that from the round's vector); chunks of rounds not open are
    refused.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        max_buffered_bytes: int = 1 << 30,
        member_bytes: int = 64 << 20,
    ) -> None:
        self.endpoint = endpoint
        self.max_buffered_bytes = max_buffered_bytes
        self.member_bytes = member_bytes
        self._boxes: dict[tuple[str, int], RoundBox] = {}
        endpoint.on(KIND_CHUNK, self._on_chunk)
        endpoint.on(KIND_SUM, self._on_chunk)
        endpoint.on(KIND_ABORT, self._on_abort)
        endpoint.on(KIND_PING, self._on_ping)

    # -- round bookkeeping -------------------------------------------------------

    def open(self, run: str, round: int) -> None:
        """Accept chunks for ``(run, round)`` from now on."""
        self._boxes.setdefault((run, round), RoundBox(member_cap=self.member_bytes))

    def expect(self, run: str, round: int, vector_bytes: int, attempts: int) -> None:
        """Size what one sender may buffer for ``(run, round)`` from the round's vector:
        per ring attempt a member receives at most about three vectors' worth from any
        one sender (scatter, gather and the unmasked sum; a star's hub one vector from
        each), so ``4 * attempts`` vectors and a MiB of headers."""
        box = self._boxes.get((run, round))
        if box is not None:
            box.member_cap = 4 * max(1, attempts) * vector_bytes + (1 << 20)

    def close(self, run: str, round: int) -> None:
        """Drop everything buffered for ``(run, round)``; later chunks are refused."""
        box = self._boxes.pop((run, round), None)
        if box is not None:
            for fut in box.chunks.values():
                if not fut.done():
                    fut.cancel()

    def suspects(self, run: str, round: int, order: Sequence[str], attempt: int) -> frozenset[str]:
        """The members of a ring that aborts received so far blame."""
        box = self._boxes.get((run, round))
        if box is None:
            return frozenset()
        return frozenset(box.suspects.get(ring_id(order, attempt), set()) & set(order))

    def is_open(self, run: str, round: int) -> bool:
        return (run, round) in self._boxes

    # -- handlers ------------------------------------------------------------------

    def _box_of(self, env: Envelope) -> RoundBox:
        box = self._boxes.get((env.run, env.round))
        if box is None:
            raise Refused(RefusalReason.STALE, f"no open round {env.run!r}/{env.round}")
        return box

    async def _on_chunk(self, env: Envelope) -> bytes:
        box = self._box_of(env)
        if len(env.payload) < HEADER.size:
            raise Refused(RefusalReason.MALFORMED, "chunk shorter than its header")
        version, phase, _bits, step, _index, frame, _count, rid = HEADER.unpack_from(env.payload)
        if version != VERSION or phase not in PHASES:
            raise Refused(RefusalReason.MALFORMED, "unknown chunk version or phase")
        if (phase == PHASE_SUM) != (env.kind == KIND_SUM):
            # the kind names what the bytes are (masked or summed) for the audit log
            raise Refused(RefusalReason.MALFORMED, f"a {env.kind} message of phase {phase}")
        key: ChunkKey = (env.run, env.round, rid, phase, step, frame, env.sender)
        fut = box.chunks.get(key)
        if fut is not None and fut.done():
            # a second chunk for the same slot never overwrites the first
            raise Refused(RefusalReason.REPLAY, "duplicate chunk")
        if fut is None and box.buffered + len(env.payload) > self.max_buffered_bytes:
            raise Refused(RefusalReason.OVERSIZED, "too many chunks buffered")
        held = box.held.get(env.sender, 0) + len(env.payload)
        if held > box.member_cap:
            raise Refused(
                RefusalReason.OVERSIZED,
                f"{env.sender!r} would have more than {box.member_cap} bytes of chunks buffered",
            )
        box.held[env.sender] = held
        box.buffered += len(env.payload)
        box.slot(key).set_result(env.payload)
        return ACK

    async def _on_ping(self, env: Envelope) -> bytes:
        self._box_of(env)
        return ACK

    async def _on_abort(self, env: Envelope) -> bytes:
        box = self._box_of(env)
        rid, blamed = env.payload[:16], env.payload[_ABORT_HEAD.size :]
        if len(env.payload) < _ABORT_HEAD.size or len(blamed) > 1024:
            raise Refused(
                RefusalReason.MALFORMED, "abort is a 16-byte ring id, a step and a suspect"
            )
        (_, step) = _ABORT_HEAD.unpack_from(env.payload)
        try:
            suspect = blamed.decode("utf-8")
        except UnicodeDecodeError:
            raise Refused(RefusalReason.MALFORMED, "abort suspect is not UTF-8") from None
        if suspect:
            box.suspects.setdefault(rid, set()).add(suspect)
        if step == _AT_ONCE:
            box.aborts.setdefault(rid, asyncio.Event()).set()
        else:
            box.cut(rid, step)
        return ACK

    # -- the algorithms ----------------------------------------------------------------

    def _link(self, order: Sequence[str], vector: np.ndarray, call: RingCall) -> Link:
        """Check the ring and the vector, open the round, and link this member to it."""
        me = self.endpoint.org_id
        if me not in order:
            raise ValueError(f"{me} is not in the ring {list(order)}")
        if len(set(order)) != len(order):
            raise ValueError("ring members must be distinct")
        if vector.ndim != 1 or vector.dtype not in RING_DTYPES:
            raise ValueError("the ring reduces 1-D uint16, uint32 or uint64 arrays")
        self.open(call.run, call.round)
        box = self._boxes[(call.run, call.round)]
        rid = ring_id(order, call.attempt)
        return Link(
            endpoint=self.endpoint,
            run=call.run,
            round=call.round,
            stage=call.stage,
            rid=rid,
            box=box,
            abort=box.aborts.setdefault(rid, asyncio.Event()),
            timeout=call.timeout,
            stats=call.stats if call.stats is not None else RingStats(),
            dtype=vector.dtype,
            alive=call.alive,
            bits=call.bits,
        )

    async def _run(self, order: Sequence[str], link: Link, work: Awaitable[_T]) -> _T:
        """``work``'s result; when the ring breaks, every member is told to abort."""
        try:
            return await work
        except RingBroken as exc:
            raise await self._broken(order, link, exc) from exc

    async def allreduce(
        self,
        order: Sequence[str],
        vector: np.ndarray,
        *,
        min_chunk: int = 1024,
        in_place: bool = False,
        **options: Unpack[RingOptions],
    ) -> np.ndarray:
        """The ring sum of every member's ``vector``, mod ``2^b``; a fresh array, or
        with ``in_place`` ``vector`` itself (C-contiguous and writeable), summed into
        where it lies: no copy of the vector, which is left holding partial sums
        when the ring breaks.

        ``order`` is the ring (every member passes the same list, e.g. from
        :func:`~.wire.ring_order`); ``options`` describe the attempt (:class:`RingCall`).
        Raises :class:`RingBroken` on a failure of this node's neighbours or an abort
        from any member, after telling every member to abort.

        A vector shorter than ``n * min_chunk`` elements is latency-bound, not
        bandwidth-bound: it is summed along the ring as a chain instead (reduce from
        the first member to the last, then pass the total on), ``2 (n - 1)`` messages
        in all rather than ``2 n (n - 1)``, and still at most two vectors sent per node.
        A long wait pings the sender each ``timeout``, so a dead member is blamed at once.
        """
        call = RingCall(**options)
        link = self._link(order, vector, call)
        acc = _accumulator(vector, in_place)
        n = len(order)
        if n == 1:
            if call.feed is not None:
                await call.feed.add_all(acc)
            return acc
        place = Place.of(order, self.endpoint.org_id, acc.shape[0])
        if acc.shape[0] < n * min_chunk:
            if call.feed is not None:
                await call.feed.add_all(acc)
            await self._run(
                order, link, steps.chain(link, acc, place, call.on_step, call.start_grace)
            )
        else:
            gather = self._scatter_gather(link, acc, place, call, n - 1, self._lost(link, place))
            await self._run(order, link, gather)
        return _reduced(link, acc)

    @staticmethod
    async def _scatter_gather(
        link: Link,
        acc: np.ndarray,
        place: Place,
        call: RingCall,
        gather_steps: int,
        on_lost: steps.LostHook | None = None,
    ) -> None:
        """The reduce-scatter, then the first ``gather_steps`` steps of the all-gather."""
        await steps.reduce_scatter(link, acc, place, call.on_step, call.start_grace, call.feed)
        await steps.all_gather(link, acc, place, call.on_step, range(gather_steps), on_lost=on_lost)

    def _lost(self, link: Link, place: Place) -> steps.LostHook:
        """What a member does when its all-gather send fails at step ``s >= 1`` (see
        :func:`~.steps.all_gather`): it tells the member after its successor that
        the successor is gone. The successor never got this member's chunk of step
        ``s``, so it sends nothing from step ``s + 1`` on: the member after it stops
        there at the latest, or earlier where a ping finds the successor gone (see
        :meth:`~.link.Link.receive`), instead of at the end of its wait, and aborts the
        members its own stop cuts off."""

        async def on_lost(step: int) -> None:
            n, succ = place.n, place.ends[0]
            after = place.order[(place.pos + 2) % n]
            await self._broadcast_abort(
                {after: step + 1},
                link.rid,
                succ,
                run=link.run,
                round=link.round,
                timeout=link.timeout,
            )

        return on_lost

    async def reduce_scatter(
        self,
        order: Sequence[str],
        vector: np.ndarray,
        *,
        in_place: bool = False,
        **options: Unpack[RingOptions],
    ) -> Scattered:
        """The first half of :meth:`allreduce`, and one step of the second.

        The ``n - 1`` reduce-scatter steps leave this member with the complete sum of
        one chunk; it then sends that chunk to its successor and receives its
        predecessor's (the all-gather's first step, ``on_step("gather", 0)``), so
        every complete chunk is held by two members. The round engine unmasks the
        chunks a member holds and sends the unmasked sum on with
        :meth:`all_gather_sum`: each member unmasks ``2 / n`` of the vector instead of
        all of it. Same options (``in_place`` included: ``acc`` is then ``vector``)
        and failures as :meth:`allreduce`; the vector is always cut in ``n`` chunks
        (no chain).
        """
        call = RingCall(**options)
        link = self._link(order, vector, call)
        n = len(order)
        if n < 2:
            raise ValueError("a reduce-scatter needs at least 2 members")
        acc = _accumulator(vector, in_place)
        place = Place.of(order, self.endpoint.org_id, acc.shape[0])
        await self._run(order, link, self._scatter_gather(link, acc, place, call, 1))
        _reduced(link, acc)
        own, pos = (place.pos + 1) % n, place.pos
        return Scattered(acc=acc, own=own, held=pos, bounds=place.bounds, filled={own, pos})

    async def all_gather_sum(
        self, order: Sequence[str], scattered: Scattered, **options: Unpack[GatherOptions]
    ) -> np.ndarray:
        """The rest of the all-gather after :meth:`reduce_scatter`, over the unmasked sum.

        ``scattered.acc`` must hold the unmasked sum in chunks ``own`` and ``held``
        (each member unmasked the two it holds); steps ``1 .. n - 2`` pass the chunks
        on (kind ``agg.sum``: what travels is the federation's sum, no one org's
        input) and fill ``scattered.acc`` in place, which is returned complete. A
        member that died since its chunk was copied stops only the members it cuts
        off, as in :meth:`allreduce`'s all-gather (:func:`~.steps.all_gather`): they
        raise :class:`RingBroken` after the abort, and the engine fetches the chunks
        they lack from members that hold them; the others complete.
        """
        call = RingCall(**options)
        acc = scattered.acc
        link = self._link(order, acc, call)
        place = Place(order, order.index(self.endpoint.org_id), scattered.bounds)
        gather = steps.all_gather(
            link,
            acc,
            place,
            call.on_step,
            range(1, place.n - 1),
            phase=PHASE_SUM,
            filled=scattered.filled,
            on_lost=self._lost(link, place),
        )
        await self._run(order, link, gather)
        return _reduced(link, acc)

    async def star_allreduce(
        self, order: Sequence[str], vector: np.ndarray, **options: Unpack[StarOptions]
    ) -> np.ndarray:
        """The same sum through one hub, ``order[0]``: the star baseline of the benchmarks.

        Every member sends its vector to the hub, the hub adds them and sends the
        total back to each: the hub sends
        ``n - 1`` vectors where a ring member sends ``2 (n - 1) / n``.
        """
        call = RingCall(**options)
        link = self._link(order, vector, call)
        acc = np.array(vector, copy=True)
        if call.feed is not None:
            await call.feed.add_all(acc)
        if len(order) == 1:
            return acc
        place = Place.of(order, self.endpoint.org_id, acc.shape[0])
        await self._run(order, link, steps.star(link, acc, place, call.start_grace))
        return _reduced(link, acc)

    async def _broken(self, order: Sequence[str], link: Link, exc: RingBroken) -> RingBroken:
        """Tell the members to abort (unless this node stopped on an abort: its sender
        told every member that had to stop); the error to raise, with every suspect
        known."""
        if not isinstance(exc, RingAborted):
            await self._broadcast_abort(
                _cut_off(order, link.endpoint.org_id, exc.cut_at),
                link.rid,
                exc.suspect,
                run=link.run,
                round=link.round,
                timeout=link.timeout,
            )
        known = frozenset(link.box.suspects.get(link.rid, set()) & set(order))
        return RingBroken(exc.reason, exc.suspect, known)

    async def _broadcast_abort(
        self,
        stops: Mapping[str, int | None],
        rid: bytes,
        suspect: str | None,
        *,
        run: str,
        round: int,
        timeout: float,
    ) -> None:
        """Tell other members to stop waiting on this ring, and whom it blames: each at
        once (``None``), or from the all-gather step given for it on."""
        me = self.endpoint.org_id
        blamed = (suspect or "").encode("utf-8")

        async def one(peer: str, step: int | None) -> None:
            payload = _ABORT_HEAD.pack(rid, _AT_ONCE if step is None else step) + blamed
            with contextlib.suppress(TransportError):
                await self.endpoint.send(
                    peer, KIND_ABORT, payload, run=run, round=round, stage="reduce", timeout=timeout
                )

        await asyncio.gather(*(one(p, s) for p, s in stops.items() if p not in (me, suspect)))


_ABORT_HEAD = struct.Struct(">16sH")  # the ring id, and the step the stop applies from
_AT_ONCE = 0xFFFF
"""The step of an abort that stops every wait of the ring at once."""


def _cut_off(order: Sequence[str], me: str, cut_at: int | None) -> dict[str, int | None]:
    """The members a break of ``me``'s ring must stop, and from which all-gather step:
    all at once, or when it stopped receiving at step ``cut_at`` (having sent what it
    held) the ``n - 2 - cut_at`` after it, which its missing chunks would have
    reached, the one ``e`` places on from step ``cut_at + e``."""
    if cut_at is None:
        return dict.fromkeys(order)
    n, pos = len(order), order.index(me)
    return {order[(pos + e) % n]: cut_at + e for e in range(1, n - 1 - cut_at)}


def _reduced(link: Link, acc: np.ndarray) -> np.ndarray:
    """``acc`` modulo a narrow ring's ``2^bits``, in place: the chunks a member added
    itself held bits above the ring's, those it received did not; every member now
    holds the same elements."""
    if link.packed:
        np.bitwise_and(acc, np.uint16((1 << link.bits) - 1), out=acc)
    return acc


def _accumulator(vector: np.ndarray, in_place: bool) -> np.ndarray:
    """The array a ring sums into: ``vector`` itself (``in_place``), or a copy."""
    if not in_place:
        return np.array(vector, copy=True)
    if not vector.flags.c_contiguous or not vector.flags.writeable:
        raise ValueError("a ring summed in place needs a C-contiguous, writeable vector")
    return vector
