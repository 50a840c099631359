"""One member's sends and receives for one ring run: :class:`Link`.

A chunk goes out in frames of at most :data:`~coordinator_free.ring.wire.MAX_FRAME_BYTES`
and is counted in :class:`RingStats`; a chunk comes in through the :class:`RoundBox` of
its round, where the handler of ``agg.chunk`` left it (early chunks wait there). A
wait for a chunk pings a silent sender, so a dead one is blamed as :class:`RingBroken`
at once rather than at the end of the wait, and ends when a member aborts the ring
(an abort that cuts the all-gather from a step on ends only the waits from that step).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import PeerUnreachable, TransportError
from coordinator_free.ring import wire
from coordinator_free.ring.wire import (
    ACK,
    HEADER,
    KIND_CHUNK,
    KIND_PING,
    KIND_SUM,
    PHASE_CHAIN_REDUCE,
    PHASE_GATHER,
    PHASE_SCATTER,
    PHASE_STAR_UP,
    PHASE_SUM,
    VERSION,
    chunk_bounds,
    pack_narrow,
    packed_bytes,
    unpack_narrow,
)

__all__ = [
    "LIVENESS_POLL_S",
    "ChunkKey",
    "Link",
    "RingAborted",
    "RingBroken",
    "RingStats",
    "RoundBox",
]

LIVENESS_POLL_S = 0.25
"""How often a wait for a chunk asks the ``alive`` callable about the sender (no message)."""


class RingBroken(Exception):
    """The ring could not finish.

    ``suspect`` is the member this node blames, when it blames one (an unreachable
    successor, a silent or malformed predecessor); ``suspects`` adds the members
    blamed by the aborts of other members received so far. ``cut_at`` is the
    all-gather step at which this member stopped receiving, when it stopped there: it
    passed on every chunk it held, so only the members its missing chunks would have
    reached must stop (see :func:`~.steps.all_gather`).
    """

    def __init__(
        self, reason: str, suspect: str | None = None, suspects: frozenset[str] = frozenset()
    ) -> None:
        super().__init__(reason if suspect is None else f"{reason} (suspect: {suspect})")
        self.reason = reason
        self.suspect = suspect
        self.suspects = suspects | ({suspect} if suspect is not None else set())
        self.cut_at: int | None = None


class RingAborted(RingBroken):
    """The ring broke here because another member aborted it, blaming someone other
    than this member's predecessor: that member told every member that had to stop,
    so this one tells no one."""


@dataclass
class RingStats:
    """What one all-reduce sent: payload bytes and messages, per phase."""

    bytes_sent: int = 0
    messages_sent: int = 0
    scatter_bytes: int = 0
    gather_bytes: int = 0


GATHER_PHASES = (PHASE_GATHER, PHASE_SUM)
"""The all-gathers, whose receives an abort may cut from a step on (:meth:`RoundBox.cut`)."""

ChunkKey = tuple[str, int, bytes, int, int, int, str]
"""run, round, ring id, phase, step, frame, sender"""


@dataclass
class RoundBox:
    """What one open round holds: chunks by key (received, or awaited), the abort
    event and the suspects of each ring id, the all-gather step from which each ring
    id's chunks stop coming (``cuts``, with its event), and the bytes buffered."""

    chunks: dict[ChunkKey, asyncio.Future[bytes]] = field(default_factory=dict)
    aborts: dict[bytes, asyncio.Event] = field(default_factory=dict)
    suspects: dict[bytes, set[str]] = field(default_factory=dict)
    cuts: dict[bytes, int] = field(default_factory=dict)
    cut_events: dict[bytes, asyncio.Event] = field(default_factory=dict)
    buffered: int = 0
    # bytes buffered per sender, and the most one sender may have buffered here
    held: dict[str, int] = field(default_factory=dict)
    member_cap: int = 64 << 20

    def cut(self, rid: bytes, step: int) -> None:
        """A member's abort says this node's all-gather receives no chunk from ``step``
        on: the receives before it go on (their chunks never passed the dead member)."""
        self.cuts[rid] = min(step, self.cuts.get(rid, step))
        self.cut_events.setdefault(rid, asyncio.Event()).set()

    def slot(self, key: ChunkKey) -> asyncio.Future[bytes]:
        """The future of the chunk ``key``, made on first use by either side."""
        fut = self.chunks.get(key)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self.chunks[key] = fut
        return fut


