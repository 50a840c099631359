"""Stages 3 and 4, mask and reduce: the masked inputs summed along a ring, and what
the members agree on the ring's outcome.

``docs/ARCHITECTURE.md``, "A round", step 4; Bonawitz et al., CCS'17, §4 round 2. The
node masks its input; the masked vectors are summed along the ring ordered by
``SHA-256(round || org_id)`` with :class:`~coordinator_free.ring.RingReducer`
(chunked reduce-scatter + all-gather, or a chain for short vectors; ``star`` for the
benchmark's baseline; the ring's id binds its members, so rings built from different
views never mix).

**agree** — a node whose ring **completed** holds the masked sum of every member of
the attempt, and that sum settles the attempt for all: it moves on to the unmask at
once, with no message, keeps the masked sum, and answers any token or view of the
attempt with ``completed``. A node whose ring **broke** runs the agreement on
``(members, completed)`` (each member proposes the members less those it blames);
when the outcome is completed it takes the masked sum from a member that holds it
(``round.total``, piece by piece), and when no member completed the ring runs again
over the agreed survivors' masked vectors, which each still holds. So a fault-free
ring costs no agreement message, and a death late in the all-gather costs one fetch
instead of a second ring.

**The ring first**: a node that started its ring with ``U1`` pending
(:mod:`~coordinator_free.rounds.early`) settles ``U1`` by the ring's completion, or
else takes the first attempt's outcome once the token decided every member. A
smaller decision stops that ring and drops its outcome, even a completed one (nothing
was released for it), narrows the session to the decided set (``SecAggPeer.narrow``),
masks again and runs the ring over that set as the same attempt: the ring's id binds
its members, so the two rings never mix (``docs/SECURITY.md``, "A ring started before
the participants are settled").

**Owner unmasking** (from ``RoundConfig.owner_unmask_from`` members on, when the vector
is cut in chunks): the ring stops after the reduce-scatter and one step that copies
each member's complete chunk to its successor, and the members agree by the token
(tag ``scatter:N``) that every reduce-scatter and copy completed (the AND of the
flags; otherwise the ring runs again over the intersection). After the unmask stage
a member whose all-gather broke takes each chunk it lacks from its owner, else from
the successor holding its copy (``round.part``, :mod:`~coordinator_free.rounds.sums`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np
from coordinator_free.ring import RingBroken, RingReducer, Scattered, StarOptions
from coordinator_free.rounds.agreement import Agreement
from coordinator_free.rounds.config import RoundConfig
from coordinator_free.rounds.context import StageContext
from coordinator_free.rounds.results import RoundFailed
from coordinator_free.rounds.sums import SumServer

from secure_agg.errors import SecAggError

__all__ = ["ReduceStage", "owner_unmask"]

logger = logging.getLogger(__name__)


class ReduceStage:
    """The mask and reduce stages of this node's rounds."""

    def __init__(self, ring: RingReducer, agreement: Agreement, sums: SumServer) -> None:
        self.ring = ring
        self.agreement = agreement
        self.sums = sums

    async def mask(self, ctx: StageContext) -> None:
        """The session masks this org's input (§4 round 2): ``ctx.masked``, once the
        masks it added while the shares travelled are in (``ctx.premasking``)."""
        await ctx.enter("mask")
        try:
            if ctx.premasking is not None:
                await ctx.premasking
            # the usual case leaves nothing to add: settled here, with no hop to a worker
            # thread (which waits for the interpreter lock while this loop takes the
            # ring's first chunks); a neighbour outside U2 costs one more mask
            # expansion, off the loop (no message touches the session while it masks)
            masked = ctx.session.premasked_input()
            if masked is None:
                masked = await asyncio.to_thread(ctx.session.masked_input)
            ctx.masked = masked
        except (SecAggError, ValueError) as exc:
            raise RoundFailed("mask", f"cannot mask the input: {exc}") from exc
        ctx.lap("mask")

    async def run(self, ctx: StageContext) -> None:
        """Run the ring until an attempt settles: the masked sum (``ctx.total``) or,
        with owner unmasking, the reduce-scatter (``ctx.scattered``)."""
        while ctx.total is None and ctx.scattered is None:
            if ctx.attempt >= ctx.config.max_reduce_attempts:
                raise RoundFailed("reduce", f"the ring broke {ctx.attempt} times")
            await ctx.enter("reduce")
            if ctx.attempt:
                ctx.observe("retry", "reduce", detail=f"ring attempt {ctx.attempt + 1}")
                # the last attempt summed the masked input in place: made again
                await _remask(ctx)
            ctx.order = ctx.state.ring_order(ctx.members)
            owners = owner_unmask(ctx.config, len(ctx.order), ctx.masked_input())
            try:
                if ctx.u1_pending is not None:
                    outcome = await self._ring_first(ctx, owners)
                else:
                    outcome = await self._ring(ctx, owners)
            finally:
                _end_stream(ctx)
            ctx.lap("reduce")
            if outcome is None:  # the participants settled on fewer: masked again
                await _remask(ctx)
                continue
            done, suspects = outcome
            await ctx.enter("agree-reduce")
            if owners:
                part = done if isinstance(done, Scattered) else None
                await self._settle_scatter(ctx, part, suspects)
            else:
                acc = done if isinstance(done, np.ndarray) else None
                await self._settle_attempt(ctx, acc, suspects)
            ctx.lap("agree-reduce")
            ctx.attempt += 1

    async def _ring_first(
        self, ctx: StageContext, owners: bool
    ) -> tuple[np.ndarray | Scattered | None, frozenset[str]] | None:
        """The first ring attempt, over every member, started with ``U1`` pending
        (:mod:`~coordinator_free.rounds.early`). Completed before this node joined the
        agreement, it settles ``U1`` as every member. Otherwise the token decides: every
        member, and the attempt's outcome stands (broken or completed); fewer, and
        ``None``: the ring is stopped and its outcome dropped, even a completed one
        (only a member that proposed less than it masked with can complete it), no
        member releasing anything for it, and the session narrows to the decided
        participants, who run the ring again."""
        pending = ctx.u1_pending
        assert pending is not None
        ring = asyncio.ensure_future(self._ring(ctx, owners))
        joined = asyncio.ensure_future(pending.started.wait())
        try:
            await asyncio.wait({ring, joined}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            joined.cancel()
        if ring.done() and not ring.cancelled() and ring.exception() is None:
            done, suspects = ring.result()
            if done is not None and pending.settle_by_ring():
                ctx.u1_pending = None
                return done, suspects
        try:
            u1 = await pending.start()
        except BaseException:
            await _stop(ctx, ring)
            raise
        ctx.u1_pending = None
        if u1 == ctx.members:
            return await ring
        await _stop(ctx, ring)
        ctx.dropped += 1
        ctx.observe(
            "retry",
            "reduce",
            detail=f"the participants settled on {len(u1)} of {len(ctx.members)} members: "
            "the ring runs again over them",
        )
        ctx.left_out |= ctx.members - u1
        ctx.u1 = ctx.members = u1
        ctx.require_threshold()
        try:
            ctx.session.narrow_participants(u1)
        except (SecAggError, ValueError) as exc:
            raise RoundFailed("share", f"cannot narrow the participants: {exc}") from exc
        return None

    async def _ring(
        self, ctx: StageContext, owners: bool
    ) -> tuple[np.ndarray | Scattered | None, frozenset[str]]:
        """One ring attempt: what it left this node (``None`` when it broke), and the
        members blamed for a break."""
        counters, order, me = ctx.counters, ctx.order, ctx.me
        t_ring, ring_before = time.perf_counter(), counters.ring.bytes_sent
        done: np.ndarray | Scattered | None = None
        suspects: frozenset[str] = frozenset()
        try:
            done = await self._reduce(ctx, owners)
        except RingBroken as exc:
            logger.info("%s: ring attempt %d broke: %s", me, ctx.attempt, exc)
            blamed = self.ring.suspects(ctx.run, ctx.round, order, ctx.attempt)
            suspects = (exc.suspects | blamed) - {me}
            for org in sorted(suspects):
                ctx.observe("suspect", "reduce", peer=org, detail=str(exc))
        if done is not None and len(order) > 1:
            ctx.net.observe(
                "link",
                ctx.run,
                ctx.round,
                "reduce",
                peer=order[order.index(me) - 1],
                seconds=time.perf_counter() - t_ring,
                bytes=counters.ring.bytes_sent - ring_before,
            )
        return done, suspects

    async def _reduce(self, ctx: StageContext, owners: bool) -> np.ndarray | Scattered:
        """The ring itself: the reduce-scatter (owner unmasking), the star, or the
        all-reduce. The ring sums in the masked input itself (``in_place``), and the
        session makes the input again for a later attempt: a round holds one ring
        vector where a copy for the ring made it two."""
        cfg, masked, order = ctx.config, ctx.masked_input(), ctx.order
        attempt = StarOptions(
            run=ctx.run,
            round=ctx.round,
            attempt=ctx.attempt,
            timeout=cfg.step_timeout,
            stats=ctx.counters.ring,
            start_grace=cfg.stage_timeout,
            bits=ctx.ring_bits,
            feed=ctx.mask_stream,
        )
        if cfg.topology == "star" and not owners:
            return await self.ring.star_allreduce(order, masked, **attempt)
        on_step, alive = ctx.step_hook(), ctx.believed_alive()
        if owners:
            return await self.ring.reduce_scatter(
                order, masked, **attempt, on_step=on_step, alive=alive, in_place=True
            )
        return await self.ring.allreduce(
            order,
            masked,
            **attempt,
            on_step=on_step,
            min_chunk=cfg.ring_min_chunk,
            alive=alive,
            in_place=True,
        )

    async def _settle_scatter(
        self, ctx: StageContext, part: Scattered | None, suspects: frozenset[str]
    ) -> None:
        """Owner unmasking: every member holds a complete chunk only when every
        reduce-scatter completed, which no single member can see: the members agree on
        it (the AND of the flags) before anyone releases a share."""
        tag = f"scatter:{ctx.attempt}"
        members = ctx.members
        agreed, complete = await self.agreement.settle(
            ctx.state, ctx.counters, tag, members, members - suspects, part is not None
        )
        if ctx.me not in agreed:
            raise RoundFailed("reduce", "the other members' proposals leave this node out")
        if complete and agreed == members:
            ctx.scattered = part
            ctx.agreed_by = tag
        else:
            _narrow(ctx, agreed)

    async def _settle_attempt(
        self, ctx: StageContext, acc: np.ndarray | None, suspects: frozenset[str]
    ) -> None:
        """The outcome of a ring attempt: completed here, completed elsewhere (the sum
        is fetched), or broken everywhere (the ring runs again over the survivors)."""
        tag, members, state = f"reduce:{ctx.attempt}", ctx.members, ctx.state
        if acc is not None:
            # this node holds the masked sum of every member of the attempt: that
            # settles the attempt for all at no message (see wire.decisive); a token or
            # view of it that came meanwhile gets this node's proposal
            self.agreement.settled(state, tag, members, True)
            self.sums.keep_total(ctx.run, ctx.round, ctx.attempt, members, acc)
            ctx.net.spawn(self.agreement.pass_on_held(state, tag, members))
            ctx.total = acc
            return
        agreed, completed = await self.agreement.settle(
            state, ctx.counters, tag, members, members - suspects, False
        )
        if not completed:
            _narrow(ctx, agreed)
            return
        if agreed != members:
            raise RoundFailed("reduce", "a completed ring over another member set")
        # the broken ring left partial sums in the masked input: the sum fills it
        total = await self.sums.fetch_total(
            state, ctx.counters, tag, ctx.attempt, ctx.masked_input(), into=True
        )
        self.sums.keep_total(ctx.run, ctx.round, ctx.attempt, members, total)
        ctx.total = total


def _end_stream(ctx: StageContext) -> None:
    """The masks streamed from the helper serve the first attempt only: its segment is
    released as the attempt ends (a later one masks the input again itself)."""
    if ctx.mask_stream is not None:
        ctx.mask_stream.close()
        ctx.mask_stream = None


async def _stop(ctx: StageContext, ring: asyncio.Future[Any]) -> None:
    """Stop a ring attempt started with ``U1`` pending: its vector is the node's again
    once the attempt and any chunk's masks still being expanded in a thread ended."""
    ring.cancel()
    await asyncio.wait({ring})
    if not ring.cancelled():
        ring.exception()  # a broken ring or an error: its outcome is dropped all the same
    if ctx.mask_stream is not None:
        await ctx.mask_stream.drain()


async def _remask(ctx: StageContext) -> None:
    """The masked input once more (the session makes it again, bit for bit, in the
    same array, off the event loop), for a ring attempt after one that summed into it."""
    try:
        ctx.masked = await asyncio.to_thread(ctx.session.masked_input)
    except (SecAggError, ValueError) as exc:
        raise RoundFailed("reduce", f"cannot mask the input again: {exc}") from exc
    ctx.lap("mask")


def _narrow(ctx: StageContext, agreed: frozenset[str]) -> None:
    """The ring runs again over the agreed survivors, if they are still ``t``."""
    ctx.members = agreed
    if len(agreed) < ctx.t:
        raise RoundFailed("reduce", f"{len(agreed)} survivors, fewer than the threshold t={ctx.t}")


def owner_unmask(config: RoundConfig, n: int, masked: np.ndarray) -> bool:
    """Whether a ring of ``n`` members unmasks by chunk owners (see
    :attr:`RoundConfig.owner_unmask_from`): the same on every member of the ring."""
    return (
        config.owner_unmask_from is not None
        and config.topology == "ring"
        and n >= config.owner_unmask_from
        and len(masked) >= n * config.ring_min_chunk
    )
