"""``U1`` while the ring runs before it is settled (``RoundConfig.ring_first``).

``docs/ARCHITECTURE.md``, "A round", step 1. Where ``U1`` goes by the token, a node
whose proposal holds every member settles its session on them, masks and starts its
ring at once (:mod:`~coordinator_free.rounds.share`), and leaves ``U1`` pending
(:class:`PendingU1`). It joins the agreement only when it must:

* another member runs it: a token, a probe or a view of ``ready`` reaches this node
  (a member whose proposal is smaller runs the token at once, and its first probe
  asks the token's starter); or
* its own ring broke, or a share that came does not open (:meth:`PendingU1.start`).

A ring that completes first settles ``U1`` as every member
(:meth:`PendingU1.settle_by_ring`): it completes only when every member sent its
chunks of that very ring, whose id binds the members, so every member masked with
every member. Such a member then answers any token or probe of ``ready`` with
``completed``, and the token's decision is every member
(:func:`~coordinator_free.rounds.wire.decisive`), as a completed ring decides the
outcome of a ring attempt. A steady federation thus sends no message for ``U1``; a
smaller decision makes the reduce stage drop the ring and run it again over the
decided set (:mod:`~coordinator_free.rounds.reduce`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from coordinator_free.rounds.agreement import Agreement
from coordinator_free.rounds.messenger import retrieved
from coordinator_free.rounds.state import Counters, RoundState

__all__ = ["TRIGGERS", "PendingU1"]

TRIGGERS = (
    ("token", "ready", "collect"),
    ("token", "ready", "decide"),
    ("token", "ready", "probe"),
    ("view", "ready", "0"),
)
"""The inbox keys whose first message means another member runs the agreement on ``U1``."""

_FOREVER_S = 1e9
"""A watch on the inbox ends with the round (its task is cancelled), not by a deadline."""


class PendingU1:
    """``U1`` not yet settled, for a node whose ring over every member has started."""

    def __init__(
        self,
        agreement: Agreement,
        state: RoundState,
        counters: Counters,
        base: Sequence[str],
        members: frozenset[str],
    ) -> None:
        self.agreement = agreement
        self.state = state
        self.counters = counters
        self.base = tuple(base)
        self.members = members
        self.started = asyncio.Event()
        """Set once this node joins the agreement: from then on its decision decides."""
        self.decision: asyncio.Future[frozenset[str]] | None = None
        self._watch = asyncio.ensure_future(self._watch_inbox())
        self._watch.add_done_callback(retrieved)

    def _triggered(self) -> bool:
        return any(self.state.inbox.senders(key) for key in TRIGGERS)

    async def _watch_inbox(self) -> None:
        loop = asyncio.get_running_loop()
        await self.state.inbox.wait_any(TRIGGERS, self._triggered, loop.time() + _FOREVER_S)
        self.start()

    def start(self, without: frozenset[str] = frozenset()) -> asyncio.Future[frozenset[str]]:
        """Join the agreement on ``U1`` now (once; later calls return the same
        decision), proposing every member less ``without`` (members whose shares came
        but do not open)."""
        if self.decision is None:
            if asyncio.current_task() is not self._watch:
                self._watch.cancel()
            self.decision = asyncio.ensure_future(self._settle(self.members - without))
            self.decision.add_done_callback(retrieved)
            self.started.set()
        return self.decision

    async def _settle(self, proposal: frozenset[str]) -> frozenset[str]:
        members, _ = await self.agreement.settle(
            self.state, self.counters, "ready", self.base, proposal, False
        )
        return members

    def settle_by_ring(self) -> bool:
        """This node's ring over every member completed: ``U1`` is every member, unless
        the node joined the agreement already (``False``: its decision decides). A
        token of ``ready`` that reached it meanwhile goes on with its completed entry."""
        if self.decision is not None:
            return False
        self._watch.cancel()
        self.agreement.settled(self.state, "ready", self.members, True)
        self.agreement.net.spawn(self.agreement.pass_on_held(self.state, "ready", self.members))
        return True

    def cancel(self) -> None:
        """The round ended: stop watching, and leave the agreement."""
        self._watch.cancel()
        if self.decision is not None:
            self.decision.cancel()