@dataclass
class Link:
    """One node's sends and receives for one ring (or star) run."""

    endpoint: Endpoint
    run: str
    round: int
    stage: str
    rid: bytes
    box: RoundBox
    abort: asyncio.Event
    timeout: float
    stats: RingStats
    dtype: np.dtype[Any]
    alive: Callable[[str], bool] | None = None
    bits: int = 0
    """The ring's width: the storage dtype's (0 reads as that), or one of
    :data:`~.wire.NARROW_BITS` of a ``uint16`` vector, whose elements then travel
    packed (:func:`~.wire.pack_narrow`)."""

    def __post_init__(self) -> None:
        full = self.dtype.itemsize * 8
        if self.bits == 0:
            self.bits = full
        elif self.bits != full and (full != 16 or self.bits not in wire.NARROW_BITS):
            raise ValueError(f"a ring of {self.dtype} elements cannot be {self.bits} bits wide")

    @property
    def packed(self) -> bool:
        return self.bits != self.dtype.itemsize * 8

    @property
    def wire_dtype(self) -> np.dtype[Any]:
        return self.dtype.newbyteorder("<")

    def _body(self, data: np.ndarray) -> memoryview:
        """A frame's elements as they travel: little-endian, or packed."""
        if self.packed:
            return pack_narrow(data, self.bits).data
        return np.ascontiguousarray(data.astype(self.wire_dtype, copy=False)).data

    def _elements(self, body: memoryview, count: int) -> np.ndarray | None:
        """A frame's ``count`` elements (None: the body is not their size)."""
        if self.packed:
            if len(body) != packed_bytes(count, self.bits):
                return None
            return unpack_narrow(body, count, self.bits)
        if len(body) != count * self.dtype.itemsize:
            return None
        # a read-only view of the message (little-endian hosts) that steps add or copy
        return np.frombuffer(body, dtype=self.wire_dtype).astype(self.dtype, copy=False)

    def frames(self, count: int) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` frames a chunk of ``count`` elements travels in."""
        per = max(1, wire.MAX_FRAME_BYTES // self.dtype.itemsize)
        return chunk_bounds(count, max(1, -(-count // per)))

    async def send(self, dest: str, phase: int, step: int, index: int, data: np.ndarray) -> None:
        for frame, (lo, hi) in enumerate(self.frames(data.shape[0])):
            await self._send_frame(dest, phase, step, index, frame, data[lo:hi])

    async def _send_frame(
        self, dest: str, phase: int, step: int, index: int, frame: int, data: np.ndarray
    ) -> None:
        header = HEADER.pack(VERSION, phase, self.bits, step, index, frame, data.shape[0], self.rid)
        # one copy of the frame into the message (no tobytes() first)
        payload = b"".join((header, self._body(data)))
        kind = KIND_SUM if phase == PHASE_SUM else KIND_CHUNK
        try:
            reply = await self._send(dest, kind, payload)
        except TransportError as exc:
            raise RingBroken(f"sending to {dest} failed: {exc}", dest) from exc
        self.stats.bytes_sent += len(payload)
        self.stats.messages_sent += 1
        if phase in (PHASE_SCATTER, PHASE_CHAIN_REDUCE, PHASE_STAR_UP):
            self.stats.scatter_bytes += len(payload)
        else:
            self.stats.gather_bytes += len(payload)
        if reply != ACK:
            raise RingBroken(f"{dest} refused a chunk", dest)

    async def _send(self, dest: str, kind: str, payload: bytes) -> bytes:
        return await self.endpoint.send(
            dest,
            kind,
            payload,
            run=self.run,
            round=self.round,
            stage=self.stage,
            timeout=self.timeout,
        )

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
        after the failure detector's delay rather than a whole ``timeout``. A member's
        abort that blames ``src`` makes the wait ping it at once. An abort ends the
        wait; one that cuts this node's all-gather from a step on ends only the waits
        of that step and later ones.
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
        key: ChunkKey = (self.run, self.round, self.rid, phase, step, frame, src)
        fut = self.box.slot(key)
        await self._wait_for(fut, src, wait, step if phase in GATHER_PHASES else None)
        payload = fut.result()
        self.box.chunks.pop(key, None)
        self.box.buffered -= len(payload)
        _version, _phase, got_bits, _step, got_index, got_frame, got_count, _rid = (
            HEADER.unpack_from(payload)
        )
        body = memoryview(payload)[HEADER.size :]  # read where it lies: no copy
        elements = None
        if got_bits == self.bits and (got_index, got_frame, got_count) == (index, frame, count):
            elements = self._elements(body, count)
        if elements is None:
            raise RingBroken(f"malformed chunk {index} from {src}", src)
        return elements

    async def _wait_for(
        self, fut: asyncio.Future[bytes], src: str, wait: float, step: int | None = None
    ) -> None:
        """Until ``fut`` is done, up to ``wait`` s; pings ``src`` each ``timeout``, and
        once as soon as ``alive`` says it is gone (see :meth:`receive`). An abort ends
        the wait; one that cuts this node's all-gather from a step on
        (:meth:`RoundBox.cut`) ends it only at that ``step`` or later."""
        loop = asyncio.get_running_loop()
        end = loop.time() + wait
        next_ping = loop.time() + self.timeout
        # membership says src is gone: ping it once at once (not on every poll)
        doubted = False
        poll = self.timeout if self.alive is None else min(self.timeout, LIVENESS_POLL_S)
        box, rid = self.box, self.rid
        cut_event = box.cut_events.setdefault(rid, asyncio.Event())

        def stopped() -> bool:
            return self.abort.is_set() or (step is not None and step >= box.cuts.get(rid, step + 1))

        while True:
            if stopped() and not fut.done():
                self._stop(src)
            if not doubted and not fut.done() and src in box.suspects.get(rid, ()):
                # a member's abort blames src: ping it now (gone: this node stops at
                # this very step, and knows which members its stop cuts off)
                doubted = True
                await self._ping(src)
                continue
            waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(self.abort.wait())]
            if step is not None and not cut_event.is_set():
                waiters.append(asyncio.ensure_future(cut_event.wait()))
            now = loop.time()
            try:
                done, _ = await asyncio.wait(
                    {fut, *waiters},
                    timeout=max(0.0, min(poll, next_ping - now, end - now)),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                for waiter in waiters:
                    waiter.cancel()
            if fut in done:
                return
            if stopped():
                self._stop(src)
            now = loop.time()
            if now >= end:
                raise RingBroken(f"no chunk from {src} within {wait:g}s", src)
            if now >= next_ping:
                next_ping = now + self.timeout
            elif self.alive is not None and not doubted and not self.alive(src):
                doubted = True
            else:
                continue
            await self._ping(src)

    def _stop(self, src: str) -> None:
        """A member's abort stopped this wait: ``src`` is gone when the abort blames it
        (this node then tells the members its stop cuts off), else this node stops
        quietly (the abort's sender told every member that has to stop)."""
        if src in self.box.suspects.get(self.rid, ()):
            raise RingBroken(f"{src} is gone, a member's abort says", src)
        raise RingAborted("a ring member aborted")

    async def _ping(self, src: str) -> None:
        try:
            await self._send(src, KIND_PING, self.rid)
        except PeerUnreachable as exc:
            raise RingBroken(f"{src} is gone: {exc}", src) from exc
        except TransportError:
            pass  # it answered (alive, perhaps done with this round) or is just slow

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

    async def exchange_keeping(
        self, sending: Awaitable[None], receiving: Awaitable[np.ndarray]
    ) -> tuple[np.ndarray, RingBroken | None]:
        """Send and receive at once, where neither failure cuts the other short: a
        failed send does not end the receive (the chunk and the send's failure are
        returned), and a failed receive is raised once the send has finished."""
        sender = asyncio.ensure_future(sending)
        try:
            chunk = await receiving
        except RingBroken:
            with contextlib.suppress(RingBroken):
                await sender
            raise
        except BaseException:
            sender.cancel()
            raise
        try:
            await sender
        except RingBroken as exc:
            return chunk, exc
        return chunk, None
