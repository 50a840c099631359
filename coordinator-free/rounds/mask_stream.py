"""A round's masks streamed into its reduce-scatter from the mask helper process.

``docs/ARCHITECTURE.md``, "A round", step 2. Where ``RoundConfig.mask_helper`` says so
(:func:`uses_helper`), the share stage does not run the premask's work (the masks of
the usual case, :meth:`~coordinator_free.rounds.session.SecAggSession.premask`) in a
worker thread. It hands the masks to the interpreter's helper process
(:class:`~secure_agg.mask_process.MaskProcess`), which writes them into a
shared-memory vector chunk by chunk, in the order this node's reduce-scatter will
first send its chunks (the ring order of the ready orgs, the usual ``U1``). The ring
adds a chunk's masks just before the chunk first leaves (:class:`MaskStream`, an
:class:`~coordinator_free.ring.steps.InputFeed`), so the masks' CPU overlaps the
share exchange, the agreement and the ring's first steps, on another core, instead of
slowing this interpreter's loop.

Every sum stays what it was, bit for bit: each chunk receives the same masks, once,
before it leaves. A ring over other members than expected (a ready org left) takes
the whole stream before it starts; a chunk whose masks the helper did not report (it
died, or could not map the segment) is expanded here, off the loop. The stream serves
the first ring attempt only: a later attempt makes the masked input again from the
input (:meth:`~coordinator_free.rounds.session.SecAggSession.masked_input`). The
segment is unlinked when the first attempt ends or the round does, whichever is first.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import secrets
from collections.abc import Sequence
from multiprocessing import shared_memory

import numpy as np
from coordinator_free.ring.wire import chunk_bounds
from coordinator_free.rounds.config import MASK_HELPERS

from secure_agg import prg
from secure_agg.mask_process import LOST, Chunk, MaskProcess

__all__ = [
    "AUTO_MIN_CORES",
    "MASK_HELPERS",
    "PIECE_BYTES",
    "MaskStream",
    "helper",
    "open_segments",
    "pieces",
    "stream_masks",
    "uses_helper",
]

AUTO_MIN_CORES = 4
"""``auto`` uses the helper process on a machine with at least this many cores: one for
the node's loop, one for the helper, and room for the ring's I/O and the OS. With two
cores shared by several nodes it was slower (``docs/ARCHITECTURE.md``)."""

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
"""Where POSIX shared memory lives on Linux: a stream starts only when it has room."""

PIECE_BYTES = 1 << 16
"""The least the helper writes and reports at a time: consecutive chunks of the ring
order grouped into pieces of at least this many bytes (at n = 256 and 256k parameters a
chunk is 4 KiB, and a report per chunk would cost the loop more than it saves)."""

_HELPER: MaskProcess | None = None
_OPEN: set[str] = set()


def open_segments() -> frozenset[str]:
    """The shared-memory segments this process's streams hold now (none between rounds)."""
    return frozenset(_OPEN)


def helper() -> MaskProcess:
    """This interpreter's mask helper (started on its first job, stopped at exit)."""
    global _HELPER
    if _HELPER is None:
        _HELPER = MaskProcess()
        atexit.register(_HELPER.close)
    return _HELPER


def shm_room() -> int | None:
    """Bytes free for shared memory (``None`` where the platform does not say: the
    segment is then tried as it is)."""
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def uses_helper(setting: str, cores: int | None = None) -> bool:
    """Whether ``RoundConfig.mask_helper = setting`` expands masks in the helper process
    on a machine of ``cores`` cores (``os.cpu_count()`` by default)."""
    if setting == "auto":
        return (cores if cores is not None else os.cpu_count() or 1) >= AUTO_MIN_CORES
    return setting == "process"


