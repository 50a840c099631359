"""Stage 1, ready: who is ready to take part, and with which public keys.

``docs/ARCHITECTURE.md``, "A round", step 1; Bonawitz et al., CCS'17, §4 round 0. The
node opens its masked-sum session over the members ``U0`` (the federation's members,
the same on every node) and exchanges with every member a signed ``round.ready``
carrying the hash of ``U0`` and its ``AdvertiseKeys``: one request per pair
(:class:`~coordinator_free.rounds.exchange.PairwiseExchange`). A peer it cannot reach
(a partition, a peer still starting) is tried again a few times before the deadline,
so a partition that heals in time costs nothing; the wait ends early once every member
believed alive is ready. The orgs whose ``ready`` came with the same ``U0`` and an
advertisement the session takes are this node's ready set.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from coordinator_free.rounds.context import StageContext
from coordinator_free.rounds.exchange import PairwiseExchange
from coordinator_free.rounds.results import RoundFailed
from coordinator_free.rounds.session import SessionContext, SessionFactory
from coordinator_free.rounds.state import RoundTable
from coordinator_free.rounds.wire import HASH_BYTES, KIND_READY, view_hash
from coordinator_free.wire import Envelope

__all__ = ["READY", "ReadyStage"]

logger = logging.getLogger(__name__)

READY = ("ready",)
"""The inbox key of the ready exchange."""


class ReadyStage:
    """The ready stage of this node's rounds, and its handler of ``round.ready``."""

    def __init__(
        self,
        table: RoundTable,
        federation: str,
        peers: Callable[[], Iterable[str]],
        session_factory: SessionFactory,
    ) -> None:
        self.table = table
        self.federation = federation
        self.peers = peers
        self.session_factory = session_factory

    async def on_ready(self, env: Envelope) -> bytes:
        """A peer's ready: filed, and answered with this node's own when it has one."""
        state = self.table.state(env.run, env.round, env.sender)
        return await state.exchange(READY).serve(env.sender, env.payload, "ready")

    async def run(self, ctx: StageContext) -> None:
        await ctx.enter("ready")
        self._open_session(ctx)
        h0 = view_hash("members", ctx.u0)
        own = h0 + ctx.session.advertise()
        ctx.state.inbox.put(READY, ctx.me, own)
        exchange = ctx.state.exchange(READY)
        exchange.offer(own)
        await self._exchange(ctx, exchange)
        ctx.ready_set = self._take_readies(ctx, h0)
        ctx.lap("ready")

    def _open_session(self, ctx: StageContext) -> None:
        """``U0``, ``t``, SecAgg+'s ``k`` and this org's session for the round."""
        cfg = ctx.config
        ctx.u0 = u0 = tuple(sorted(set(self.peers()) | {ctx.me}))
        ctx.t = cfg.threshold_for(len(u0))
        if not 2 <= ctx.t <= len(u0):
            raise RoundFailed("ready", f"threshold {ctx.t} does not fit {len(u0)} members")
        ctx.k = cfg.neighbours_for(len(u0))
        ctx.maybe_session = self.session_factory(
            SessionContext(
                self.federation,
                ctx.run,
                ctx.round,
                ctx.me,
                u0,
                cfg.share_threshold_for(len(u0)),
                ctx.vector,
                ctx.k,
            )
        )

    async def _exchange(self, ctx: StageContext, exchange: PairwiseExchange) -> None:
        """Send this node's ready to the peers it initiates with and to those whose ready
        came first, retrying the unreached; wait until the deadline or until every
        member believed alive is ready."""
        loop = asyncio.get_running_loop()
        inbox, u0 = ctx.state.inbox, ctx.u0
        wait_s = (
            (ctx.deadline - ctx.clock()) if ctx.deadline is not None else ctx.config.ready_timeout
        )
        ready_end = loop.time() + max(0.0, wait_s)
        pending: set[str] = set(exchange.targets(u0))
        retry_s = max(0.05, wait_s / 8)
        # the wait ends early once every member believed alive is ready
        awaited = set(u0) if ctx.live is None else (set(ctx.live()) & set(u0)) | {ctx.me}
        tries = 0
        while True:
            if tries:
                for org in sorted(pending):
                    ctx.observe("retry", "ready", peer=org, detail="ready re-sent")
            tries += 1
            pending = await exchange.send(ctx.net, ctx.counters, pending, KIND_READY, "ready")
            if not pending or loop.time() + retry_s >= ready_end:
                break
            got = await inbox.wait(READY, awaited, min(ready_end, loop.time() + retry_s))
            if got.keys() >= awaited:
                break
        await inbox.wait(READY, awaited, ready_end)

    def _take_readies(self, ctx: StageContext, h0: bytes) -> frozenset[str]:
        """The orgs ready with this node's member list whose advertisement the session
        takes, this node included; the others are reported."""
        readies = {o: p for o, p in ctx.state.inbox.get(READY).items() if o in ctx.u0}
        ready_set = {ctx.me}
        for org, payload in sorted(readies.items()):
            if org == ctx.me:
                continue
            if payload[:HASH_BYTES] != h0:
                logger.warning("%s: %s is ready with another member list; left out", ctx.me, org)
                ctx.observe("mismatch", "ready", peer=org, detail="another member list")
                continue
            if ctx.net.accept(
                ctx.session.receive_advert,
                org,
                payload[HASH_BYTES:],
                "advertisement",
                ctx.run,
                ctx.round,
            ):
                ready_set.add(org)
        for org in sorted(set(ctx.u0) - readies.keys() - {ctx.me}):
            ctx.observe("missing", "ready", peer=org, detail="no ready by the deadline")
        return frozenset(ready_set)
