"""What a node holds of each round: the rounds it has open, and one round's state.

A round's state (:class:`RoundState`) exists from the first message of it that
arrives, so that a peer ahead of this node is buffered, not refused; it holds the
round's :class:`~coordinator_free.rounds.inbox.Inbox`, its pairwise exchanges and
what its agreements settled. :class:`RoundTable` opens the states, refuses rounds
that are over or too far ahead, and closes them when the round ends.

A peer opens a round only of a run the node admits (the :data:`Admission` callable
the node gives: the run's participants when this org accepted it) and only when it
is among that run's participants (``Refused(NOT_ADMITTED)``); each member may hold at
most :meth:`RoundTable.member_quota` rounds open that this node does not run yet
(``Refused(QUOTA)``), so no member can take the slots of another org's rounds.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.ring import RingReducer, ring_order
from coordinator_free.rounds.config import RoundConfig
from coordinator_free.rounds.exchange import PairwiseExchange
from coordinator_free.rounds.inbox import Inbox, InboxLimits
from coordinator_free.rounds.results import Counters, RoundProgress

__all__ = ["Admission", "AgreementRecord", "Counters", "RoundState", "RoundTable", "keep_latest"]

Admission = Callable[[str], Collection[str] | None]
"""``admit(run)``: the participants of ``run`` when this org takes part in it, else
``None`` (a run this org never accepted, or one that is over)."""


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
    # the ring orders of this round's member sets, each made once (see ring_order)
    orders: dict[frozenset[str], tuple[str, ...]] = field(default_factory=dict)

    def ring_order(self, members: Iterable[str]) -> list[str]:
        """:func:`~coordinator_free.ring.ring_order` of ``members`` in this round. A
        round's stages ask for the order of the same set several times (the relayed
        readies, the masks, the ring, the agreements, the seeds): it is made once per
        set, a hash of every member and a sort."""
        key = frozenset(members)
        order = self.orders.get(key)
        if order is None:
            order = self.orders[key] = tuple(ring_order(key, self.round))
        return list(order)

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

    A round is refused when its run finished it already, or when it lies more than
    ``lookahead_rounds`` past the run's last finished round (a node that moves on to a
    later round moves this window along: :meth:`advance`); a peer's message is refused
    too when its run is not admitted or it is no participant, and a round it would open
    when it holds its quota (see the module docstring). Opening a round opens it on the
    ring too, and closing closes it there.
    """

    def __init__(
        self,
        me: str,
        config: RoundConfig,
        ring: RingReducer,
        admit: Admission | None = None,
        limits: InboxLimits | None = None,
    ) -> None:
        self.me = me
        self.config = config
        self.ring = ring
        self.admit = admit
        self.limits = limits or InboxLimits()
        self._states: dict[tuple[str, int], RoundState] = {}
        self._opened_by: dict[tuple[str, int], str] = {}
        self._last_done: dict[str, int] = {}
        self._closed: set[str] = set()
        self.running: set[tuple[str, int]] = set()

    def member_quota(self) -> int:
        """How many rounds one member may hold open here that this node does not run."""
        return self.config.open_rounds_limit()

    def get(self, run: str, round: int) -> RoundState | None:
        """The state of ``(run, round)`` if this node holds one."""
        return self._states.get((run, round))

    def state(self, run: str, round: int, sender: str | None = None) -> RoundState:
        """The state of ``(run, round)``, created on first contact; refuses wrong rounds.

        ``sender``: the peer whose message this is (``None``: this node runs the
        round): it must be a participant of a run the node admits, and it may open
        only :meth:`member_quota` rounds this node does not run.
        """
        if sender is not None:
            self._check_admitted(run, sender)
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
        if sender is not None:
            self._check_quota(sender)
            self._opened_by[key] = sender
        state = RoundState(self.me, run, round, inbox=Inbox(self.me, self.limits))
        self._states[key] = state
        self.ring.open(run, round)
        return state

    def _check_admitted(self, run: str, sender: str) -> None:
        """Refuse a message of a run this node does not admit, or from a non-participant."""
        if self.admit is None:
            return
        participants = self.admit(run)
        if participants is None:
            raise Refused(RefusalReason.NOT_ADMITTED, f"run {run!r} is not accepted here")
        if sender not in participants:
            raise Refused(
                RefusalReason.NOT_ADMITTED, f"{sender!r} is not a participant of run {run!r}"
            )

    def _check_quota(self, sender: str) -> None:
        """Drop the rounds of runs no longer admitted, then refuse ``sender`` when it
        holds its quota of rounds this node does not run."""
        if self.admit is not None:
            for key in [
                k for k in self._states if k not in self.running and self.admit(k[0]) is None
            ]:
                self._drop(key)
        held = Counter(
            self._opened_by[k]
            for k, s in self._states.items()
            if s.started is None and k in self._opened_by
        )
        if held[sender] >= self.member_quota():
            raise Refused(
                RefusalReason.QUOTA,
                f"{sender!r} holds {held[sender]} rounds open here that this node does not run",
            )

    def _drop(self, key: tuple[str, int]) -> None:
        del self._states[key]
        self._opened_by.pop(key, None)
        self.ring.close(*key)

    def last_done(self, run: str) -> int | None:
        """The newest round of ``run`` this node finished, if any."""
        return self._last_done.get(run)

    def advance(self, run: str, round: int) -> None:
        """This node runs ``round`` of ``run`` now: every earlier round is over here.

        A node that fell behind (a restart, a long outage, a catch-up to the
        federation's model) starts a round far past the last one it finished; the
        window of rounds it buffers and runs moves with it, so its own round is never
        "too far ahead" of a round it will not run again."""
        last = self._last_done.get(run)
        if last is None or last < round - 1:
            self._last_done[run] = round - 1

    def later_ready(self, run: str, after: int, until: int) -> int | None:
        """The newest round ``after < r < until`` of ``run`` this node only buffers (it
        does not run it) that holds a ``ready`` from a peer still in it (no ``leave``
        from that peer): where the others are, when these rounds are attempts of one
        training round."""
        best: int | None = None
        for (rn, r), state in self._states.items():
            if rn != run or not after < r < until or (rn, r) in self.running:
                continue
            # ("ready",): the ready stage's inbox key (see ready.READY)
            if set(state.inbox.senders(("ready",))) - state.gone() - {self.me}:
                best = r if best is None else max(best, r)
        return best

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
            self._drop(key)

    def finish(self, run: str, round: int) -> None:
        """Close ``round`` of ``run`` and every earlier one: their messages are refused."""
        last = self._last_done.get(run)
        self._last_done[run] = round if last is None else max(last, round)
        for key in [k for k in self._states if k[0] == run and k[1] <= round]:
            self._drop(key)

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