class MaskStream:
    """One round's masks, expanded by the helper process into a shared-memory vector
    and added to the ring's vector chunk by chunk (:class:`~coordinator_free.ring.steps.InputFeed`)."""

    def __init__(
        self,
        shm: shared_memory.SharedMemory,
        dtype: np.dtype,
        length: int,
        masks: Sequence[tuple[bytes, int]],
        bounds: Sequence[tuple[int, int]],
        order: Sequence[int],
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._shm: shared_memory.SharedMemory | None = shm
        self._view: np.ndarray | None = np.ndarray((length,), dtype=dtype, buffer=shm.buf)
        self._masks = list(masks)
        self.bounds = [(int(lo), int(hi)) for lo, hi in bounds]
        self.order = list(order)
        self.pieces = pieces(self.bounds, self.order, dtype.itemsize)
        """The helper's steps: consecutive chunks of ``order``, written and reported together."""
        self._piece_of = {c: p for p, piece in enumerate(self.pieces) for c in piece}
        self._ready: dict[int, asyncio.Future[bool]] = {
            p: self._loop.create_future() for p in range(len(self.pieces))
        }
        self._added: set[int] = set()
        self._expanding: set[asyncio.Future[None]] = set()
        self._process: MaskProcess | None = None
        self._job: int | None = None
        self.expanded_here = 0
        """Chunks this node expanded itself (the helper did not report them)."""

    @classmethod
    def start(
        cls,
        process: MaskProcess,
        target: np.ndarray,
        masks: Sequence[tuple[bytes, int]],
        bounds: Sequence[tuple[int, int]],
        order: Sequence[int],
    ) -> MaskStream | None:
        """A stream of ``masks`` for a vector like ``target``, cut at ``bounds``, in the
        chunk ``order``; ``None`` when the helper cannot take it (the caller then
        masks in a worker thread)."""
        if target.size == 0 or not masks:
            return None
        room = shm_room()
        if room is not None and room < target.nbytes:
            # a helper writing past a full /dev/shm would die of SIGBUS mid-round
            logger.warning(
                "%d bytes of shared memory free, %d needed: masks in a worker thread",
                room,
                target.nbytes,
            )
            return None
        try:
            shm = shared_memory.SharedMemory(
                name=f"fw-masks-{secrets.token_hex(8)}", create=True, size=target.nbytes
            )
        except OSError:
            return None
        _OPEN.add(shm.name)
        stream = cls(shm, target.dtype, target.shape[0], masks, bounds, order)
        chunks: list[Chunk] = [
            (p, stream.bounds[piece[-1]][0], stream.bounds[piece[0]][1])
            for p, piece in enumerate(stream.pieces)
        ]
        job = process.submit(shm.name, target.shape[0], target.dtype, masks, chunks, stream._report)
        if job is None:
            stream.close()
            return None
        stream._process, stream._job = process, job
        return stream

    def _report(self, index: int, error: str | None) -> None:
        """The helper's report (from its reader thread): onto this stream's loop."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(self._arrived, index, error)

    def _arrived(self, index: int, error: str | None) -> None:
        waiting = self._ready.values() if index == LOST else [self._ready.get(index)]
        for future in waiting:
            if future is not None and not future.done():
                future.set_result(index != LOST and error is None)

    @property
    def segment(self) -> str | None:
        """The shared-memory segment's name (``None`` once closed)."""
        return self._shm.name if self._shm is not None else None

    def fits(self, bounds: Sequence[tuple[int, int]]) -> bool:
        return [(int(lo), int(hi)) for lo, hi in bounds] == self.bounds

    async def add(self, acc: np.ndarray, chunk: int) -> None:
        if chunk in self._added:
            raise RuntimeError(f"the masks of chunk {chunk} were added already")
        self._added.add(chunk)
        lo, hi = self.bounds[chunk]
        in_segment = await self._ready[self._piece_of[chunk]]
        if in_segment and self._view is not None:
            np.add(acc[lo:hi], self._view[lo:hi], out=acc[lo:hi])
            return
        if not self.expanded_here:
            logger.warning("the mask helper did not expand chunk %d: expanded here", chunk)
        self.expanded_here += 1
        work = asyncio.ensure_future(
            asyncio.to_thread(prg.add_masks, acc[lo:hi], self._masks, offset=lo)
        )
        self._expanding.add(work)
        work.add_done_callback(self._expanded)
        await asyncio.shield(work)

    def _expanded(self, work: asyncio.Future[None]) -> None:
        self._expanding.discard(work)
        if not work.cancelled():
            work.exception()  # raised to the ring that awaited it, if it still did

    async def drain(self) -> None:
        """Wait for the chunks still being expanded here in worker threads (a ring
        cancelled while it waited for one leaves the thread writing into its vector):
        the vector is the caller's again once this returns."""
        if self._expanding:
            await asyncio.wait(set(self._expanding))

    async def add_all(self, acc: np.ndarray) -> None:
        for chunk in self.order:
            if chunk not in self._added:
                await self.add(acc, chunk)

    def close(self) -> None:
        """Drop the job and unlink the segment (again: nothing)."""
        if self._process is not None and self._job is not None:
            self._process.drop(self._job)
            self._job = None
        for future in self._ready.values():
            if not future.done():
                future.cancel()
        self._view = None
        shm, self._shm = self._shm, None
        if shm is not None:
            _OPEN.discard(shm.name)
            with contextlib.suppress(BufferError):
                shm.close()
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()


def pieces(
    bounds: Sequence[tuple[int, int]], order: Sequence[int], itemsize: int
) -> list[list[int]]:
    """``order`` cut into runs of chunks, each run contiguous in the vector (chunk ``c``
    then ``c - 1``: the reduce-scatter's order) and, but for the last before a wrap or
    the end, of at least :data:`PIECE_BYTES`."""
    out: list[list[int]] = []
    size = 0
    for chunk in order:
        lo, hi = bounds[chunk]
        if out and size < PIECE_BYTES and chunk == out[-1][-1] - 1:
            out[-1].append(chunk)
            size += (hi - lo) * itemsize
        else:
            out.append([chunk])
            size = (hi - lo) * itemsize
    return out


def stream_masks(
    setting: str,
    target: np.ndarray,
    masks: Sequence[tuple[bytes, int]],
    order: Sequence[str],
    me: str,
) -> MaskStream | None:
    """A stream of the premask's ``masks`` into ``target`` for the ring ``order`` (the
    round's ring of the orgs this node masks with), or ``None`` where the worker thread
    masks (the setting, an input without its own array, or no helper)."""
    if not uses_helper(setting) or me not in order:
        return None
    n, pos = len(order), order.index(me)
    bounds = chunk_bounds(target.shape[0], n)
    # the reduce-scatter first sends chunk pos - s at step s, and reduces pos + 1 last
    chunks = [(pos - s) % n for s in range(n)]
    return MaskStream.start(helper(), target, masks, bounds, chunks)
