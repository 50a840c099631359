"""Chunked ring all-reduce (reduce-scatter, then all-gather) over an :class:`Endpoint`.

The classic bandwidth-optimal ring all-reduce (Patarasuk & Yuan, "Bandwidth optimal
all-reduce algorithms for clusters of workstations", JPDC 2009; the algorithm of
Horovod and NCCL rings): the vector is cut into ``n`` chunks; in ``n - 1``
reduce-scatter steps each node passes one chunk to its successor, which adds it to its
own, until node ``p`` holds the complete sum of chunk ``(p + 1) mod n``; in ``n - 1``
all-gather steps the finished chunks travel once more around the ring. Each node sends
``2 (n - 1) / n`` times the vector's bytes, whatever ``n`` is, instead of the ``n - 1``
times of an all-to-all exchange or the star's ``n - 1`` times at its centre.

Arithmetic is modulo ``2^b`` on ``np.uint32`` / ``np.uint64`` arrays (the ring of
:mod:`secure_agg.ring`), so partial sums of masked vectors wrap exactly like the
secure-aggregation masks expect. A missing, late or malformed chunk, an unreachable
successor or an abort from any ring member ends the call with :class:`RingBroken`,
naming the suspect when one is known; the node then sends every member an abort that
names whom it blames, so all stop at once and learn the suspects. The caller (the
round engine) decides who dropped and runs the ring again over the survivors.

Two variants share the message format (``agg.chunk``: a header with the phase, step,
chunk, frame, element count and a 16-byte ring id binding the ordered members and the
attempt, then the little-endian elements): a **chain** for vectors too short to be
worth ``n`` chunks (reduce along the ring order, then pass the total on: ``2 (n - 1)``
messages in all; a long wait pings the sender to tell a dead one from a slow one), and
the **star** through one hub, the baseline of ``bench/overlay.py``. A chunk larger than
:data:`MAX_FRAME_BYTES` travels in several frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from coordinator_free.errors import PeerUnreachable, RefusalReason, Refused, TransportError
from coordinator_free.wire import Envelope

__all__ = [
    "KIND_ABORT",
    "KIND_CHUNK",
    "KIND_PING",
    "KIND_SUM",
    "LIVENESS_POLL_S",
    "MAX_FRAME_BYTES",
    "RingBroken",
    "RingEndpoint",
    "RingReducer",
    "RingStats",
    "Scattered",
    "chunk_bounds",
    "ring_id",
    "ring_order",
]

KIND_CHUNK = "agg.chunk"
KIND_SUM = "agg.sum"
KIND_ABORT = "agg.abort"
KIND_PING = "agg.ping"

_PHASE_SCATTER = 1
_PHASE_GATHER = 2
_PHASE_CHAIN_REDUCE = 3
_PHASE_CHAIN_BROADCAST = 4
_PHASE_STAR_UP = 5
_PHASE_STAR_DOWN = 6
_PHASE_SUM = 7  # the all-gather of the unmasked sum (kind agg.sum, see all_gather_sum)
_PHASES = (
    _PHASE_SCATTER,
    _PHASE_GATHER,
    _PHASE_CHAIN_REDUCE,
    _PHASE_CHAIN_BROADCAST,
    _PHASE_STAR_UP,
    _PHASE_STAR_DOWN,
    _PHASE_SUM,
)
# version, phase, bits, step, chunk index, frame, element count, ring id (16 bytes)
_HEADER = struct.Struct(">BBBIIII16s")
_VERSION = 1
MAX_FRAME_BYTES = 16 << 20
"""A chunk larger than this travels as several messages (well under the 64 MiB limit)."""
LIVENESS_POLL_S = 0.25
"""How often a wait for a chunk asks the ``alive`` callable about the sender (no message)."""
_ACK = b"ok"

Handler = Callable[[Envelope], Awaitable[bytes | None]]


class RingEndpoint(Protocol):
    """What the ring needs of :class:`coordinator_free.endpoint.Endpoint`."""

    @property
    def org_id(self) -> str: ...

    def on(self, kind: str, handler: Handler) -> None: ...

    async def send(
        self,
        peer: str,
        kind: str,
        payload: bytes,
        *,
        run: str = "",
        round: int = 0,
        stage: str = "",
        timeout: float = 5.0,
    ) -> bytes: ...


class RingBroken(Exception):
    """The ring could not finish.

    ``suspect`` is the member this node blames, when it blames one (an unreachable
    successor, a silent or malformed predecessor); ``suspects`` adds the members
    blamed by the aborts of other members received so far.
    """

    def __init__(
        self, reason: str, suspect: str | None = None, suspects: frozenset[str] = frozenset()
    ) -> None:
        super().__init__(reason if suspect is None else f"{reason} (suspect: {suspect})")
        self.reason = reason
        self.suspect = suspect
        self.suspects = suspects | ({suspect} if suspect is not None else set())


def ring_order(members: Sequence[str] | set[str] | frozenset[str], round: int) -> list[str]:
    """Members sorted by ``SHA-256(round || org_id)``: the ring of one round.

    Deterministic from the member set and the round number alone, so every node that
    agrees on the set builds the same ring; a fresh order each round spreads the
    positions (and who holds which partial sum) over the members.
    """
    prefix = struct.pack(">Q", round)

    def key(org: str) -> bytes:
        return hashlib.sha256(prefix + org.encode("utf-8")).digest()

    return sorted(set(members), key=lambda o: (key(o), o))


def ring_id(order: Sequence[str], attempt: int) -> bytes:
    """16 bytes naming one ring (its ordered members and the attempt number).

    Carried by every chunk, so chunks of a different attempt or of a ring built from a
    different view never mix with this one's.
    """
    h = hashlib.sha256(b"fedweave/ring\x00" + struct.pack(">I", attempt))
    for org in order:
        h.update(struct.pack(">I", len(org)) + org.encode("utf-8"))
    return h.digest()[:16]


def chunk_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous ``[start, stop)`` slices covering ``length`` elements, sizes within 1."""
    if n < 1:
        raise ValueError(f"chunk_bounds needs n >= 1, got {n}")
    cuts = [i * length // n for i in range(n + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(n)]


@dataclass
class RingStats:
    """What one all-reduce sent: payload bytes and messages, per phase."""

    bytes_sent: int = 0
    messages_sent: int = 0
    scatter_bytes: int = 0
    gather_bytes: int = 0


@dataclass(frozen=True)
class Scattered:
    """What :meth:`RingReducer.reduce_scatter` leaves a member.

    acc: a vector of the input's length in which chunk ``own`` holds the complete sum
    that this member reduced and chunk ``held`` the complete sum its predecessor
    reduced (a copy, so a chunk outlives one of its holders); the other chunks hold
    partial sums, meaningless. bounds: the chunks' ``[lo, hi)``, from
    :func:`chunk_bounds`. filled: the chunks complete so far (``own`` and ``held``,
    then each one :meth:`RingReducer.all_gather_sum` receives).
    """

    acc: np.ndarray
    own: int
    held: int
    bounds: list[tuple[int, int]]
    filled: set[int] = field(default_factory=set)


# run, round, ring id, phase, step, frame, sender
_Key = tuple[str, int, bytes, int, int, int, str]


@dataclass
class _RoundBox:
    chunks: dict[_Key, asyncio.Future[bytes]] = field(default_factory=dict)
    aborts: dict[bytes, asyncio.Event] = field(default_factory=dict)
    suspects: dict[bytes, set[str]] = field(default_factory=dict)
    buffered: int = 0


@dataclass
class _Link:
    """One node's sends and receives for one ring (or star) run."""

    endpoint: RingEndpoint
    run: str
    round: int
    stage: str
    rid: bytes
    box: _RoundBox
    abort: asyncio.Event
    timeout: float
    stats: RingStats
    dtype: np.dtype[Any]
    alive: Callable[[str], bool] | None = None

    @property
    def wire_dtype(self) -> np.dtype[Any]:
        return self.dtype.newbyteorder("<")

    def frames(self, count: int) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` frames a chunk of ``count`` elements travels in."""
        per = max(1, MAX_FRAME_BYTES // self.dtype.itemsize)
        return chunk_bounds(count, max(1, -(-count // per)))

    async def send(self, dest: str, phase: int, step: int, index: int, data: np.ndarray) -> None:
        for frame, (lo, hi) in enumerate(self.frames(data.shape[0])):
            await self._send_frame(dest, phase, step, index, frame, data[lo:hi])

    async def _send_frame(
        self, dest: str, phase: int, step: int, index: int, frame: int, data: np.ndarray
    ) -> None:
        bits = self.dtype.itemsize * 8
        header = _HEADER.pack(_VERSION, phase, bits, step, index, frame, data.shape[0], self.rid)
        payload = header + data.astype(self.wire_dtype, copy=False).tobytes()
        try:
            reply = await self.endpoint.send(
                dest,
                KIND_SUM if phase == _PHASE_SUM else KIND_CHUNK,
                payload,
                run=self.run,
                round=self.round,
                stage=self.stage,
                timeout=self.timeout,
            )
        except TransportError as exc:
            raise RingBroken(f"sending to {dest} failed: {exc}", dest) from exc
        self.stats.bytes_sent += len(payload)
        self.stats.messages_sent += 1
        if phase in (_PHASE_SCATTER, _PHASE_CHAIN_REDUCE, _PHASE_STAR_UP):
            self.stats.scatter_bytes += len(payload)
        else:
            self.stats.gather_bytes += len(payload)
        if reply != _ACK:
            raise RingBroken(f"{dest} refused a chunk", dest)

    async def receive(
        self, src: str, phase: int, step: int, index: int, count: int, wait: float
    ) -> np.ndarray:
        """The chunk ``src`` sends for (phase, step), all its frames; waits up to ``wait`` s.

        While waiting longer than one ``timeout``, pings ``src`` each ``timeout``: a
        sender that is gone is blamed at once rather than at the end of the wait. With
        ``alive`` (the membership layer's opinion), the wait also looks every
        :data:`LIVENESS_POLL_S` whether ``src`` is still believed alive and pings it as
        soon as it is not, so a sender that died silently (having sent everything its
        own predecessor waited for, so no send failed and nobody aborted) is blamed
        after the failure detector's delay rather than a whole ``timeout``.
        """
        frames = self.frames(count)
        if len(frames) == 1:
            return await self._receive_frame(src, phase, step, index, 0, count, wait)
        out = np.empty(count, dtype=self.dtype)
        for frame, (lo, hi) in enumerate(frames):
            out[lo:hi] = await self._receive_frame(src, phase, step, index, frame, hi - lo, wait)
        return out

    async def _receive_frame(
        self, src: str, phase: int, step: int, index: int, frame: int, count: int, wait: float
    ) -> np.ndarray:
        key: _Key = (self.run, self.round, self.rid, phase, step, frame, src)
        box = self.box
        fut = box.chunks.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            box.chunks[key] = fut
        loop = asyncio.get_running_loop()
        end = loop.time() + wait
        next_ping = loop.time() + self.timeout
        # membership says src is gone: ping it once at once (not on every poll)
        doubted = False
        poll = self.timeout if self.alive is None else min(self.timeout, LIVENESS_POLL_S)
        while True:
            waiter: asyncio.Future[Any] = asyncio.ensure_future(self.abort.wait())
            waited: set[asyncio.Future[Any]] = {fut, waiter}
            now = loop.time()
            try:
                done, _ = await asyncio.wait(
                    waited,
                    timeout=max(0.0, min(poll, next_ping - now, end - now)),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                waiter.cancel()
            if fut in done:
                break
            if self.abort.is_set():
                raise RingBroken("a ring member aborted")
            now = loop.time()
            if now >= end:
                raise RingBroken(f"no chunk from {src} within {wait:g}s", src)
            if now >= next_ping:
                next_ping = now + self.timeout
            elif self.alive is not None and not doubted and not self.alive(src):
                doubted = True
            else:
                continue
            try:
                await self.endpoint.send(
                    src,
                    KIND_PING,
                    self.rid,
                    run=self.run,
                    round=self.round,
                    stage=self.stage,
                    timeout=self.timeout,
                )
            except PeerUnreachable as exc:
                raise RingBroken(f"{src} is gone: {exc}", src) from exc
            except TransportError:
                pass  # it answered (alive, perhaps done with this round) or is just slow
        payload = fut.result()
        box.chunks.pop(key, None)
        box.buffered -= len(payload)
        _version, _phase, got_bits, _step, got_index, got_frame, got_count, _rid = (
            _HEADER.unpack_from(payload)
        )
        body = payload[_HEADER.size :]
        if (
            got_bits != self.dtype.itemsize * 8
            or got_index != index
            or got_frame != frame
            or got_count != count
            or len(body) != count * self.dtype.itemsize
        ):
            raise RingBroken(f"malformed chunk {index} from {src}", src)
        return np.frombuffer(body, dtype=self.wire_dtype).astype(self.dtype, copy=False)

    async def exchange(
        self, sending: Awaitable[None], receiving: Awaitable[np.ndarray]
    ) -> np.ndarray:
        """Send and receive at once; the first failure of either ends both."""
        sender = asyncio.ensure_future(sending)
        receiver = asyncio.ensure_future(receiving)
        try:
            done, _ = await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_EXCEPTION)
            for task in (sender, receiver):
                if task in done and task.exception() is not None:
                    await task  # re-raises
            await sender
            return await receiver
        finally:
            sender.cancel()
            receiver.cancel()


class RingReducer:
    """Ring all-reduce for one node: registers ``agg.chunk`` / ``agg.abort`` on its endpoint.

    A round is opened with :meth:`open` before any member can send its chunks (the
    round engine does it before its ``ready``), so early chunks are buffered, up to
    ``max_buffered_bytes`` per round; chunks of rounds not open are refused.
    """

    def __init__(self, endpoint: RingEndpoint, *, max_buffered_bytes: int = 1 << 30) -> None:
        self.endpoint = endpoint
        self.max_buffered_bytes = max_buffered_bytes
        self._boxes: dict[tuple[str, int], _RoundBox] = {}
        endpoint.on(KIND_CHUNK, self._on_chunk)
        endpoint.on(KIND_SUM, self._on_chunk)
        endpoint.on(KIND_ABORT, self._on_abort)
        endpoint.on(KIND_PING, self._on_ping)

    # -- round bookkeeping -------------------------------------------------------

    def open(self, run: str, round: int) -> None:
        """Accept chunks for ``(run, round)`` from now on."""
        self._boxes.setdefault((run, round), _RoundBox())

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

    async def _on_chunk(self, env: Envelope) -> bytes:
        box = self._boxes.get((env.run, env.round))
        if box is None:
            raise Refused(RefusalReason.STALE, f"no open round {env.run!r}/{env.round}")
        if len(env.payload) < _HEADER.size:
            raise Refused(RefusalReason.MALFORMED, "chunk shorter than its header")
        version, phase, _bits, step, _index, frame, _count, rid = _HEADER.unpack_from(env.payload)
        if version != _VERSION or phase not in _PHASES:
            raise Refused(RefusalReason.MALFORMED, "unknown chunk version or phase")
        if (phase == _PHASE_SUM) != (env.kind == KIND_SUM):
            # the kind names what the bytes are (masked or summed) for the audit log
            raise Refused(RefusalReason.MALFORMED, f"a {env.kind} message of phase {phase}")
        key: _Key = (env.run, env.round, rid, phase, step, frame, env.sender)
        fut = box.chunks.get(key)
        if fut is not None and fut.done():
            # a second chunk for the same slot never overwrites the first
            raise Refused(RefusalReason.REPLAY, "duplicate chunk")
        if fut is None:
            if box.buffered + len(env.payload) > self.max_buffered_bytes:
                raise Refused(RefusalReason.OVERSIZED, "too many chunks buffered")
            fut = asyncio.get_running_loop().create_future()
            box.chunks[key] = fut
        box.buffered += len(env.payload)
        fut.set_result(env.payload)
        return _ACK

    async def _on_ping(self, env: Envelope) -> bytes:
        if (env.run, env.round) not in self._boxes:
            raise Refused(RefusalReason.STALE, f"no open round {env.run!r}/{env.round}")
        return _ACK

    async def _on_abort(self, env: Envelope) -> bytes:
        box = self._boxes.get((env.run, env.round))
        if box is None:
            raise Refused(RefusalReason.STALE, f"no open round {env.run!r}/{env.round}")
        rid, blamed = env.payload[:16], env.payload[16:]
        if len(rid) != 16 or len(blamed) > 1024:
            raise Refused(RefusalReason.MALFORMED, "abort is a 16-byte ring id and a suspect")
        try:
            suspect = blamed.decode("utf-8")
        except UnicodeDecodeError:
            raise Refused(RefusalReason.MALFORMED, "abort suspect is not UTF-8") from None
        if suspect:
            box.suspects.setdefault(rid, set()).add(suspect)
        box.aborts.setdefault(rid, asyncio.Event()).set()
        return _ACK

    # -- the algorithms ----------------------------------------------------------------

    def _link(
        self,
        order: Sequence[str],
        vector: np.ndarray,
        *,
        run: str,
        round: int,
        attempt: int,
        stage: str,
        timeout: float,
        stats: RingStats | None,
        alive: Callable[[str], bool] | None = None,
    ) -> _Link:
        me = self.endpoint.org_id
        if me not in order:
            raise ValueError(f"{me} is not in the ring {list(order)}")
        if len(set(order)) != len(order):
            raise ValueError("ring members must be distinct")
        if vector.ndim != 1 or vector.dtype not in (np.dtype(np.uint32), np.dtype(np.uint64)):
            raise ValueError("the ring reduces 1-D uint32 or uint64 arrays")
        self.open(run, round)
        box = self._boxes[(run, round)]
        rid = ring_id(order, attempt)
        return _Link(
            endpoint=self.endpoint,
            run=run,
            round=round,
            stage=stage,
            rid=rid,
            box=box,
            abort=box.aborts.setdefault(rid, asyncio.Event()),
            timeout=timeout,
            stats=stats if stats is not None else RingStats(),
            dtype=vector.dtype,
            alive=alive,
        )

    async def allreduce(
        self,
        order: Sequence[str],
        vector: np.ndarray,
        *,
        run: str,
        round: int,
        attempt: int = 0,
        stage: str = "reduce",
        timeout: float = 10.0,
        stats: RingStats | None = None,
        on_step: Callable[[str, int], Awaitable[None]] | None = None,
        min_chunk: int = 1024,
        start_grace: float = 0.0,
        alive: Callable[[str], bool] | None = None,
    ) -> np.ndarray:
        """The ring sum of every member's ``vector``, mod ``2^b``; a fresh array.

        ``order`` is the ring (every member passes the same list, e.g. from
        :func:`ring_order`); ``timeout`` bounds each step's wait for the predecessor's
        chunk and each send. ``on_step(phase, step)`` is awaited before each step
        (``phase`` is ``"scatter"`` or ``"gather"``): the simulator's fault-injection
        seam. Raises :class:`RingBroken` on a failure of this node's neighbours or an
        abort from any member, after telling every member to abort.

        A vector shorter than ``n * min_chunk`` elements is latency-bound, not
        bandwidth-bound: it is summed along the ring as a chain instead (reduce from
        the first member to the last, then pass the total on), ``2 (n - 1)`` messages
        in all rather than ``2 n (n - 1)``, and still at most two vectors sent per node.

        ``start_grace`` is added to the first wait: the members do not all start at the
        same moment (each leaves the previous stage when it has heard enough). A long
        wait pings the sender each ``timeout``, so a dead member is blamed at once;
        ``alive(org)``, the membership layer's view, makes it ping as soon as the
        sender is no longer believed alive (see ``_Link.receive``).
        """
        link = self._link(
            order,
            vector,
            run=run,
            round=round,
            attempt=attempt,
            stage=stage,
            timeout=timeout,
            stats=stats,
            alive=alive,
        )
        acc = np.array(vector, copy=True)
        n = len(order)
        if n == 1:
            return acc
        pos = order.index(self.endpoint.org_id)
        succ, pred = order[(pos + 1) % n], order[(pos - 1) % n]
        bounds = chunk_bounds(acc.shape[0], n)

        async def step_once(phase: int, step: int, send_index: int, recv_index: int) -> None:
            grace = start_grace if (phase, step) == (_PHASE_SCATTER, 0) else 0.0
            await _step(
                link,
                acc,
                bounds,
                (succ, pred),
                phase,
                step,
                (send_index, recv_index),
                on_step,
                timeout + grace,
            )

        async def chain() -> None:
            # reduce along the chain order[0] -> ... -> order[n-1], then the total goes
            # order[n-1] -> order[0] -> ... -> order[n-2]; a wait is bounded by one
            # timeout per hop that must happen before it (the sender is pinged meanwhile)
            length = acc.shape[0]
            if on_step is not None:
                await on_step("scatter", 0)
            if pos > 0:
                part = await link.receive(
                    pred, _PHASE_CHAIN_REDUCE, 0, 0, length, timeout * pos + start_grace
                )
                np.add(acc, part, out=acc)
            if pos < n - 1:
                await link.send(succ, _PHASE_CHAIN_REDUCE, 0, 0, acc)
            if on_step is not None:
                await on_step("gather", 0)
            if pos < n - 1:
                acc[:] = await link.receive(
                    pred, _PHASE_CHAIN_BROADCAST, 0, 0, length, timeout * (n + pos) + start_grace
                )
            if pos < n - 2 or pos == n - 1:
                await link.send(succ, _PHASE_CHAIN_BROADCAST, 0, 0, acc)

        try:
            if acc.shape[0] < n * min_chunk:
                await chain()
            else:
                for s in range(n - 1):
                    await step_once(_PHASE_SCATTER, s, (pos - s) % n, (pos - s - 1) % n)
                for s in range(n - 1):
                    await step_once(_PHASE_GATHER, s, (pos + 1 - s) % n, (pos - s) % n)
        except RingBroken as exc:
            raise await self._broken(order, link, exc) from exc
        return acc

    async def reduce_scatter(
        self,
        order: Sequence[str],
        vector: np.ndarray,
        *,
        run: str,
        round: int,
        attempt: int = 0,
        stage: str = "reduce",
        timeout: float = 10.0,
        stats: RingStats | None = None,
        on_step: Callable[[str, int], Awaitable[None]] | None = None,
        start_grace: float = 0.0,
        alive: Callable[[str], bool] | None = None,
    ) -> Scattered:
        """The first half of :meth:`allreduce`, and one step of the second.

        The ``n - 1`` reduce-scatter steps leave this member with the complete sum of
        one chunk; it then sends that chunk to its successor and receives its
        predecessor's (the all-gather's first step, ``on_step("gather", 0)``), so
        every complete chunk is held by two members. The round engine unmasks the
        chunks a member holds and sends the unmasked sum on with
        :meth:`all_gather_sum`: each member unmasks ``2 / n`` of the vector instead of
        all of it. Same arguments and failures as :meth:`allreduce`; the vector is
        always cut in ``n`` chunks (no chain).
        """
        link = self._link(
            order,
            vector,
            run=run,
            round=round,
            attempt=attempt,
            stage=stage,
            timeout=timeout,
            stats=stats,
            alive=alive,
        )
        n = len(order)
        if n < 2:
            raise ValueError("a reduce-scatter needs at least 2 members")
        acc = np.array(vector, copy=True)
        pos = order.index(self.endpoint.org_id)
        ends = (order[(pos + 1) % n], order[(pos - 1) % n])
        bounds = chunk_bounds(acc.shape[0], n)
        try:
            for s in range(n - 1):
                wait = timeout + (start_grace if s == 0 else 0.0)
                await _step(
                    link,
                    acc,
                    bounds,
                    ends,
                    _PHASE_SCATTER,
                    s,
                    ((pos - s) % n, (pos - s - 1) % n),
                    on_step,
                    wait,
                )
            await _step(
                link, acc, bounds, ends, _PHASE_GATHER, 0, ((pos + 1) % n, pos), on_step, timeout
            )
        except RingBroken as exc:
            raise await self._broken(order, link, exc) from exc
        own = (pos + 1) % n
        return Scattered(acc=acc, own=own, held=pos, bounds=bounds, filled={own, pos})

    async def all_gather_sum(
        self,
        order: Sequence[str],
        scattered: Scattered,
        *,
        run: str,
        round: int,
        attempt: int = 0,
        stage: str = "reduce",
        timeout: float = 10.0,
        stats: RingStats | None = None,
        on_step: Callable[[str, int], Awaitable[None]] | None = None,
        alive: Callable[[str], bool] | None = None,
    ) -> np.ndarray:
        """The rest of the all-gather after :meth:`reduce_scatter`, over the unmasked sum.

        ``scattered.acc`` must hold the unmasked sum in chunks ``own`` and ``held``
        (each member unmasked the two it holds); steps ``1 .. n - 2`` pass the chunks
        on (kind ``agg.sum``: what travels is the federation's sum, no one org's
        input) and fill ``scattered.acc`` in place, which is returned complete. A
        member that died since its chunk was copied breaks it: :class:`RingBroken`
        after the abort, as in :meth:`allreduce`; the engine then fetches the
        chunks it lacks from members that hold them.
        """
        acc = scattered.acc
        link = self._link(
            order,
            acc,
            run=run,
            round=round,
            attempt=attempt,
            stage=stage,
            timeout=timeout,
            stats=stats,
            alive=alive,
        )
        n = len(order)
        pos = order.index(self.endpoint.org_id)
        ends = (order[(pos + 1) % n], order[(pos - 1) % n])
        try:
            for s in range(1, n - 1):
                await _step(
                    link,
                    acc,
                    scattered.bounds,
                    ends,
                    _PHASE_SUM,
                    s,
                    ((pos + 1 - s) % n, (pos - s) % n),
                    on_step,
                    timeout,
                )
                scattered.filled.add((pos - s) % n)
        except RingBroken as exc:
            raise await self._broken(order, link, exc) from exc
        return acc

    async def star_allreduce(
        self,
        order: Sequence[str],
        vector: np.ndarray,
        *,
        run: str,
        round: int,
        attempt: int = 0,
        stage: str = "reduce",
        timeout: float = 10.0,
        stats: RingStats | None = None,
        start_grace: float = 0.0,
    ) -> np.ndarray:
        """The same sum through one hub, ``order[0]``: the star baseline of the benchmarks.

        Every member sends its vector to the hub, the hub adds them and sends the
        total back to each: the hub sends
        ``n - 1`` vectors where a ring member sends ``2 (n - 1) / n``.
        """
        link = self._link(
            order,
            vector,
            run=run,
            round=round,
            attempt=attempt,
            stage=stage,
            timeout=timeout,
            stats=stats,
        )
        acc = np.array(vector, copy=True)
        n = len(order)
        if n == 1:
            return acc
        hub, me = order[0], self.endpoint.org_id
        length = acc.shape[0]
        wait = timeout * n + start_grace
        try:
            if me == hub:

                async def collect(member: str) -> None:
                    part = await link.receive(member, _PHASE_STAR_UP, 0, 0, length, wait)
                    np.add(acc, part, out=acc)

                await asyncio.gather(*(collect(m) for m in order[1:]))
                await asyncio.gather(
                    *(link.send(m, _PHASE_STAR_DOWN, 0, 0, acc) for m in order[1:])
                )
            else:
                await link.send(hub, _PHASE_STAR_UP, 0, 0, acc)
                acc[:] = await link.receive(hub, _PHASE_STAR_DOWN, 0, 0, length, wait)
        except RingBroken as exc:
            raise await self._broken(order, link, exc) from exc
        return acc

    async def _broken(self, order: Sequence[str], link: _Link, exc: RingBroken) -> RingBroken:
        """Tell the members to abort; the error to raise, with every suspect known."""
        await self._broadcast_abort(
            order, link.rid, exc.suspect, run=link.run, round=link.round, timeout=link.timeout
        )
        known = frozenset(link.box.suspects.get(link.rid, set()) & set(order))
        return RingBroken(exc.reason, exc.suspect, known)

    async def _broadcast_abort(
        self,
        order: Sequence[str],
        rid: bytes,
        suspect: str | None,
        *,
        run: str,
        round: int,
        timeout: float,
    ) -> None:
        """Tell every other member to stop waiting on this ring, and whom it blames."""
        me = self.endpoint.org_id
        payload = rid + (suspect or "").encode("utf-8")

        async def one(peer: str) -> None:
            with contextlib.suppress(TransportError):
                await self.endpoint.send(
                    peer, KIND_ABORT, payload, run=run, round=round, stage="reduce", timeout=timeout
                )

        await asyncio.gather(*(one(p) for p in order if p not in (me, suspect)))


_STEP_NAMES = {_PHASE_SCATTER: "scatter", _PHASE_GATHER: "gather", _PHASE_SUM: "gather"}


async def _step(
    link: _Link,
    acc: np.ndarray,
    bounds: list[tuple[int, int]],
    ends: tuple[str, str],
    phase: int,
    step: int,
    indices: tuple[int, int],
    on_step: Callable[[str, int], Awaitable[None]] | None,
    wait: float,
) -> None:
    """One ring step: send chunk ``indices[0]`` of ``acc`` to the successor while
    receiving chunk ``indices[1]`` from the predecessor (``ends``), which is added in
    the reduce-scatter and copied in the all-gathers."""
    if on_step is not None:
        await on_step(_STEP_NAMES[phase], step)
    succ, pred = ends
    send_index, recv_index = indices
    slo, shi = bounds[send_index]
    rlo, rhi = bounds[recv_index]
    chunk = await link.exchange(
        link.send(succ, phase, step, send_index, acc[slo:shi]),
        link.receive(pred, phase, step, recv_index, rhi - rlo, wait),
    )
    if phase == _PHASE_SCATTER:
        np.add(acc[rlo:rhi], chunk, out=acc[rlo:rhi])
    else:
        acc[rlo:rhi] = chunk
