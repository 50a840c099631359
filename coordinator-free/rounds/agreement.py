"""The agreement: how the members settle a set that every one of them must share.

Every decision that must be shared (who takes part, who dropped, whether a ring
attempt completed) is made by **view agreement**: each node sends the others its view
(the sorted set, a flag and their SHA-256, inside its Ed25519-signed envelope,
``round.view``); when every view it receives equals its own, the set is settled;
otherwise it retries with the intersection of the views it got, up to
``max_view_attempts`` times, and a view that still differs fails the round — a split
view is retried, never silently summed. A node that settled answers later views of
the same stage with its settled one, so a peer that heard less can converge.

That exchange costs ``n (n - 1)`` messages per attempt; where every node runs the
agreement (the outcome of a ring that broke, and ``U1`` under SecAgg+) it first runs
as a **token** (``round.token``): passed once along the ring of a set every node
shares, it collects each member's proposal and returns to its starter, which decides
the intersection for all and sends it with the proposals to every member, ``2 n``
messages (:mod:`~coordinator_free.rounds.token`); a token that stalls falls back to
the exchange above. The starter counts the members that settled on its decision
(:attr:`~coordinator_free.rounds.state.AgreementRecord.settled_by`): the permit of the
unmask stage rests on that count.

For a ring attempt's outcome (``reduce:N``) one member whose ring completed decides
alone (:func:`~coordinator_free.rounds.wire.decisive`): it holds the masked sum of
every member, and answers any token or probe of the attempt with ``completed``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.rounds.config import RoundConfig
from coordinator_free.rounds.messenger import Messenger
from coordinator_free.rounds.results import RoundFailed
from coordinator_free.rounds.state import Counters, RoundState, RoundTable
from coordinator_free.rounds.token import Settled, TokenAgreement, pass_token, send_token
from coordinator_free.rounds.wire import (
    COMPLETED,
    KIND_VIEW,
    SETTLED,
    TOKEN_COLLECT,
    TOKEN_PROBE,
    Token,
    View,
    decisive,
    decode_view,
    known_tag,
    view_hash,
)
from coordinator_free.wire import Envelope

__all__ = ["Agreement"]

logger = logging.getLogger(__name__)


class Agreement:
    """The agreements of this node's rounds: their handlers and the ways to settle."""

    def __init__(self, net: Messenger, table: RoundTable, config: RoundConfig) -> None:
        self.net = net
        self.table = table
        self.config = config

    @property
    def me(self) -> str:
        return self.net.org_id

    # -- handlers -----------------------------------------------------------------------

    async def on_view(self, env: Envelope) -> bytes:
        """A peer's view of a stage: filed for its agreement, and answered with this
        node's settled view when it settled the stage already."""
        state = self.table.state(env.run, env.round, env.sender)
        try:
            view = decode_view(env.payload)
        except ValueError as exc:
            raise Refused(RefusalReason.MALFORMED, str(exc)) from None
        if not known_tag(view.tag, self.config) or view.attempt >= self.config.max_view_attempts:
            raise Refused(RefusalReason.MALFORMED, f"unknown view {view.tag!r}/{view.attempt}")
        if not state.inbox.put(("view", view.tag, str(view.attempt)), env.sender, env.payload):
            raise Refused(RefusalReason.REPLAY, "second view for this stage")
        self.answer_view(state, view.tag, view.attempt, env.sender)
        return b""

    async def on_token(self, env: Envelope) -> bytes:
        """A token of a stage's agreement: a probe, the collecting token, the decision."""
        state = self.table.state(env.run, env.round, env.sender)
        try:
            token = Token.from_bytes(env.payload)
        except ValueError as exc:
            raise Refused(RefusalReason.MALFORMED, str(exc)) from None
        if not known_tag(token.tag, self.config):
            raise Refused(RefusalReason.MALFORMED, f"unknown token stage {token.tag!r}")
        # the sender skips a member that refuses as STALE: one not running this round,
        # one that settled the stage already, one in another token of the stage
        if state.started is None:
            raise Refused(RefusalReason.STALE, "this node is not running the round")
        if token.phase in (TOKEN_PROBE, TOKEN_COLLECT) and self.holds_sum(state, token):
            # its ring completed: the token adds its proposal, which settles the stage
            return COMPLETED
        if token.phase == TOKEN_PROBE:
            if token.tag == "ready":  # a member runs the agreement on U1 (rounds.early)
                state.inbox.put(("token", token.tag, "probe"), env.sender, b"")
            return b""
        record = state.agreement
        joined = record.joined.get(token.tag)
        if token.phase == TOKEN_COLLECT and token.tag in record.decided:
            raise Refused(RefusalReason.STALE, "this node settled the stage already")
        if joined is not None and joined != token.starter:
            raise Refused(RefusalReason.STALE, "this node is in another token")
        if token.phase == TOKEN_COLLECT:
            slot = "return" if token.starter == self.me else "collect"
        else:
            slot = "decide"
        if not state.inbox.put(("token", token.tag, slot), "", env.payload):
            # the same token twice (a send retried after a lost reply): the sender stops
            raise Refused(RefusalReason.REPLAY, "second token")
        if slot == "collect":
            record.joined[token.tag] = token.starter
        if slot == "decide" and token.tag not in record.stalled:
            return SETTLED  # it still waits for this decision: it settles on it
        return b""

    def holds_sum(self, state: RoundState, token: Token) -> bool:
        """Whether this node settled the ring attempt of ``token`` as completed (over the
        members the token travels), so it holds the attempt's masked sum."""
        settled = state.agreement.decided.get(token.tag)
        return (
            decisive(token.tag)
            and settled is not None
            and settled[1]
            and view_hash(f"{token.tag}/token", state.ring_order(settled[0])) == token.base
        )

    def answer_view(self, state: RoundState, tag: str, attempt: int, sender: str) -> None:
        """Once this node settled ``tag`` (all it heard agreed, or by the token), a peer
        that heard less and is retrying gets the settled view, so it can converge."""
        record = state.agreement
        settled = record.decided.get(tag)
        if settled is None or (tag, attempt, sender) in record.views_sent:
            return
        record.views_sent.add((tag, attempt, sender))
        answer = View(tag, attempt, settled[0], settled[1]).to_bytes()
        self.net.spawn(
            self.net.broadcast(
                Counters(), [sender], KIND_VIEW, answer, run=state.run, round=state.round, stage=tag
            )
        )

    # -- settling -----------------------------------------------------------------------

    async def settle(
        self,
        state: RoundState,
        counters: Counters,
        tag: str,
        base: Iterable[str],
        proposal: frozenset[str],
        flag: bool = True,
    ) -> Settled:
        """Agree on a set with the members of ``base``: by one token passed along their
        ring (:class:`~coordinator_free.rounds.token.TokenAgreement`), and by the view
        agreement when the token stalls or there is no ring of two."""
        order = state.ring_order(base)
        if self.me in order and len(order) >= 2:
            token = TokenAgreement(self, state, counters, tag, order, proposal, flag)
            settled = await token.run()
            if settled is not None:
                return settled
        state.agreement.stalled.add(tag)  # a decision that comes from now on is not settled on
        self.net.observe("retry", state.run, state.round, tag, detail="token stalled: views")
        return await self.agree(state, counters, tag, proposal, flag)

    def settled(self, state: RoundState, tag: str, members: frozenset[str], ok: bool) -> None:
        """Record what this node settled ``tag`` on and answer the views that wait."""
        state.agreement.decided[tag] = (members, ok)
        for attempt in range(self.config.max_view_attempts):
            for sender in list(state.inbox.senders(("view", tag, str(attempt)))):
                self.answer_view(state, tag, attempt, sender)

    def settle_held(
        self, state: RoundState, tag: str, members: frozenset[str], holders: Iterable[str]
    ) -> Settled:
        """Settle a ring attempt as completed over ``members``: ``holders`` have its sum."""
        state.agreement.completers.setdefault(tag, set()).update(holders)
        self.settled(state, tag, members, True)
        return members, True

    # -- by views -----------------------------------------------------------------------

    async def agree(
        self,
        state: RoundState,
        counters: Counters,
        tag: str,
        proposal: frozenset[str],
        flag: bool = True,
    ) -> Settled:
        """Agree on a set with the other members of ``proposal`` by exchanging views.

        Returns ``(members, flag)`` once every member's view equals this node's; the
        flag of a view is the AND of the flags seen. Raises :class:`RoundFailed` when
        this node is left out or the views do not converge.
        """
        me = self.me
        view, ok = proposal, flag
        for attempt in range(self.config.max_view_attempts):
            others = sorted(view - {me})
            views, failed = await self._exchange_views(
                state, counters, View(tag, attempt, view, ok)
            )
            if decisive(tag):
                # a member whose ring completed decides the attempt (see decisive)
                holders = {o for o, v in views.items() if v.flag and v.members >= view}
                if holders:
                    return self.settle_held(state, tag, views[min(holders)].members, holders)
            missing = (set(others) - set(views)) | failed
            if not missing and all(v.members == view and v.flag == ok for v in views.values()):
                state.agreement.decided[tag] = (view, ok)
                return view, ok
            new = set(view) - missing
            for v in views.values():
                new &= v.members
                ok = ok and v.flag
            logger.info(
                "%s: views of %s differ at attempt %d (missing %s); retrying with %d members",
                me,
                tag,
                attempt,
                sorted(missing),
                len(new),
            )
            if me not in new:
                raise RoundFailed(tag, "the other participants' views leave this node out")
            view = frozenset(new)
        raise RoundFailed(
            tag, f"views did not agree after {self.config.max_view_attempts} attempts (split view)"
        )

    async def _exchange_views(
        self, state: RoundState, counters: Counters, mine: View
    ) -> tuple[dict[str, View], set[str]]:
        """Send ``mine`` to the other members of its set and wait for theirs, up to a
        stage timeout; a peer that could not take it, or that left the round, is not
        waited for. Returns the views that came, by sender, and the peers not reached."""
        others = sorted(mine.members - {self.me})
        state.agreement.views_sent.update((mine.tag, mine.attempt, o) for o in others)
        failed = await self.net.broadcast(
            counters,
            others,
            KIND_VIEW,
            mine.to_bytes(),
            run=state.run,
            round=state.round,
            stage=mine.tag,
        )
        key = ("view", mine.tag, str(mine.attempt))
        expected = set(others) - failed

        def heard() -> bool:
            return expected - state.gone() <= state.inbox.senders(key)

        await state.inbox.wait_any(
            [key, ("gone",)],
            heard,
            asyncio.get_running_loop().time() + self.config.stage_timeout,
            expect=(key, expected),
        )
        got = {o: p for o, p in state.inbox.get(key).items() if o in expected}
        return {o: decode_view(p) for o, p in got.items()}, failed

    # -- by the token -------------------------------------------------------------------

    async def pass_on_held(self, state: RoundState, tag: str, members: frozenset[str]) -> None:
        """Once this node's ring attempt completed, a token of that attempt that reached
        it before goes on with its proposal (the members, completed)."""
        box = state.inbox.get(("token", tag, "collect"))
        if "" not in box:
            return
        try:
            got = Token.from_bytes(box[""])
        except ValueError:
            return
        order = state.ring_order(members)
        if got.phase != TOKEN_COLLECT or self.me not in order:
            return
        entry = (self.me, members, True)
        token = Token(TOKEN_COLLECT, tag, got.base, got.starter, (*got.entries, entry))
        counters = Counters()
        token, outcome = await pass_token(
            self.net, state, counters, tag, order, order.index(self.me), token
        )
        if outcome == "end" and token.starter != self.me:
            await send_token(self.net, state, counters, tag, token.starter, token)
