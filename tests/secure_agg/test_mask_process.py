"""The mask helper process: what it writes into a caller's segment, and how its jobs end."""

from __future__ import annotations

import os
import queue
import signal
from collections.abc import Iterator
from multiprocessing import shared_memory

import numpy as np
import pytest

from secure_agg import prg
from secure_agg.mask_process import LOST, MaskProcess, OnChunk

WAIT_S = 60.0


@pytest.fixture
def helper() -> Iterator[MaskProcess]:
    process = MaskProcess()
    yield process
    process.close()


def _segment(length: int, dtype: type) -> shared_memory.SharedMemory:
    return shared_memory.SharedMemory(create=True, size=length * np.dtype(dtype).itemsize)


def _masks(count: int, seed: int) -> list[tuple[bytes, int]]:
    rng = np.random.default_rng(seed)
    return [(rng.bytes(32), 1 if i % 3 else -1) for i in range(count)]


def _reports() -> tuple[queue.Queue[tuple[int, str | None]], OnChunk]:
    reports: queue.Queue[tuple[int, str | None]] = queue.Queue()

    def on_chunk(index: int, error: str | None) -> None:
        reports.put((index, error))

    return reports, on_chunk


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint64])
def test_the_helper_writes_each_chunk_s_masks_bit_for_bit_in_the_order_asked(
    helper: MaskProcess, dtype: type
) -> None:
    length, masks = 100_003, _masks(5, 1)
    bounds = [(0, 30_000), (30_000, 60_001), (60_001, length)]
    order = [2, 0, 1]
    shm = _segment(length, dtype)
    try:
        reports, on_chunk = _reports()
        job = helper.submit(
            shm.name, length, np.dtype(dtype), masks, [(c, *bounds[c]) for c in order], on_chunk
        )
        assert job is not None
        got = [reports.get(timeout=WAIT_S) for _ in order]
        assert got == [(c, None) for c in order]
        view = np.ndarray((length,), dtype=dtype, buffer=shm.buf)
        expected: np.ndarray = np.zeros(length, dtype=dtype)
        prg.add_masks(expected, masks)
        assert np.array_equal(view, expected)
        del view
    finally:
        shm.close()
        shm.unlink()


def test_a_segment_the_helper_cannot_map_ends_its_job_as_lost(helper: MaskProcess) -> None:
    reports, on_chunk = _reports()
    job = helper.submit(
        "fw-masks-no-such-segment", 10, np.dtype(np.uint32), _masks(1, 2), [(0, 0, 10)], on_chunk
    )
    assert job is not None
    index, error = reports.get(timeout=WAIT_S)
    assert index == LOST and error is not None and "segment" in error


def test_a_helper_killed_mid_job_loses_the_job_and_the_next_job_starts_another(
    helper: MaskProcess,
) -> None:
    length, masks = 4_000_000, _masks(8, 3)
    chunks = [(c, c * 400_000, (c + 1) * 400_000) for c in range(10)]
    shm = _segment(length, np.uint32)
    try:
        reports, on_chunk = _reports()
        assert helper.submit(shm.name, length, np.dtype(np.uint32), masks, chunks, on_chunk)
        pid = helper.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        seen: list[tuple[int, str | None]] = []
        while not seen or seen[-1][0] != LOST:
            seen.append(reports.get(timeout=WAIT_S))
        assert len(seen) <= len(chunks)  # a lost job is told once, after what it got
        assert seen[-1][1] == "the mask helper process exited"
        # the next job runs in a new helper
        again, on_again = _reports()
        assert helper.submit(shm.name, 10, np.dtype(np.uint32), masks, [(0, 0, 10)], on_again)
        assert again.get(timeout=WAIT_S) == (0, None)
        assert helper.starts == 2 and helper.pid not in (None, pid)
    finally:
        shm.close()
        shm.unlink()


def test_a_dropped_job_is_not_reported_further_and_close_stops_the_helper(
    helper: MaskProcess,
) -> None:
    length = 2_000_000
    chunks = [(c, c * 200_000, (c + 1) * 200_000) for c in range(10)]
    shm = _segment(length, np.uint32)
    try:
        reports, on_chunk = _reports()
        job = helper.submit(shm.name, length, np.dtype(np.uint32), _masks(8, 4), chunks, on_chunk)
        assert job is not None
        helper.drop(job)
        pid = helper.pid
        helper.close()
        assert helper.pid is None
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        # whatever came before the drop, nothing says the job was lost: it was dropped
        while not reports.empty():
            assert reports.get()[0] != LOST
    finally:
        shm.close()
        shm.unlink()
