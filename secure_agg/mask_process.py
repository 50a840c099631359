"""Mask expansion in a helper process, into shared memory, chunk by chunk.

A round's masks (:func:`~secure_agg.prg.add_masks`) are pure CPU: AES-CTR keystream
folded into a vector. In threads of the interpreter that runs a node's event loop
they slow the loop even where the keystream does not hold the interpreter lock
(``docs/ARCHITECTURE.md``, "What the masks cost"). :class:`MaskProcess` runs them in
one helper process instead, for every round of the interpreter that starts it (a
deployed node runs one; a simulation of many nodes in one process shares one).

A job names a shared-memory segment its caller created (zero-filled, one ring array
of the vector's length), the masks, and the vector's chunks in the order the caller
needs them. The helper writes the sum of the masks of each chunk into the segment,
one chunk of each job in turn (so that every job's first chunks come early), and
reports each chunk when it is complete; the caller reads a chunk only after its
report. The helper never creates, resizes or unlinks a segment: the caller owns it.

The helper is started on the first job and started again on the next job after it
died; when it dies, every open job is told (``chunk = -1``) and its caller expands
what remains itself. Jobs go to the helper over a pair of pipes that only this process
and the helper hold: the masks' seeds never leave the machine, and the caller creates
the segment with mode 0600 (``multiprocessing.shared_memory``'s).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from secure_agg import prg
from secure_agg.errors import ConfigError, RingError

__all__ = ["LOST", "Chunk", "MaskProcess", "OnChunk"]

logger = logging.getLogger(__name__)

Chunk = tuple[int, int, int]
"""``(index, lo, hi)``: chunk ``index`` of a job is the elements ``[lo, hi)``."""

OnChunk = Callable[[int, str | None], None]
"""``on_chunk(index, error)``: chunk ``index`` of a job is in the segment, or (``index ==
LOST``) the job ended without its remaining chunks, ``error`` saying why. Called from
the reader thread."""

LOST = -1
"""The chunk index of a job's end without its remaining chunks."""

_NEW, _DROP = "new", "drop"


@dataclass
class _Job:
    """A job as the helper holds it: the segment's array and the chunks still to do."""

    shm: shared_memory.SharedMemory
    view: np.ndarray
    masks: list[tuple[bytes, int]]
    todo: list[Chunk]

    def step(self) -> int:
        """Write the masks of the next chunk; its index."""
        index, lo, hi = self.todo.pop(0)
        prg.add_masks(self.view[lo:hi], self.masks, offset=lo)
        return index

    def close(self) -> None:
        del self.view
        with contextlib.suppress(BufferError):
            self.shm.close()


def _job(request: tuple[Any, ...]) -> _Job:
    """A new job's segment, mapped here (the caller owns it, see :func:`main`)."""
    name, length, dtype, masks, chunks = request
    shm = shared_memory.SharedMemory(name=str(name))
    view = np.ndarray((int(length),), dtype=np.dtype(str(dtype)), buffer=shm.buf)
    todo = [(int(c), int(lo), int(hi)) for c, lo, hi in chunks]
    return _Job(shm, view, [(bytes(seed), int(sign)) for seed, sign in masks], todo)


def serve(requests: Connection, reports: Connection) -> None:
    """The helper's loop: the caller's requests first, then one chunk of each open job in
    turn, each reported as ``(job, chunk, error)``. It ends when the caller's end closes."""
    jobs: dict[int, _Job] = {}
    try:
        while True:
            while requests.poll(0 if jobs else None):
                kind, job_id, *rest = requests.recv()
                if kind == _DROP:
                    dropped = jobs.pop(job_id, None)
                    if dropped is not None:
                        dropped.close()
                    continue
                try:
                    jobs[job_id] = _job(tuple(rest))
                except (OSError, ValueError) as exc:
                    reports.send((job_id, LOST, f"cannot map the segment: {exc}"))
            for job_id, job in list(jobs.items()):
                try:
                    reports.send((job_id, job.step(), None))
                except (ValueError, ConfigError, RingError) as exc:
                    reports.send((job_id, LOST, str(exc)))
                    job.todo.clear()
                if not job.todo:
                    del jobs[job_id]
                    job.close()
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    finally:
        for job in jobs.values():
            job.close()


def _untracked(name: str, rtype: str) -> None:
    """The helper's resource tracking: none (it maps segments it does not own)."""


def main(argv: Sequence[str]) -> None:
    """``python -m secure_agg.mask_process IN OUT``: the helper, reading requests from the
    pipe ``IN`` and writing reports to ``OUT``, the descriptors its caller passed it. It
    is started as a plain program, not through ``multiprocessing``, so the caller's main
    module is never run again here. The segments it maps are its caller's, which
    unlinks them: they are not registered with a resource tracker here (one would
    unlink them when the helper exits)."""
    resource_tracker.register = _untracked  # type: ignore[assignment]
    resource_tracker.unregister = _untracked  # type: ignore[assignment]
    serve(Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False))


