"""The agreement token: a stage's agreement in ``2 n`` messages instead of ``n (n - 1)``.

``docs/ARCHITECTURE.md``, "A round", step 1. Where every member runs an agreement (the
outcome of a ring that broke; ``U1`` under SecAgg+; the reduce-scatter with owner
unmasking), one token (``round.token``) passed along the ring of a set every member
shares collects each member's proposal, and its starter decides the intersection for
all (:class:`TokenAgreement`). A token that stalls falls back to the views of
:class:`~coordinator_free.rounds.agreement.Agreement`, whose handlers file the tokens
this module waits for.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable
from typing import Protocol

from coordinator_free.errors import PeerUnreachable, RefusalReason, Refused, TransportError
from coordinator_free.rounds.config import RoundConfig
from coordinator_free.rounds.messenger import Messenger
from coordinator_free.rounds.results import RoundFailed
from coordinator_free.rounds.state import Counters, RoundState
from coordinator_free.rounds.wire import (
    COMPLETED,
    KIND_TOKEN,
    SETTLED,
    TOKEN_COLLECT,
    TOKEN_DECIDE,
    TOKEN_PROBE,
    Token,
    decisive,
    view_hash,
)

__all__ = ["Settled", "Settling", "TokenAgreement", "pass_token", "send_token"]

Settled = tuple[frozenset[str], bool]
"""What an agreement settles: the members and the flag."""


class Settling(Protocol):
    """What the token needs of the view agreement it falls back to (a
    :class:`~coordinator_free.rounds.agreement.Agreement`, which runs the token)."""

    net: Messenger
    config: RoundConfig

    @property
    def me(self) -> str: ...

    def settled(self, state: RoundState, tag: str, members: frozenset[str], ok: bool) -> None: ...

    def settle_held(
        self, state: RoundState, tag: str, members: frozenset[str], holders: Iterable[str]
    ) -> Settled: ...


async def send_token(
    net: Messenger, state: RoundState, counters: Counters, tag: str, peer: str, token: Token
) -> str:
    """Hand ``token`` to ``peer``: ``ok``; ``stop`` (it holds this token already);
    ``skip`` (it made no proposal); ``settled`` (it settles on this decision);
    ``completed`` (its ring attempt completed)."""
    if peer in state.gone():
        return "skip"
    try:
        reply = await net.send(
            counters,
            peer,
            KIND_TOKEN,
            token.to_bytes(),
            run=state.run,
            round=state.round,
            stage=tag,
        )
    except Refused as exc:
        return "stop" if exc.reason is RefusalReason.REPLAY else "skip"
    except TransportError as exc:
        net.observe("unreachable", state.run, state.round, tag, peer=peer, detail=str(exc))
        return "skip"
    if reply == SETTLED:
        return "settled"
    return "completed" if reply == COMPLETED and decisive(tag) else "ok"


async def pass_token(
    net: Messenger,
    state: RoundState,
    counters: Counters,
    tag: str,
    order: list[str],
    pos: int,
    token: Token,
) -> tuple[Token, str]:
    """Pass a collecting token on to the first member after ``pos`` in ``order``
    that takes it; a member whose ring completed answers at once, and its proposal
    (every member of the attempt, completed) goes into the token on its behalf.
    Returns the token as last sent and ``"passed"``, or ``"end"`` when no member
    after ``pos`` took it (it goes back to its starter)."""
    for q in range(pos + 1, len(order)):
        outcome = await send_token(net, state, counters, tag, order[q], token)
        if outcome == "completed":
            entry = (order[q], frozenset(order), True)
            token = Token(token.phase, tag, token.base, token.starter, (*token.entries, entry))
        elif outcome != "skip":
            return token, "passed"
    return token, "end"


class TokenAgreement:
    """This node's part in agreeing on ``(members, flag)`` by one token.

    ``order`` (the ring of a set every node shares: the federation's members, or the
    set the previous stage settled) is the same on every node; each member proposes a
    subset. The token starts at the first member of ``order`` that runs the round,
    collects every member's proposal in ring order (a member that is dead, not
    running the round or already settled refuses or cannot be reached, and is
    skipped: it made no proposal), and returns to its starter, which alone decides:
    the intersection of the proposals and the AND of the flags, and sends the
    decision, with the proposals, to every member that made one. Every node that
    settles thus holds the very same collected proposals, so none can settle on a set
    another settles differently: ``2 n`` messages in all (``n`` of them one after
    another) where the view agreement sends ``n (n - 1)`` per attempt.

    :meth:`run` returns ``None`` — fall back to the view agreement, whose views every
    node settled here answers with its settled set — when the token stalls: a view of
    this stage arrives (someone fell back already), the starter is unreachable, or the
    stage times out. A member that skipped nobody still proposes itself, so one left
    out of the decision fails the round rather than summing apart.
    """

    def __init__(
        self,
        agreement: Settling,
        state: RoundState,
        counters: Counters,
        tag: str,
        order: list[str],
        proposal: frozenset[str],
        flag: bool,
    ) -> None:
        self.agreement = agreement
        self.state = state
        self.counters = counters
        self.tag = tag
        self.order = order
        self.flag = flag
        self.me = agreement.me
        self.pos = order.index(self.me)
        self.mine = (self.me, proposal, flag)
        self.base = view_hash(f"{tag}/token", order)
        self.loop = asyncio.get_running_loop()
        self.end = self.loop.time() + agreement.config.stage_timeout
        self.view_key = ("view", tag, "0")
        # a member before this one found holding the completed sum of the attempt
        self.holder: list[str] = []

    async def run(self) -> Settled | None:
        token = await self._join()
        if not isinstance(token, Token):
            return token
        decided = await self._circulate(token)
        if not isinstance(decided, Token) or decided.base != self.base:
            return None
        if decided.starter != self.state.agreement.joined.get(self.tag):
            return None
        return await self._settle_on(decided)

    async def _join(self) -> Token | Settled | None:
        """Pass 1 begins: the token this node passes on with its proposal (as the
        starter, or as it came), the settled outcome when a member before this one
        completed its ring, or ``None`` when the token stalled."""
        if self.pos == 0:
            got: Token | str = "start"
        else:
            got = await self._wait(("token", self.tag, "collect"), take_over=True)
        if got == "stall":
            return None
        if got == "completed":
            return self.agreement.settle_held(
                self.state, self.tag, frozenset(self.order), self.holder
            )
        if isinstance(got, Token):
            if got.base != self.base or got.phase != TOKEN_COLLECT:
                return None
            return Token(TOKEN_COLLECT, self.tag, self.base, got.starter, (*got.entries, self.mine))
        self.state.agreement.joined[self.tag] = self.me
        return Token(TOKEN_COLLECT, self.tag, self.base, self.me, (self.mine,))

    async def _circulate(self, token: Token) -> Token | str:
        """Pass the token on and wait for the decision: the token as it came back to
        this node as its starter, or the starter's decision."""
        token, outcome = await pass_token(
            self.agreement.net, self.state, self.counters, self.tag, self.order, self.pos, token
        )
        if outcome == "end":
            if token.starter == self.me:
                return token
            # back to the starter ("stop": another path brought it back already)
            if await self._send(token.starter, token) == "skip":
                return "stall"
            return await self._wait(("token", self.tag, "decide"), take_over=False)
        if token.starter == self.me:
            return await self._wait(("token", self.tag, "return"), take_over=False)
        return await self._wait(("token", self.tag, "decide"), take_over=False)

    async def _settle_on(self, decided: Token) -> Settled:
        """The decision: every member that proposed settles on it; the starter sends it
        to every member that proposed, and counts those that settle on it."""
        tag, me, record = self.tag, self.me, self.state.agreement
        members, ok = decided.decision()
        if decisive(tag) and ok:
            record.completers[tag] = {org for org, _, f in decided.entries if f}
        self.agreement.settled(self.state, tag, members, ok)
        if decided.starter == me:
            # the decision goes to every member that proposed at once (one hop, not a
            # second pass round the ring: the others settle together); a member whose
            # ring completed settled on its own
            final = Token(TOKEN_DECIDE, tag, self.base, me, decided.entries)
            told = [org for org, _, f in final.entries if org != me and not (f and decisive(tag))]
            outcomes = await asyncio.gather(*(self._send(org, final) for org in told))
            record.settled_by[tag] = frozenset(
                [me, *(org for org, got in zip(told, outcomes, strict=True) if got == "settled")]
            )
        if me not in members:
            raise RoundFailed(tag, "the other participants' proposals leave this node out")
        return members, ok

    async def _send(self, peer: str, token: Token) -> str:
        return await send_token(
            self.agreement.net, self.state, self.counters, self.tag, peer, token
        )

    async def _absent(self, peer: str) -> bool:
        """Whether ``peer`` is dead, gone or not running the round (so no token will
        come from it); one whose ring completed is noted in ``holder``."""
        state = self.state
        if peer in state.gone():
            return True
        try:
            reply = await self.agreement.net.send(
                self.counters,
                peer,
                KIND_TOKEN,
                Token(TOKEN_PROBE, self.tag, self.base, self.me).to_bytes(),
                run=state.run,
                round=state.round,
                stage=self.tag,
                timeout=self.agreement.config.step_timeout,
            )
        except (Refused, PeerUnreachable):
            return True
        except TransportError:
            return False  # alive, just slow
        if reply == COMPLETED and decisive(self.tag):
            self.holder.append(peer)
        return False

    def _arrived(self, key: tuple[str, ...]) -> bool:
        inbox = self.state.inbox
        return bool(inbox.senders(key) or inbox.senders(self.view_key))

    async def _wait(self, key: tuple[str, ...], take_over: bool) -> Token | str:
        """The token filed under ``key``; ``"start"`` when every member before this one
        is absent (``take_over``); ``"completed"`` when a member before this one holds
        the completed sum; ``"stall"`` otherwise."""
        inbox, loop = self.state.inbox, self.loop
        if take_over and decisive(self.tag) and not self.flag and not inbox.senders(key):
            # the would-be starter may have completed its ring, and then starts no
            # token: ask it at once rather than after a silence (for U1 the question
            # also wakes a starter that runs its ring with U1 pending, rounds.early)
            await self._absent(self.order[0])
            if self.holder:
                return "completed"
        while True:
            await inbox.wait_any(
                [key, self.view_key],
                functools.partial(self._arrived, key),
                min(self.end, loop.time() + self.agreement.config.step_timeout),
            )
            box = inbox.get(key)
            if box:
                try:
                    return Token.from_bytes(box[""])
                except ValueError:
                    return "stall"
            if inbox.senders(self.view_key) or loop.time() >= self.end:
                return "stall"
            if take_over and self.state.agreement.joined.get(self.tag) is None:
                taken = await self._take_over(key)
                if taken is not None:
                    return taken

    async def _take_over(self, key: tuple[str, ...]) -> str | None:
        """After a long silence: ``"start"`` when no member before this one still runs
        the round, ``"completed"`` when one holds the completed sum, else ``None``."""
        for q in range(self.pos - 1, -1, -1):
            if not await self._absent(self.order[q]):
                break
        else:
            if not self.state.inbox.senders(key):
                return "start"
        if self.holder:
            return "completed"
        return None
