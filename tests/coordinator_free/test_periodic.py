"""The periodic loop: one step a period, a failing step logged without stopping the
loop, and a prompt end when the stopping event is set (no wall-clock bound asserted)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from coordinator_free.periodic import run_periodically, sleep_unless_stopped

log = logging.getLogger("tests.periodic")


def test_steps_run_until_stopped_and_a_failed_step_does_not_end_the_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> list[int]:
        stopping = asyncio.Event()
        steps: list[int] = []

        async def step(started: float) -> None:
            steps.append(len(steps) + 1)
            if len(steps) == 2:
                raise RuntimeError("boom")
            if len(steps) == 4:
                stopping.set()

        await asyncio.wait_for(
            run_periodically(
                step, lambda: 0.001, stopping, logger=log, describe=lambda: f"step {len(steps)}"
            ),
            timeout=60,
        )
        return steps

    with caplog.at_level(logging.ERROR, logger="tests.periodic"):
        assert asyncio.run(main()) == [1, 2, 3, 4]
    assert [r.getMessage() for r in caplog.records] == ["step 2 failed"]
    assert caplog.records[0].exc_info is not None


def test_a_long_period_ends_as_soon_as_the_event_is_set() -> None:
    async def main() -> None:
        stopping = asyncio.Event()
        sleeping = asyncio.create_task(sleep_unless_stopped(stopping, 3600))
        await asyncio.sleep(0)
        stopping.set()
        await asyncio.wait_for(sleeping, timeout=60)

    asyncio.run(main())


def test_a_cancelled_loop_is_cancelled() -> None:
    async def main() -> None:
        started = asyncio.Event()

        async def step(_: float) -> None:
            started.set()
            await asyncio.sleep(3600)

        loop = asyncio.create_task(
            run_periodically(step, lambda: 1.0, asyncio.Event(), logger=log, describe=str)
        )
        await started.wait()
        loop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loop

    asyncio.run(main())
