"""The round engine's heavy computation, masking and unmasking a vector, runs off its
event loop; the secrets stay on it. Small array work (below
``session.ON_LOOP_WORK_BYTES``) runs on the loop, cheaper than the hop to a thread."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from coordinator_free.rounds import mask_stream, prepared, session
from coordinator_free.sim import SimConfig, Simulation

from secure_agg import prg


def _mask_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """From now on, ``(target length, on the test's thread)`` of each mask expansion of
    a round (not those of the next round's masks, prepared after it, in a worker
    thread: ``test_masks_prepared``)."""
    calls: list[tuple[int, bool]] = []
    real, main = prg.add_masks, threading.current_thread()
    real_expand, preparing = prepared._expand, threading.local()

    def recorded(target: np.ndarray, masks: list[tuple[bytes, int]], **kw: object) -> None:
        if masks and not getattr(preparing, "on", False):
            calls.append((target.shape[0], threading.current_thread() is main))
        real(target, masks, **kw)  # type: ignore[arg-type]

    def expand(*args: object) -> prepared.Expanded:
        preparing.on = True
        try:
            return real_expand(*args)  # type: ignore[arg-type]
        finally:
            preparing.on = False

    monkeypatch.setattr(prg, "add_masks", recorded)
    monkeypatch.setattr(prepared, "_expand", expand)
    return calls


def _copy_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool]]:
    """From now on, ``(on the test's thread, the copy is the kept array)`` of each copy
    of the sum owner unmasking hands its caller."""
    from coordinator_free.rounds import unmask

    calls: list[tuple[bool, bool]] = []
    real, main = unmask.decoded_copy, threading.current_thread()

    def recorded(decode: object, acc: np.ndarray) -> np.ndarray:
        out = real(decode, acc)  # type: ignore[arg-type]
        calls.append((threading.current_thread() is main, out is acc))
        return out

    monkeypatch.setattr(unmask, "decoded_copy", recorded)
    return calls


def _exact_round(peers: int, length: int, seed: int) -> None:
    """One simulated round of ``peers``; every node holds the plaintext sum."""

    async def scenario() -> None:
        async with Simulation(SimConfig(peers=peers, length=length, seed=seed)) as sim:
            outcome = await sim.round(1)
            assert not outcome.problems() and len(outcome.results) == peers
            expected = np.sum([v.astype(np.uint64) for v in outcome.inputs.values()], axis=0)
            for result in outcome.results.values():
                assert np.array_equal(result.sum, expected.astype(result.sum.dtype))

    asyncio.run(scenario())


def test_the_round_engine_expands_masks_off_its_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Masking and unmasking a vector are the round's heavy computation: they run in a
    worker thread (the loop goes on serving messages), only the secrets on the loop.
    (Every piece of work counts as large here: the threshold is set to 0.)"""
    monkeypatch.setattr(session, "ON_LOOP_WORK_BYTES", 0)
    # the masks of the usual case in this process, on a machine of any size
    monkeypatch.setattr(mask_stream, "AUTO_MIN_CORES", 1 << 30)
    length = 20_000
    threads = _mask_calls(monkeypatch)
    _exact_round(4, length, seed=3)
    vector_sized = [on_loop for size, on_loop in threads if size >= length // 4]
    assert len(vector_sized) >= 8  # each of 4 peers masks, and unmasks
    assert not any(vector_sized)


def test_owner_unmasking_hands_the_caller_its_own_sum_copied_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With owner unmasking, a ring-array sum decodes to the vector whose chunks the node
    keeps serving: the caller's copy of it (a vector-sized copy) is made in a worker
    thread when it is large (every piece of work is, here), and it is not the kept array."""
    monkeypatch.setattr(session, "ON_LOOP_WORK_BYTES", 0)
    peers, length = 8, 20_000  # owner unmasking from 8 members, chunks of >= 1024
    calls = _copy_calls(monkeypatch)
    _exact_round(peers, length, seed=5)
    assert len(calls) == peers
    assert not any(on_loop for on_loop, _ in calls)
    assert not any(same for _, same in calls)


def test_small_mask_work_runs_on_the_loop_and_the_sums_stay_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Below the threshold the premask's work, each owner's unmasking of its chunks and
    the caller's copy of the sum run on the loop (no hop to a worker thread), and every
    node still holds the plaintext sum; at or above it, none of them does."""
    peers, length = 8, 20_000  # owner unmasking from 8 members
    masks, copies = _mask_calls(monkeypatch), _copy_calls(monkeypatch)
    monkeypatch.setattr(mask_stream, "AUTO_MIN_CORES", 1 << 30)  # no helper process
    # the largest piece: the premask's copy and masks of the whole vector
    assert 4 * length * (peers + 1) < session.ON_LOOP_WORK_BYTES
    _exact_round(peers, length, seed=5)
    assert masks and copies
    assert all(on_loop for _, on_loop in masks) and all(on_loop for on_loop, _ in copies)
    masks.clear()
    copies.clear()
    monkeypatch.setattr(session, "ON_LOOP_WORK_BYTES", 4 * length // peers)
    _exact_round(peers, length, seed=5)
    assert masks and copies
    assert not any(on_loop for _, on_loop in masks) and not any(on_loop for on_loop, _ in copies)


def test_the_premask_work_counts_the_copy_and_each_mask() -> None:
    """The bytes a premask's work touches: the target once per mask, once more when it
    copies the input from ``base``; none when there is nothing to do."""
    x = np.zeros(1000, dtype=np.uint32)
    seed = bytes(32)
    assert session.Premask(x, [(seed, 1)] * 3, x.copy()).work_bytes == 4 * 4000
    assert session.Premask(x, [(seed, 1)] * 3).work_bytes == 3 * 4000
    assert session.Premask(x, []).work_bytes == 0
    assert session.small_work(session.ON_LOOP_WORK_BYTES - 1)
    assert not session.small_work(session.ON_LOOP_WORK_BYTES)


def test_the_chunks_an_owner_unmasks_are_one_span_when_adjacent() -> None:
    """Owner unmasking expands each mask once over a member's two chunks where they are
    adjacent (every position but where the ring order wraps), and the spans cover
    exactly the two chunks, at every position of rings of 2 to 9 members (held is the
    chunk before own, as the reducer leaves them)."""
    from coordinator_free.ring import Scattered
    from coordinator_free.ring.wire import chunk_bounds
    from coordinator_free.rounds.unmask import held_spans

    for n in range(2, 10):
        bounds = chunk_bounds(100, n)
        for own in range(n):
            held = (own - 1) % n
            spans = held_spans(Scattered(np.zeros(100, np.uint32), own, held, bounds))
            covered = {i for lo, hi in spans for i in range(lo, hi)}
            wanted = {i for c in (own, held) for i in range(*bounds[c])}
            assert covered == wanted
            assert sum(hi - lo for lo, hi in spans) == len(wanted)
            # own = position + 1, held = position (the reducer's): they wrap at own 0
            assert len(spans) == (2 if own == 0 and n > 2 else 1)
