"""The round engine's heavy computation, masking and unmasking a vector, runs off its
event loop; the secrets stay on it."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from coordinator_free.sim import SimConfig, Simulation

from secure_agg import prg


def test_the_round_engine_expands_masks_off_its_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Masking and unmasking a vector are the round's heavy computation: they run in a
    worker thread (the loop goes on serving messages), only the secrets on the loop."""
    length = 20_000
    threads: list[tuple[int, bool]] = []
    real = prg.add_masks

    def recorded(target: np.ndarray, masks: list[tuple[bytes, int]], **kw: object) -> None:
        if masks:
            threads.append((target.shape[0], threading.current_thread() is main))
        real(target, masks, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(prg, "add_masks", recorded)
    main = threading.current_thread()

    async def scenario() -> None:
        async with Simulation(SimConfig(peers=4, length=length, seed=3)) as sim:
            outcome = await sim.round(1)
            assert not outcome.problems() and len(outcome.results) == 4

    asyncio.run(scenario())
    vector_sized = [on_loop for size, on_loop in threads if size >= length // 4]
    assert len(vector_sized) >= 8  # each of 4 peers masks, and unmasks
    assert not any(vector_sized)


def test_owner_unmasking_hands_the_caller_its_own_sum_copied_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With owner unmasking, a ring-array sum decodes to the vector whose chunks the node
    keeps serving: the caller's copy of it (a vector-sized copy) is made in a worker
    thread, and it is not the kept array."""
    from coordinator_free.rounds import unmask

    peers, length = 8, 20_000  # owner unmasking from 8 members, chunks of >= 1024
    calls: list[tuple[bool, bool]] = []
    real = unmask.decoded_copy

    def recorded(decode: object, acc: np.ndarray) -> np.ndarray:
        out = real(decode, acc)  # type: ignore[arg-type]
        calls.append((threading.current_thread() is main, out is acc))
        return out

    monkeypatch.setattr(unmask, "decoded_copy", recorded)
    main = threading.current_thread()

    async def scenario() -> None:
        async with Simulation(SimConfig(peers=peers, length=length, seed=5)) as sim:
            outcome = await sim.round(1)
            assert not outcome.problems() and len(outcome.results) == peers
            expected = np.sum([v.astype(np.uint64) for v in outcome.inputs.values()], axis=0)
            for result in outcome.results.values():
                assert np.array_equal(result.sum, expected.astype(result.sum.dtype))

    asyncio.run(scenario())
    assert len(calls) == peers
    assert not any(on_loop for on_loop, _ in calls)
    assert not any(same for _, same in calls)
