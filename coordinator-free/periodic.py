"""A loop that runs one step every period until it is stopped (SWIM's probes, gossip's
push rounds).

:func:`run_periodically` starts a step at the beginning of each period, so a slow step
shortens the sleep after it rather than shifting every later period. A step that
raises is logged and the loop goes on (one failed period must not stop failure
detection or the broadcast); a cancellation is passed on. Between steps the loop waits
on the caller's ``stopping`` event with a timeout instead of sleeping: a cancellation
can be lost in ``asyncio.wait_for`` on Python 3.11, and the event cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

__all__ = ["run_periodically", "sleep_unless_stopped"]


async def run_periodically(
    step: Callable[[float], Awaitable[object]],
    period_s: Callable[[], float],
    stopping: asyncio.Event,
    *,
    logger: logging.Logger,
    describe: Callable[[], str],
) -> None:
    """Await ``step(started)`` once a period until ``stopping`` is set.

    ``started`` is the loop time at which the period began. ``period_s`` is read
    after each step (a new config applies from the next period). When a step raises,
    ``logger`` records it with the traceback as ``"<describe()> failed"``.
    """
    loop = asyncio.get_running_loop()
    while not stopping.is_set():
        started = loop.time()
        try:
            await step(started)
        except asyncio.CancelledError:
            raise
        except Exception:  # one failed period must not stop the loop
            logger.exception("%s failed", describe())
        await sleep_unless_stopped(stopping, period_s() - (loop.time() - started))


async def sleep_unless_stopped(stopping: asyncio.Event, seconds: float) -> None:
    """Sleep ``seconds``, or until ``stopping`` is set; with no time left, only yield
    to the other tasks once."""
    if seconds <= 0:
        await asyncio.sleep(0)
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stopping.wait()