@dataclass
class _Helper:
    """One running helper: its process, the pipe its requests go down and the one its
    reports come up."""

    proc: subprocess.Popen[bytes]
    requests: Connection
    reports: Connection

    @classmethod
    def start(cls) -> _Helper:
        down_r, down_w = os.pipe()
        up_r, up_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "secure_agg.mask_process", str(down_r), str(up_w)],
                pass_fds=(down_r, up_w),
                stdin=subprocess.DEVNULL,
            )
        except OSError:
            for fd in (down_w, up_r):
                os.close(fd)
            raise
        finally:
            os.close(down_r)
            os.close(up_w)
        return cls(proc, Connection(down_w, readable=False), Connection(up_r, writable=False))

    def running(self) -> bool:
        return self.proc.poll() is None and not self.requests.closed

    def stop(self) -> None:
        """Close the requests' pipe (the helper ends there) and wait for it."""
        self.requests.close()
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=2.0)


class MaskProcess:
    """The helper process of this interpreter, and the jobs it runs (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._helper: _Helper | None = None
        self._jobs: dict[int, tuple[_Helper, OnChunk]] = {}
        self._ids = itertools.count(1)
        self.starts = 0
        """How many times a helper was started (a restart after a crash counts)."""

    def _running(self) -> _Helper:
        """A live helper, started (again) if there is none (the lock is held)."""
        if self._helper is not None and self._helper.running():
            return self._helper
        self._shut()
        helper = self._helper = _Helper.start()
        self.starts += 1
        threading.Thread(
            target=self._read, args=(helper,), name="fedweave-masks-reader", daemon=True
        ).start()
        return helper

    def warm(self) -> None:
        """Start the helper now, if none runs: a first job then finds it up (it takes a
        fraction of a second to start, like any Python process)."""
        with self._lock:
            try:
                self._running()
            except OSError as exc:
                logger.warning("the mask helper process cannot start: %s", exc)

    def submit(
        self,
        segment: str,
        length: int,
        dtype: np.dtype,
        masks: Sequence[tuple[bytes, int]],
        chunks: Sequence[Chunk],
        on_chunk: OnChunk,
    ) -> int | None:
        """Start a job on ``segment`` (a shared-memory name, ``length`` elements of
        ``dtype``): its id, or ``None`` when no helper could be started or reached."""
        request = (segment, length, dtype.str, list(masks), list(chunks))
        with self._lock:
            job_id = next(self._ids)
            for tries_left in (1, 0):  # a helper that just died: once more, in a new one
                try:
                    helper = self._running()
                    self._jobs[job_id] = (helper, on_chunk)
                    helper.requests.send((_NEW, job_id, *request))
                    return job_id
                except (OSError, ValueError) as exc:
                    self._jobs.pop(job_id, None)
                    self._shut()
                    if not tries_left:
                        logger.warning("the mask helper process is unavailable: %s", exc)
            return None

    def drop(self, job_id: int) -> None:
        """Forget a job; the helper stops writing its segment (the caller may unlink it
        at once: a mapping outlives the name)."""
        with self._lock:
            held = self._jobs.pop(job_id, None)
            if held is None or held[0] is not self._helper:
                return
            with contextlib.suppress(OSError, ValueError):
                held[0].requests.send((_DROP, job_id))

    def _read(self, helper: _Helper) -> None:
        """The reader thread of one helper: its reports, then, once it is gone, every
        job it held told that it is lost."""
        try:
            while True:
                job_id, index, error = helper.reports.recv()
                with self._lock:
                    held = self._jobs.get(job_id)
                    if index == LOST:
                        self._jobs.pop(job_id, None)
                if held is not None:
                    held[1](index, error)
        except (EOFError, OSError):
            pass
        helper.reports.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            helper.proc.wait(timeout=5.0)  # it is exiting: reaped here
        with self._lock:
            if self._helper is helper:  # the next job starts another helper
                self._helper = None
                helper.requests.close()
            lost = [job_id for job_id, (h, _) in self._jobs.items() if h is helper]
            ended = [self._jobs.pop(job_id)[1] for job_id in lost]
        if ended:
            logger.warning(
                "the mask helper process exited (status %s) with %d job(s) open: their "
                "rounds expand the rest themselves",
                helper.proc.returncode,
                len(ended),
            )
        for on_chunk in ended:
            on_chunk(LOST, "the mask helper process exited")

    def _shut(self) -> None:
        """Stop the helper, if one runs (the lock is held)."""
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.stop()

    @property
    def pid(self) -> int | None:
        """The running helper's process id (``None`` when none runs)."""
        helper = self._helper
        return helper.proc.pid if helper is not None and helper.running() else None

    def close(self) -> None:
        """Stop the helper; its open jobs are lost (their callers finish them)."""
        with self._lock:
            self._shut()


if __name__ == "__main__":
    main(sys.argv[1:])
