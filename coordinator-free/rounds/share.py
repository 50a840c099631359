"""Stage 2, share keys, then the agreement on the participants ``U1``.

``docs/ARCHITECTURE.md``, "A round", step 1; Bonawitz et al., CCS'17, §4 round 1. To
every org it saw ready, the node sends the Shamir shares of its self-mask seed and
mask key, encrypted to the holder, each message prefixed by the hash of its ready
view (``round.share``), one request per pair of holders
(:class:`~coordinator_free.rounds.exchange.PairwiseExchange`); the holders that send
first get a moment, then a holder whose share still did not come is sent this
node's. With SecAgg+ (Bell et al., CCS'20, §3) the holders are the graph neighbours
only.

**agree** — when every share arrives with this node's own view hash, the participants
``U1`` are settled at no extra message; otherwise the node runs the view agreement on
``U1``. With SecAgg+ the shares come from the neighbours only, so matching hashes
prove nothing about the rest: the agreement always runs, by the token (every node
runs it), and a node proposes no holder of its shares whose own shares did not reach
it (their masks would not cancel). ``U1`` is the ring's members, and each node masks
with exactly its holders in ``U1``: a node that lacks the shares of one of them fails
its round rather than mask with a set the others cannot know.

From ``RoundConfig.shares_ahead_from`` members on, the shares of most pairs rode with the readies
(:mod:`~coordinator_free.rounds.ahead`): the exchange runs only with the holders of
the others (``StageContext.ahead_done`` left out; none at all in a steady federation),
and the shares carry no view hash to compare, so ``U1`` is agreed by the token.

**The ring first** (``RoundConfig.ring_first``): where ``U1`` goes by the
token and this node's proposal holds every member, the stage runs no agreement.
``U1`` is the members, the session settles on them, and the ring starts at once with
``U1`` pending (:mod:`~coordinator_free.rounds.early`): the ring's completion settles
it, or the token does when another member runs it or the ring breaks
(:mod:`~coordinator_free.rounds.reduce`). A share that came but does not open makes
the node join the token at once, proposing the members less its sender.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Iterable

from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.rounds.agreement import Agreement
from coordinator_free.rounds.config import RoundConfig, patience
from coordinator_free.rounds.context import StageContext
from coordinator_free.rounds.early import PendingU1
from coordinator_free.rounds.exchange import PairwiseExchange
from coordinator_free.rounds.mask_stream import stream_masks
from coordinator_free.rounds.messenger import retrieved
from coordinator_free.rounds.prepared import MaskPreparer
from coordinator_free.rounds.results import RoundFailed
from coordinator_free.rounds.session import small_work
from coordinator_free.rounds.state import RoundTable
from coordinator_free.rounds.wire import HASH_BYTES, KIND_SHARE, view_hash
from coordinator_free.wire import Envelope

from secure_agg.errors import SecAggError

__all__ = ["SHARES", "ShareStage"]

SHARES = ("share",)
"""The inbox key of the share exchange."""
_GONE = ("gone",)


def _awaited(ctx: StageContext) -> frozenset[str]:
    """The holders whose shares this node awaits from the exchange: those it can send
    its own to, less those whose shares it opened with their ready."""
    return ctx.expected_shares - ctx.ahead_in


def _hashed(peer: str, data: bytes) -> bytes | None:
    """A share message carries the sender's view hash first: shorter, nothing to file."""
    return data if len(data) >= HASH_BYTES else None


