"""A round that finds no quorum: how long it waits, its backoff, and whom it misses.

A training round's secure sum needs ``t`` ready participants. When an attempt finds
fewer (members down, restarting, being recovered), the run engine
(:meth:`org_node.engine.RunEngine._aggregate`) does not fail the run: it tries again
under the next protocol round (``r * ATTEMPTS + a``) after a backoff that starts at
``engine.quorum_backoff_s`` and doubles up to ``engine.quorum_backoff_max_s``, and it
joins at once a later attempt a peer already runs (attempt alignment). The run fails
only when the round has waited the run spec's ``quorum_wait_s`` (or has used every
attempt the protocol numbering reserves for one round). :class:`QuorumWait` is what
the engine's activity shows of such a wait: ``fedweave runs show``, the dashboard, and
the round's report (``quorum_wait_s`` among its metrics).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["QuorumWait", "back_off", "backoff_s"]


def backoff_s(failures: int, base_s: float, cap_s: float) -> float:
    """Seconds before the next attempt after ``failures`` (>= 1) failed ones: ``base_s``
    doubling each time, never more than ``cap_s``."""
    if failures < 1:
        return 0.0
    return float(min(cap_s, base_s * 2.0 ** min(failures - 1, 60)))


@dataclass
class QuorumWait:
    """A round (1-based ``round``) waiting for a quorum: since when (clock time, the
    start of its first attempt), how many attempts failed, the attempt it runs or runs
    next (1-based), the members it missed last, why the last attempt failed, and when
    it tries next (clock time; None while an attempt runs)."""

    round: int
    since: float
    threshold: int
    failures: int = 0
    attempt: int = 1
    missing: tuple[str, ...] = ()
    reason: str = ""
    next_at: float | None = None

    def waited(self, now: float) -> float:
        """Seconds this round has waited so far."""
        return max(0.0, now - self.since)


async def back_off(
    wait: QuorumWait, clock: Callable[[], float], later: Callable[[], int | None]
) -> int | None:
    """Sleep until ``wait.next_at`` (clock time), unless ``later()`` finds an attempt
    that peers already run first: that one is returned (None after a full backoff).
    ``wait.next_at`` is None again afterwards (an attempt runs)."""
    found = None
    while wait.next_at is not None and clock() < wait.next_at:
        found = later()
        if found is not None:
            break
        await asyncio.sleep(min(0.05, max(0.0, wait.next_at - clock())))
    wait.next_at = None
    return found
