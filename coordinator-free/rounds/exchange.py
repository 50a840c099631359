"""The pairwise exchange: every member's message to every other, one request per pair.

The ready, share and release stages each exchange one message per pair of members
(``docs/ARCHITECTURE.md``, "A round", step 1). A hash of the pair (:func:`initiator`)
says which of the two sends first; the other answers with its own message in the
reply, so a pair costs one request, not two. A member whose own message is not
ready yet when a peer's comes (its previous stage is still open) holds the reply a
little (:meth:`PairwiseExchange.serve`), or, past that, sends its own once it has it
(:meth:`PairwiseExchange.targets`). A member that sends two different messages of
one exchange equivocates: the receiver leaves it out of its views.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable, Iterable, Mapping, Set
from typing import TYPE_CHECKING, Protocol

from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.rounds.inbox import Inbox
from coordinator_free.rounds.results import Counters

if TYPE_CHECKING:
    from coordinator_free.rounds.messenger import Messenger


class RoundView(Protocol):
    """What an exchange reads of its round (a
    :class:`~coordinator_free.rounds.state.RoundState`, which holds the exchanges)."""

    run: str
    round: int
    me: str
    started: float | None
    inbox: Inbox
    equivocal: set[str]


__all__ = ["PairwiseExchange", "Unwrap", "initiator"]

Unwrap = Callable[[str, bytes], bytes | None]
"""What of a peer's reply is its message of the exchange (``None``: nothing to file)."""


def initiator(run: str, round: int, a: str, b: str) -> str:
    """Which of two orgs sends first in their pairwise exchanges of a round (the
    other answers with its own message in the reply): a hash of the pair, so each
    org initiates with about half of the others, and both compute the same."""
    lo, hi = sorted((a, b))
    digest = hashlib.sha256(
        b"fedweave/pair\0%s\0%d\0%s\0%s" % (run.encode(), round, lo.encode(), hi.encode())
    ).digest()
    return lo if digest[0] & 1 else hi


def whole(peer: str, data: bytes) -> bytes | None:
    """A reply that is the peer's message as it is."""
    return data


class PairwiseExchange:
    """One pairwise exchange of a round, filed in the round's inbox under ``key``.

    The handler side files a peer's message and answers it (:meth:`serve`); the stage
    side offers this node's own message (:meth:`offer`) and sends it to the peers
    that still need a request from it (:meth:`targets`, :meth:`send`).
    """

    def __init__(self, state: RoundView, key: tuple[str, ...]) -> None:
        self.state = state
        self.key = key
        # this node's own message (one for every peer, or one per peer), once it has it
        self.own: bytes | Mapping[str, bytes] | None = None
        self.served: set[str] = set()  # the peers answered with it
        self.deferred: set[str] = set()  # the peers whose reply waits for it
        self._offered = asyncio.Event()

    # -- the handler side ---------------------------------------------------------------

    def heard(self) -> Set[str]:
        """The peers whose message of this exchange is filed (a live view)."""
        return self.state.inbox.senders(self.key)

    def file(self, sender: str, payload: bytes) -> bool:
        """File ``payload`` (a request's or a reply's); ``False`` when ``sender``
        already sent another one: it equivocates, and stays out of this node's views."""
        inbox = self.state.inbox
        if inbox.put(self.key, sender, payload) or inbox.item(self.key, sender) == payload:
            return True
        self.state.equivocal.add(sender)
        return False

    async def serve(
        self, sender: str, payload: bytes, what: str, *, defer_s: float | None = None
    ) -> bytes:
        """File a peer's message and reply with this node's own for it. The same
        message again (a retry whose first reply was lost) is taken, a different one
        refused. With ``defer_s``, a node that runs the round but has no message yet
        holds the reply up to that long for it, rather than reply empty and cost a
        request of its own later."""
        if not self.file(sender, payload):
            raise Refused(RefusalReason.REPLAY, f"a second, different {what} for this round")
        if defer_s is not None:
            await self._await_own(sender, defer_s)
        return self.answer(sender)

    async def _await_own(self, sender: str, timeout: float) -> None:
        if self.own is not None or self.state.started is None:
            return
        self.deferred.add(sender)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._offered.wait(), timeout)
        finally:
            self.deferred.discard(sender)

    def answer(self, peer: str) -> bytes:
        """The reply to ``peer``'s message: this node's own message for ``peer`` when it
        has one (``peer`` is then served), else nothing (this node sends its own once
        it has it, see :meth:`targets`)."""
        if self.own is None:
            return b""
        data = self.own if isinstance(self.own, bytes) else self.own.get(peer)
        if data is None:
            return b""
        self.served.add(peer)
        return data

    # -- the stage side -----------------------------------------------------------------

    def offer(self, own: bytes | Mapping[str, bytes]) -> None:
        """This node's own message (one for all, or per peer): held replies go out."""
        self.own = own
        self._offered.set()

    def targets(self, peers: Iterable[str]) -> list[str]:
        """The peers this node sends its message to: those it initiates with
        (:func:`initiator`), and those whose message came before this node had its own
        to answer with; never one already answered with it, or one whose reply waits
        for it."""
        state, me = self.state, self.state.me
        heard = self.heard()
        return sorted(
            p
            for p in peers
            if p != me
            and p not in self.served
            and p not in self.deferred
            and (p in heard or initiator(state.run, state.round, me, p) == me)
        )

    async def send(
        self,
        net: Messenger,
        counters: Counters,
        peers: Iterable[str],
        kind: str,
        stage: str,
        payload: bytes | Mapping[str, bytes] | None = None,
        *,
        unwrap: Unwrap | None = whole,
        on_refused: Callable[[str, Refused], None] | None = None,
    ) -> set[str]:
        """Send this node's message (or ``payload``) to ``peers``; each reply that
        ``unwrap`` makes a message is filed as that peer's, each refusal goes to
        ``on_refused``. Returns the peers that failed to take it."""
        state = self.state
        message = self.own if payload is None else payload
        assert message is not None, "offer the message before sending it"

        def take(peer: str, data: bytes) -> None:
            filed = unwrap(peer, data) if unwrap is not None else None
            if filed is not None and self.file(peer, filed):
                net.arrival(state.run, state.round, stage, peer, len(data), started=state.started)

        return await net.broadcast(
            counters,
            sorted(peers),
            kind,
            message,
            run=state.run,
            round=state.round,
            stage=stage,
            on_reply=take if unwrap is not None else None,
            on_refused=on_refused,
        )