class ShareStage:
    """The share stage and the agreement on ``U1``, and the handler of ``round.share``."""

    def __init__(
        self,
        table: RoundTable,
        config: RoundConfig,
        agreement: Agreement,
        prepared: MaskPreparer | None = None,
    ) -> None:
        self.table = table
        self.config = config
        self.agreement = agreement
        self.prepared = prepared

    async def on_share(self, env: Envelope) -> bytes:
        """A peer's shares for this org: filed, and answered with this org's for it
        (held a little while this node still makes its own)."""
        state = self.table.state(env.run, env.round, env.sender)
        if len(env.payload) < HASH_BYTES:
            raise Refused(RefusalReason.MALFORMED, "share without a view hash")
        return await state.exchange(SHARES).serve(
            env.sender, env.payload, "share", defer_s=self.config.send_timeout / 4
        )

    async def run(self, ctx: StageContext) -> None:
        """Share keys with the holders, carrying this node's view of the participants."""
        await ctx.enter("share")
        t, me = ctx.t, ctx.me
        view1 = ctx.ready_set
        least = max(t, ctx.config.min_participants)
        if len(view1) < least:
            raise RoundFailed(
                "ready",
                f"{len(view1)} participants are ready, fewer than {least} (threshold t={t})",
                missing=tuple(sorted(set(ctx.u0) - view1)),
            )
        ctx.h1 = view_hash("ready", view1)
        # the holders of this org's shares, who also send theirs here (the graph is
        # undirected): every other ready org, or only the SecAgg+ neighbours
        ctx.holders = ctx.session.holders(view1)
        ctx.sparse = ctx.holders != view1 - {me}
        ctx.by_token = ctx.sparse or ctx.config.seals_ahead(len(ctx.u0))
        # the masks expanded for this round while the update trained, if any
        prepared = None if self.prepared is None else await self.prepared.take(ctx.run, ctx.round)
        try:
            outgoing = ctx.session.share_keys(view1, only=ctx.holders - ctx.ahead_done)
            work = ctx.session.premask(prepared)
            ctx.masks_prepared = work.prepared
        except (SecAggError, ValueError) as exc:
            raise RoundFailed("share", f"cannot share keys: {exc}") from exc
        # the masks of the usual case go into the input off the loop while the shares
        # travel (the mask stage waits for them and makes the input exact), or into
        # the ring's chunks from the helper process as they first leave; small work
        # (a small vector's copy, say) is done here, cheaper than the hop to a thread
        if work.masks:  # prepared masks the round got right leave none to stream
            ctx.mask_stream = stream_masks(
                ctx.config.mask_helper, work.target, work.masks, ctx.state.ring_order(view1), me
            )
        if ctx.mask_stream is not None:  # only the input's copy is left, if any
            work = dataclasses.replace(work, masks=[])
        if small_work(work.work_bytes):
            try:
                work()
            except (SecAggError, ValueError) as exc:
                raise RoundFailed("mask", f"cannot mask the input: {exc}") from exc
        else:
            ctx.premasking = asyncio.ensure_future(asyncio.to_thread(work))
            ctx.premasking.add_done_callback(retrieved)
        exchange = ctx.state.exchange(SHARES)
        exchange.offer({o: ctx.h1 + outgoing[o] for o in outgoing})
        ctx.expected_shares = ctx.holders
        if outgoing:
            await self._exchange(ctx, exchange, frozenset(outgoing))
        ctx.shares = {
            o: p
            for o, p in ctx.state.inbox.get(SHARES).items()
            if o in ctx.expected_shares and o not in ctx.ahead_in
        }
        for org in sorted(_awaited(ctx) - ctx.shares.keys()):
            why = "it left the round" if org in ctx.state.gone() else "no share by the deadline"
            ctx.observe("missing", "share", peer=org, detail=why)
        ctx.lap("share")

    async def _exchange(
        self, ctx: StageContext, exchange: PairwiseExchange, peers: frozenset[str]
    ) -> None:
        """One request and its reply per pair of ``peers`` (the holders whose shares did
        not all travel ahead), as for the readies: the holders that send first get a
        moment; a holder whose share still did not come is then sent this node's (a
        dead one is unreachable, and no longer awaited)."""
        loop = asyncio.get_running_loop()
        inbox, state = ctx.state.inbox, ctx.state
        share_end = loop.time() + ctx.config.stage_timeout
        sent_to = set(exchange.targets(peers))
        ctx.unshared = await self._send(ctx, exchange, sent_to)
        ctx.expected_shares = ctx.holders - ctx.unshared
        shared = functools.partial(self._shared, ctx)
        await inbox.wait_any(
            [SHARES, _GONE],
            shared,
            min(share_end, loop.time() + patience(ctx.config)),
            expect=(SHARES, _awaited(ctx)),
        )
        late = (_awaited(ctx) & peers) - inbox.senders(SHARES) - state.gone() - sent_to
        if late:
            ctx.unshared |= await self._send(ctx, exchange, late)
            ctx.expected_shares = ctx.holders - ctx.unshared
        await inbox.wait_any([SHARES, _GONE], shared, share_end, expect=(SHARES, _awaited(ctx)))

    @staticmethod
    async def _send(
        ctx: StageContext, exchange: PairwiseExchange, peers: Iterable[str]
    ) -> set[str]:
        return await exchange.send(
            ctx.net, ctx.counters, peers, KIND_SHARE, "share", unwrap=_hashed
        )

    @staticmethod
    def _shared(ctx: StageContext) -> bool:
        """Whether every holder still awaited (not gone) sent its shares."""
        return _awaited(ctx) - ctx.state.gone() <= ctx.state.inbox.senders(SHARES)

    async def agree(self, ctx: StageContext) -> None:
        """Settle the participants ``U1`` and take their shares: the ring's members."""
        await ctx.enter("agree-ready")
        state, me = ctx.state, ctx.me
        view1, shares = ctx.ready_set, ctx.shares
        if (
            not ctx.by_token
            and not state.equivocal & view1
            and shares.keys() == view1 - {me}
            and all(p[:HASH_BYTES] == ctx.h1 for p in shares.values())
        ):
            ctx.u1 = view1
            # unflagged: a flag on ``ready`` says a ring over every member completed
            state.agreement.decided["ready"] = (ctx.u1, False)
        else:
            ctx.u1 = await self._agree_participants(ctx)
            ctx.require_threshold()
            shares = state.inbox.get(SHARES)
        share_set = {me} | (ctx.ahead_in & ctx.u1)
        for org, payload in sorted(shares.items()):
            if (
                org in ctx.u1
                and org not in ctx.ahead_in
                and ctx.net.accept(
                    ctx.session.receive_share,
                    org,
                    payload[HASH_BYTES:],
                    "share",
                    ctx.run,
                    ctx.round,
                )
            ):
                share_set.add(org)
        # this node masks with exactly its holders in U1, which every member knows
        # (docs/SECURITY.md, "U2"); lacking the shares of one, it takes no part
        lacking = (ctx.holders & ctx.u1) - share_set
        if lacking and ctx.u1_pending is not None:
            # a share that came did not open: the ring waits for the token after all
            ctx.u1 = await ctx.u1_pending.start(without=frozenset(lacking))
            ctx.u1_pending = None
            ctx.require_threshold()
            lacking &= ctx.u1
        try:
            ctx.session.settle_participants(ctx.u1)
        except (SecAggError, ValueError) as exc:
            why = f"the shares of participants {sorted(lacking)} did not reach this node: "
            raise RoundFailed(
                "share", f"{why if lacking else ''}{exc}", missing=tuple(sorted(lacking))
            ) from exc
        ctx.members = ctx.u1
        ctx.lap("agree-ready")

    async def _agree_participants(self, ctx: StageContext) -> frozenset[str]:
        """``U1`` by agreement: an org that sent this node two different readies or
        shares is left out of its proposal. A proposal of every member, with
        ``RoundConfig.ring_first``, is returned at once as ``U1`` to start the
        ring with, ``U1`` left pending (``ctx.u1_pending``)."""
        state = ctx.state
        proposal = ctx.ready_set - ctx.unshared - state.equivocal
        if ctx.by_token:
            # every node runs this agreement: the token (O(n) messages) suffices
            proposal -= _awaited(ctx) - ctx.shares.keys()
            if ctx.config.ring_first and proposal == frozenset(ctx.u0):
                # every member is in: the ring starts over them at once, U1 pending
                # (rounds.early): settled by the ring, or by the token if another
                # member runs it or the ring breaks
                ctx.u1_pending = PendingU1(self.agreement, state, ctx.counters, ctx.u0, proposal)
                return proposal
            u1, _ = await self.agreement.settle(
                state, ctx.counters, "ready", ctx.u0, proposal, False
            )
        else:
            # others may have settled at no message: they answer views, not tokens
            u1, _ = await self.agreement.agree(state, ctx.counters, "ready", proposal, False)
        return u1
