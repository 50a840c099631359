"""What a node holds of each round: the rounds it has open, and one round's state.

A round's state (:class:`RoundState`) exists from the first message of it that
arrives, so that a peer ahead of this node is buffered, not refused; it holds the
round's :class:`~coordinator_free.rounds.inbox.Inbox`, its pairwise exchanges and
what its agreements settled. :class:`RoundTable` opens the states, refuses rounds
that are over or too far ahead, and closes them when the round ends.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.ring import RingReducer
from coordinator_free.rounds.config import RoundConfig
from coordinator_free.rounds.exchange import PairwiseExchange
from coordinator_free.rounds.inbox import Inbox
from coordinator_free.rounds.results import Counters, RoundProgress

__all__ = ["AgreementRecord", "Counters", "RoundState", "RoundTable", "keep_latest"]


@dataclass
class AgreementRecord:
    """What the agreements of one round settled at this node, and who took part.

    decided: per stage tag, the set (and flag) this node settled on.
    views_sent: the views this node sent, as ``(tag, attempt, peer)``.
    joined: per tag, the starter of the agreement token this node takes part in.
    stalled: the tags whose token this node gave up on (it fell back to the views).
    settled_by: per tag whose token this node started, the members that settled on
        its decision (itself too): what the permit counts.
    completers: per ring attempt's tag, the members known to hold its masked sum.
    """

    decided: dict[str, tuple[frozenset[str], bool]] = field(default_factory=dict)
    views_sent: set[tuple[str, int, str]] = field(default_factory=set)
    joined: dict[str, str] = field(default_factory=dict)
    stalled: set[str] = field(default_factory=set)
    settled_by: dict[str, frozenset[str]] = field(default_factory=dict)
    completers: dict[str, set[str]] = field(default_factory=dict)


@dataclass
class RoundState:
    """One round at this node, as its handlers file it and its stages read it.

    ``started`` is the loop time this node started running the round (``None`` while
    it only buffers the round's messages); ``stage`` and ``stage_since`` (clock time)
    are what :meth:`~coordinator_free.rounds.RoundEngine.progress` reports.
    """

    me: str
    run: str
    round: int
    inbox: Inbox = field(default_factory=Inbox)
    # the round's pairwise exchanges (ready, share, the releases), by inbox key
    exchanges: dict[tuple[str, ...], PairwiseExchange] = field(default_factory=dict)
    # the peers that sent two different messages of one exchange
    equivocal: set[str] = field(default_factory=set)
    agreement: AgreementRecord = field(default_factory=AgreementRecord)
    # the survivors this node released its shares for (once per round)
    released_for: frozenset[str] | None = None
    started: float | None = None
    stage: str = ""
    stage_since: float | None = None

    def gone(self) -> set[str]:
        """The members that said they left this round (it failed for them)."""
        return set(self.inbox.senders(("gone",)))

    def exchange(self, key: tuple[str, ...]) -> PairwiseExchange:
        """The pairwise exchange filed under ``key``, opened on first use."""
        exchange = self.exchanges.get(key)
        if exchange is None:
            exchange = self.exchanges[key] = PairwiseExchange(self, key)
        return exchange


class RoundTable:
    """The rounds this node holds state for, the rounds it runs, and where each run is.

    A round is refused when its run finished it already, when it lies more than
    ``lookahead_rounds`` past the run's last finished round, or when too many rounds
    are open; opening a round opens it on the ring too, and closing closes it there.
    """

    def __init__(self, me: str, config: RoundConfig, ring: RingReducer) -> None:
        self.me = me
        self.config = config
        self.ring = ring
        self._states: dict[tuple[str, int], RoundState] = {}
        self._last_done: dict[str, int] = {}
        self._closed: set[str] = set()
        self.running: set[tuple[str, int]] = set()

    def get(self, run: str, round: int) -> RoundState | None:
        """The state of ``(run, round)`` if this node holds one."""
        return self._states.get((run, round))

    def state(self, run: str, round: int) -> RoundState:
        """The state of ``(run, round)``, created on first contact; refuses wrong rounds."""
        key = (run, round)
        state = self._states.get(key)
        if state is not None:
            return state
        if run in self._closed:
            raise Refused(RefusalReason.STALE, f"run {run!r} is over here")
        last = self._last_done.get(run)
        if last is not None and round <= last:
            raise Refused(RefusalReason.STALE, f"round {round} of {run!r} is over")
        if last is not None and round > last + self.config.lookahead_rounds:
            raise Refused(RefusalReason.STALE, f"round {round} of {run!r} is too far ahead")
        if len(self._states) >= 2 * self.config.lookahead_rounds + 2:
            raise Refused(RefusalReason.STALE, "too many rounds open")
        state = RoundState(self.me, run, round)
        self._states[key] = state
        self.ring.open(run, round)
        return state

    def last_done(self, run: str) -> int | None:
        """The newest round of ``run`` this node finished, if any."""
        return self._last_done.get(run)

    def keep_window(self, run: str, round: int) -> None:
        """Drop the rounds of ``run`` this node will never run once it runs ``round``
        (behind it, or too far ahead of it), so wrong-round traffic cannot hold slots; a
        run closed here (:meth:`close_run`) is open again once this node runs its rounds."""
        self._closed.discard(run)
        for key in [
            k
            for k in self._states
            if k[0] == run and not round <= k[1] <= round + self.config.lookahead_rounds
        ]:
            del self._states[key]
            self.ring.close(*key)

    def finish(self, run: str, round: int) -> None:
        """Close ``round`` of ``run`` and every earlier one: their messages are refused."""
        last = self._last_done.get(run)
        self._last_done[run] = round if last is None else max(last, round)
        for key in [k for k in self._states if k[0] == run and k[1] <= round]:
            del self._states[key]
            self.ring.close(*key)

    def close_run(self, run: str) -> None:
        """``run`` ended here: drop every round held for it (its late messages would hold
        slots that the next run needs) and refuse new ones until :meth:`keep_window`,
        where it starts afresh (a resumed run may be rounds ahead of where it stopped)."""
        self._closed.add(run)
        self._last_done.pop(run, None)
        for key in [k for k in self._states if k[0] == run]:
            del self._states[key]
            self.ring.close(*key)

    def progress(self, run: str) -> RoundProgress | None:
        """The newest round of ``run`` this node runs now, and what it waits for."""
        running = sorted(r for (rn, r) in self.running if rn == run)
        if not running:
            return None
        state = self._states.get((run, running[-1]))
        if state is None or state.stage_since is None:
            return None
        return RoundProgress(
            run, state.round, state.stage, state.stage_since, state.inbox.missing()
        )

    def open_rounds(self) -> list[tuple[str, int]]:
        """The ``(run, round)`` pairs this node holds state for (buffered or running)."""
        return sorted(self._states)


def keep_latest(
    store: dict[tuple[str, int], Any],
    events: dict[tuple[str, int], asyncio.Event],
    run: str,
    round: int,
    value: Any,
) -> None:
    """Keep ``value`` for ``(run, round)``, dropping the other rounds of ``run`` and all
    but the four newest entries, and wake whoever waits for it."""
    for key in [k for k in store if k[0] == run and k[1] != round]:
        del store[key]
        events.pop(key, None)
    store[(run, round)] = value
    events.setdefault((run, round), asyncio.Event()).set()
    while len(store) > 4:
        oldest = next(iter(store))
        del store[oldest]
        events.pop(oldest, None)


def forget_run(
    store: dict[tuple[str, int], Any], events: dict[tuple[str, int], Any], run: str
) -> None:
    """Drop every round of ``run`` from ``store`` and ``events`` (the run ended here)."""
    for key in [k for k in store if k[0] == run]:
        del store[key]
        events.pop(key, None)
