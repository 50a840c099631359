"""Masks streamed from the helper process into the ring: exact sums, faults, clean-up."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import signal
from collections.abc import Iterator

import numpy as np
import pytest
from coordinator_free.ring.wire import chunk_bounds
from coordinator_free.rounds import RoundConfig
from coordinator_free.rounds import mask_stream as mask_stream_module
from coordinator_free.rounds.mask_stream import (
    AUTO_MIN_CORES,
    PIECE_BYTES,
    MaskStream,
    helper,
    open_segments,
    pieces,
    uses_helper,
)
from coordinator_free.sim import Fault, FaultSpec, RoundOutcome, SimConfig, Simulation
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_agg import prg
from secure_agg.mask_process import LOST, MaskProcess
from tests.coordinator_free.test_rounds import FAST, KILL_STAGES, OWNER_KILL_STAGES

# every round streams its masks (none are prepared before it: test_masks_prepared)
STREAMED = dataclasses.replace(FAST, mask_helper="process", prepared_masks_bytes=None)


@dataclasses.dataclass
class Calls:
    add: int = 0
    add_all: int = 0


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    """How often the ring asked the streams for a chunk, and for all of them at once."""
    seen = Calls()
    add, add_all = MaskStream.add, MaskStream.add_all

    async def counted_add(self: MaskStream, acc: np.ndarray, chunk: int) -> None:
        seen.add += 1
        await add(self, acc, chunk)

    async def counted_add_all(self: MaskStream, acc: np.ndarray) -> None:
        seen.add_all += 1
        await add_all(self, acc)

    monkeypatch.setattr(MaskStream, "add", counted_add)
    monkeypatch.setattr(MaskStream, "add_all", counted_add_all)
    yield seen
    assert open_segments() == frozenset()


def _rounds(
    config: RoundConfig, peers: int, faults: list[FaultSpec], count: int = 1
) -> list[RoundOutcome]:
    async def scenario() -> list[RoundOutcome]:
        sim_config = SimConfig(peers=peers, length=64, seed=7, round_config=config)
        async with Simulation(sim_config, faults) as sim:
            return [await sim.round(r) for r in range(1, count + 1)]

    return asyncio.run(scenario())


@pytest.mark.parametrize("peers", [5, 8], ids=["all-reduce", "owner-unmasking"])
def test_masks_from_the_helper_give_the_sums_of_masks_from_threads(
    calls: Calls, peers: int
) -> None:
    streamed = _rounds(STREAMED, peers, [], count=2)
    threaded = _rounds(FAST, peers, [], count=2)
    for mine, theirs in zip(streamed, threaded, strict=True):
        assert mine.problems() == [] and theirs.problems() == []
        for org, res in mine.results.items():
            assert np.array_equal(res.sum, theirs.results[org].sum)
    # every chunk of every member's input took its masks just before it first left
    assert calls.add == 2 * peers * peers and calls.add_all == 0
    assert helper().starts >= 1


@pytest.mark.parametrize("stage, victim_in_sum", KILL_STAGES, ids=[s for s, _ in KILL_STAGES])
def test_streamed_masks_with_a_peer_killed_at_each_stage(
    calls: Calls, stage: str, victim_in_sum: bool
) -> None:
    victim = "org-3"
    first, second = _rounds(STREAMED, 5, [FaultSpec(victim, Fault.KILL, stage, round=1)], 2)
    assert first.problems() == [] and second.problems() == []
    assert set(first.results) == {"org-0", "org-1", "org-2", "org-4"}
    for res in first.results.values():
        assert (victim in res.survivors) is victim_in_sum
    assert set(second.results) == {"org-0", "org-1", "org-2", "org-4"}
    assert calls.add > 0  # the survivors' masks came from the helper


@pytest.mark.parametrize(
    "stage, victim_in_sum", OWNER_KILL_STAGES, ids=[s for s, _ in OWNER_KILL_STAGES]
)
def test_streamed_masks_with_owner_unmasking_and_a_peer_killed_at_each_stage(
    calls: Calls, stage: str, victim_in_sum: bool
) -> None:
    victim = "org-3"
    (first,) = _rounds(STREAMED, 8, [FaultSpec(victim, Fault.KILL, stage, round=1)])
    assert first.problems() == []
    for res in first.results.values():
        assert (victim in res.survivors) is victim_in_sum
        assert (res.sum == first.expected(res.survivors)).all()
        # a second attempt masks its input again itself: the stream served the first
        assert res.ring_attempts == (1 if victim_in_sum else 2)
    assert calls.add > 0


def test_a_member_gone_after_its_ready_makes_the_ring_take_the_stream_whole(
    calls: Calls,
) -> None:
    # org-3 is ready and then gone: the ring runs over four members, not the five whose
    # chunks the streams were cut for, so each member adds its masks before it starts
    (out,) = _rounds(STREAMED, 5, [FaultSpec("org-3", Fault.KILL, "share", round=1)])
    assert out.problems() == [] and len(out.results) == 4
    assert calls.add_all == 4


# -- one stream, against prg ---------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 300),
    length=st.integers(1, 1 << 20),
    pos=st.integers(0, 299),
    itemsize=st.sampled_from([2, 4, 8]),
)
def test_pieces_cut_the_ring_order_into_contiguous_runs_of_enough_bytes(
    n: int, length: int, pos: int, itemsize: int
) -> None:
    bounds = chunk_bounds(max(length, n), n)
    order = [(pos % n - s) % n for s in range(n)]
    cut = pieces(bounds, order, itemsize)
    assert [c for piece in cut for c in piece] == order
    for i, piece in enumerate(cut):
        assert all(b == a - 1 for a, b in itertools.pairwise(piece))
        size = sum(bounds[c][1] - bounds[c][0] for c in piece) * itemsize
        last_of_run = i + 1 == len(cut) or cut[i + 1][0] != piece[-1] - 1
        assert size >= PIECE_BYTES or last_of_run
        # a piece stops growing as soon as it is large enough
        assert sum(bounds[c][1] - bounds[c][0] for c in piece[:-1]) * itemsize < PIECE_BYTES


def _masks(count: int) -> list[tuple[bytes, int]]:
    rng = np.random.default_rng(11)
    return [(rng.bytes(32), -1 if i % 2 else 1) for i in range(count)]


def _vector_and_masks(
    seed: int, length: int, count: int
) -> tuple[np.ndarray, np.ndarray, list[tuple[bytes, int]]]:
    """A ring vector, the same with ``count`` masks added by :mod:`secure_agg.prg`, and
    the masks."""
    x = np.random.default_rng(seed).integers(0, 2**32, length, dtype=np.uint64)
    acc = x.astype(np.uint32)
    expected = acc.copy()
    masks = _masks(count)
    prg.add_masks(expected, masks)
    return acc, expected, masks


async def _streamed(
    process: MaskProcess, acc: np.ndarray, masks: list[tuple[bytes, int]], n: int, kill: bool
) -> MaskStream:
    bounds = chunk_bounds(acc.shape[0], n)
    order = [(2 - s) % n for s in range(n)]
    stream = MaskStream.start(process, acc, masks, bounds, order)
    assert stream is not None
    try:
        if kill:
            pid = process.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        assert stream.fits(bounds) and not stream.fits(chunk_bounds(acc.shape[0], n + 1))
        for chunk in order:
            await stream.add(acc, chunk)
        with pytest.raises(RuntimeError, match="added already"):
            await stream.add(acc, order[0])
    finally:
        stream.close()
    return stream


@pytest.mark.parametrize("kill", [False, True], ids=["helper", "helper-killed"])
def test_a_stream_adds_exactly_the_masks_of_prg_even_when_its_helper_dies(kill: bool) -> None:
    process = MaskProcess()
    try:
        acc, expected, masks = _vector_and_masks(5, 3_000_001, 12)
        stream = asyncio.run(_streamed(process, acc, masks, 7, kill))
        assert np.array_equal(acc, expected)
        if kill:  # the chunks the helper did not report were expanded here
            assert stream.expanded_here >= 1
        else:
            assert stream.expanded_here == 0
        assert open_segments() == frozenset()
    finally:
        process.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="POSIX shared memory under /dev/shm")
def test_a_stream_s_segment_is_the_node_s_alone_and_gone_when_the_stream_closes() -> None:
    process = MaskProcess()

    async def scenario() -> tuple[int, bool]:
        acc = np.zeros(1000, dtype=np.uint32)
        stream = MaskStream.start(process, acc, _masks(2), chunk_bounds(1000, 2), [0, 1])
        assert stream is not None and stream.segment is not None
        path = f"/dev/shm/{stream.segment}"
        mode = os.stat(path).st_mode & 0o777
        await stream.add_all(acc)
        stream.close()
        return mode, os.path.exists(path)

    try:
        mode, left = asyncio.run(scenario())
    finally:
        process.close()
    assert mode == 0o600 and not left
    assert open_segments() == frozenset()


def test_no_stream_when_shared_memory_has_no_room_for_the_vector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    process = MaskProcess()
    monkeypatch.setattr(mask_stream_module, "shm_room", lambda: 4 * 999)

    async def starts() -> tuple[bool, bool]:
        made = []
        for length in (1000, 999):  # 4 000 bytes, then 3 996, with 3 996 free
            target = np.zeros(length, dtype=np.uint32)
            stream = MaskStream.start(process, target, _masks(2), [(0, length)], [0])
            made.append(stream is not None)
            if stream is not None:
                stream.close()
        return made[0], made[1]

    try:
        assert asyncio.run(starts()) == (False, True)
    finally:
        process.close()
    assert open_segments() == frozenset()


def test_no_stream_for_an_empty_vector_or_no_masks() -> None:
    process = MaskProcess()

    async def both() -> tuple[MaskStream | None, MaskStream | None]:
        empty = np.zeros(0, dtype=np.uint32)
        full = np.zeros(10, dtype=np.uint32)
        return (
            MaskStream.start(process, empty, _masks(2), [(0, 0)], [0]),
            MaskStream.start(process, full, [], [(0, 10)], [0]),
        )

    assert asyncio.run(both()) == (None, None)
    assert process.starts == 0


def test_auto_uses_the_helper_from_four_cores_and_the_settings_are_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the shipped threshold, not the suite's (tests/conftest.py)
    monkeypatch.setattr(mask_stream_module, "AUTO_MIN_CORES", AUTO_MIN_CORES)
    assert AUTO_MIN_CORES == 4
    assert uses_helper("auto", cores=AUTO_MIN_CORES) and not uses_helper("auto", cores=2)
    assert uses_helper("process", cores=1) and not uses_helper("thread", cores=64)
    with pytest.raises(ValueError, match="mask_helper"):
        RoundConfig(mask_helper="gpu")
    assert mask_stream_module.MASK_HELPERS == ("auto", "process", "thread")


def test_a_ring_cancelled_while_a_chunk_expands_here_gets_its_vector_back_after_drain() -> None:
    """The helper is lost, so a chunk's masks are expanded in a worker thread; the ring
    that waited for them is cancelled (a ring started with U1 pending, dropped). The thread
    still writes into the vector: ``drain`` returns once it has, and the chunk then
    holds its masks exactly once, so the vector can be masked again safely."""
    process = MaskProcess()
    try:
        acc, expected, masks = _vector_and_masks(6, 2_000_003, 16)
        n = 3
        bounds = chunk_bounds(acc.shape[0], n)

        async def scenario() -> None:
            stream = MaskStream.start(process, acc, masks, bounds, list(range(n)))
            assert stream is not None
            # the helper is lost before it reported a piece (its reports reach the loop
            # only once this step yields): every chunk is expanded here
            stream._arrived(LOST, None)
            try:
                adding = asyncio.ensure_future(stream.add(acc, 0))
                while not stream._expanding:  # the chunk's thread started
                    assert not adding.done()
                    await asyncio.sleep(0.001)
                adding.cancel()
                await asyncio.wait({adding})
                assert adding.cancelled()
                await stream.drain()
                assert not stream._expanding
                lo, hi = bounds[0]
                assert np.array_equal(acc[lo:hi], expected[lo:hi])
                await stream.drain()  # nothing in flight: returns at once
            finally:
                stream.close()

        asyncio.run(scenario())
    finally:
        process.close()
