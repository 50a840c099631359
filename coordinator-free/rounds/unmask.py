"""Stage 5, unmask: the masks come off the agreed survivors' sum.

``docs/ARCHITECTURE.md``, "A round", step 5; Bonawitz et al., CCS'17, §4 round 4.

- **Seeds.** With owner unmasking, when nobody dropped since ``U1`` (``U3 = U1``) and
  at least ``t`` members settled the survivors on one token decision, the token's
  starter sends them a **permit** (``round.permit``, :meth:`UnmaskStage.permitted`);
  each survivor then reveals its own self-mask seed, checked against the commitment
  of its ``AdvertiseKeys``, and the seeds spread by recursive doubling
  (``round.seed``, :meth:`UnmaskStage.spread_seeds`): ``n ceil(log2 n)`` messages in
  all and no reconstruction.
- **Releases.** Otherwise, or when a seed does not arrive (its owner died), for the
  agreed survivors ``U3`` each node releases the self-mask shares of survivors and the
  mask-key shares of the dropped (``round.unmask``), once per round, so one honest
  node never releases both kinds of share for one org; it is one request per pair
  (:class:`~coordinator_free.rounds.exchange.PairwiseExchange`), and a node keeps its
  release after the round for a survivor that still needs it.
- **The sum.** A node removes the masks as soon as its session holds what it needs:
  from the whole masked sum, or with owner unmasking from the two chunks it holds
  (``2 L`` of mask expansion instead of ``n L``), after which the all-gather carries
  the unmasked sum (``agg.sum``); a member whose all-gather broke takes each chunk it
  lacks from a member that holds it (``round.part``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

import numpy as np
from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.ring import LIVENESS_POLL_S, RingBroken, RingReducer, Scattered
from coordinator_free.rounds.config import RoundConfig, patience
from coordinator_free.rounds.context import StageContext
from coordinator_free.rounds.exchange import PairwiseExchange
from coordinator_free.rounds.results import RoundFailed
from coordinator_free.rounds.session import run_sized
from coordinator_free.rounds.state import (
    Counters,
    RoundState,
    RoundTable,
    forget_run,
    keep_latest,
)
from coordinator_free.rounds.sums import SumServer
from coordinator_free.rounds.wire import (
    HASH_BYTES,
    KIND_PERMIT,
    KIND_SEED,
    KIND_UNMASK,
    SEED_ENTRY,
    view_hash,
)
from coordinator_free.wire import Envelope

from secure_agg.errors import SecAggError

__all__ = ["UnmaskStage"]

logger = logging.getLogger(__name__)

_GONE = ("gone",)


def _for_survivors(h3: bytes, peer: str, data: bytes) -> bytes | None:
    """A release in a reply counts only for the survivor set of this node's (``h3``)."""
    return data[HASH_BYTES:] if data[:HASH_BYTES] == h3 else None


class UnmaskStage:
    """The unmask stage of this node's rounds, and its handlers of ``round.unmask``,
    ``round.permit`` and ``round.seed``."""

    def __init__(
        self, table: RoundTable, config: RoundConfig, ring: RingReducer, sums: SumServer
    ) -> None:
        self.table = table
        self.config = config
        self.ring = ring
        self.sums = sums
        # per (run, round): this node's release (view hash, survivors, message), kept
        # after the round for a survivor that still needs it (see on_unmask)
        self._releases: dict[tuple[str, int], tuple[bytes, frozenset[str], bytes]] = {}
        self._release_events: dict[tuple[str, int], asyncio.Event] = {}

    def forget_run(self, run: str) -> None:
        """``run`` ended here: its kept releases go."""
        forget_run(self._releases, self._release_events, run)

    # -- handlers -----------------------------------------------------------------------

    async def on_unmask(self, env: Envelope) -> bytes:
        """A survivor's release for a survivor set: filed, and answered with this node's
        own (held a little while this node still makes it; after the round, the kept
        one)."""
        if len(env.payload) < HASH_BYTES:
            raise Refused(RefusalReason.MALFORMED, "release without a view hash")
        kept = self._releases.get((env.run, env.round))
        if kept is not None and self.table.get(env.run, env.round) is None:
            # this node finished the round (it needed only some of the releases, or
            # none: the seeds): a survivor that still needs its release gets it
            h3, survivors, data = kept
            if env.sender not in survivors:
                raise Refused(RefusalReason.NOT_MEMBER, f"{env.sender!r} is not a survivor")
            if env.payload[:HASH_BYTES] != h3:
                raise Refused(RefusalReason.STALE, "a release for another survivor set")
            return data
        state = self.table.state(env.run, env.round, env.sender)
        exchange = state.exchange(("unmask", env.payload[:HASH_BYTES].hex()))
        return await exchange.serve(
            env.sender, env.payload[HASH_BYTES:], "release", defer_s=self.config.send_timeout / 4
        )

    async def on_permit(self, env: Envelope) -> bytes:
        """The token starter's permit to reveal seeds for a survivor set (its hash)."""
        if len(env.payload) != HASH_BYTES:
            raise Refused(RefusalReason.MALFORMED, "a permit is the 32-byte hash of the survivors")
        state = self.table.state(env.run, env.round, env.sender)
        state.inbox.put(("permit", env.payload.hex()), env.sender, b"")
        return b""

    async def on_seed(self, env: Envelope) -> bytes:
        """The seeds a survivor holds at one step of the recursive doubling."""
        state = self.table.state(env.run, env.round, env.sender)
        payload = env.payload
        if len(payload) < HASH_BYTES + 1 or (len(payload) - HASH_BYTES - 1) % SEED_ENTRY.size:
            raise Refused(RefusalReason.MALFORMED, "seeds of the wrong size")
        key = ("seed", payload[:HASH_BYTES].hex(), str(payload[HASH_BYTES]))
        if not state.inbox.put(key, env.sender, payload[HASH_BYTES + 1 :]):
            raise Refused(RefusalReason.REPLAY, "second seeds of this step")
        return b""

    # -- the stage ----------------------------------------------------------------------

    async def run(self, ctx: StageContext) -> np.ndarray:
        """The sum of the survivors' inputs, by the seeds or by the releases."""
        await ctx.enter("unmask")
        state, u3 = ctx.state, ctx.members
        if state.released_for is not None and state.released_for != u3:
            raise RoundFailed("unmask", "shares were already released for another survivor set")
        state.released_for = u3
        try:
            release = ctx.session.unmask(u3)
        except (SecAggError, ValueError) as exc:
            raise RoundFailed("unmask", f"cannot release shares: {exc}") from exc
        h3 = view_hash("unmask", u3)
        message = h3 + release
        others = u3 - {ctx.me}
        exchange = state.exchange(("unmask", h3.hex()))
        exchange.offer(dict.fromkeys(others, message))
        keep_latest(self._releases, self._release_events, ctx.run, ctx.round, (h3, u3, message))
        # nobody dropped since U1 and at least t members settled the survivors by one
        # token (the permit): each survivor reveals its own self-mask seed, and the
        # seeds spread by recursive doubling (no share is reconstructed)
        by_seeds = (
            u3 == ctx.u1
            and ctx.agreed_by is not None
            and await self.permitted(ctx, ctx.agreed_by, u3, h3)
        )
        if by_seeds and await self.spread_seeds(ctx, u3, h3):
            # a survivor short of a seed asked for this node's release before it had
            # one, and the reply waited in vain: it gets the release now
            owed = exchange.targets(exchange.heard())
            if owed:
                ctx.net.spawn(
                    exchange.send(
                        ctx.net, Counters(), owed, KIND_UNMASK, "unmask", message, unwrap=None
                    )
                )
            return await self._unmasked(ctx)
        if by_seeds:
            # a seed did not come (its owner died after the agreement, or a relay did):
            # the releases reconstruct it; survivors answer a release with their own
            ctx.observe("retry", "unmask", detail="seeds missing: releases")
            targets = sorted(others - exchange.heard())
        else:
            targets = exchange.targets(others)
        releases = _Releases(ctx, exchange, others, message, h3)
        await releases.send(targets)
        accepted = await releases.collect(targets)
        if not ctx.session.can_finish() or len(accepted) + 1 < ctx.t:
            for org in sorted(u3 - accepted - {ctx.me}):
                ctx.observe("missing", "unmask", peer=org, detail="no release by the deadline")
        released = len(accepted) + 1
        if released < ctx.t:
            raise RoundFailed("unmask", f"{released} orgs released shares, fewer than t={ctx.t}")
        return await self._unmasked(ctx)

    # -- seeds --------------------------------------------------------------------------

    async def permitted(self, ctx: StageContext, tag: str, u3: frozenset[str], h3: bytes) -> bool:
        """Whether this survivor may reveal its self-mask seed rather than have its
        holders release shares of it: when at least ``t`` members settled the
        survivors ``u3`` on one token decision (``tag``), fewer than ``t`` can ever
        settle a set without this node and release its mask-key shares, the same bound
        that keeps ``t`` released b-shares safe. The token's starter knows who settled
        on its decision (their replies say so) and tells the survivors
        (``round.permit``); a node that settled otherwise, or hears no permit within a
        step timeout, releases shares instead."""
        me, record = ctx.me, ctx.state.agreement
        starter = record.joined.get(tag)
        if starter is None or tag in record.stalled:
            return False
        if starter == me:
            if len(record.settled_by.get(tag, frozenset()) & u3) < ctx.t:
                return False
            await ctx.net.broadcast(
                ctx.counters,
                sorted(u3 - {me}),
                KIND_PERMIT,
                h3,
                run=ctx.run,
                round=ctx.round,
                stage="unmask",
            )
            return True
        deadline = asyncio.get_running_loop().time() + self.config.step_timeout
        got = await await_from(
            ctx.state, ("permit", h3.hex()), starter, deadline, ctx.believed_alive()
        )
        return got is not None

    async def spread_seeds(self, ctx: StageContext, u3: frozenset[str], h3: bytes) -> bool:
        """Reveal this survivor's self-mask seed and gather every survivor's, by
        recursive doubling (Bruck et al.) over the ring order of ``u3``: at step ``i``
        a node sends every seed it holds to the member ``2**i`` places before it and
        takes those of the member ``2**i`` places after it, so after ``ceil(log2 n)``
        steps each holds all ``n``, for ``n log2 n`` small messages in all instead of
        the ``n (n - 1)`` releases. Relayed seeds are checked against their owners'
        commitments, so a relay can withhold a seed but not change one. A sender that
        stays silent for a step timeout (or that left, or that membership holds dead)
        is not waited for again: this node sends its remaining steps at once, and
        returns whether it holds every seed; if not, the releases reconstruct the rest.
        """
        try:
            known = {ctx.me: ctx.session.self_seed()}
        except (SecAggError, ValueError) as exc:
            raise RoundFailed("unmask", f"cannot reveal the self-mask seed: {exc}") from exc
        order = ctx.state.ring_order(u3)
        names = sorted(u3)
        index = {o: i for i, o in enumerate(names)}
        n, here = len(order), order.index(ctx.me)
        loop = asyncio.get_running_loop()
        alive = ctx.believed_alive()
        sends: list[asyncio.Future[set[str]]] = []
        waiting = True
        step, distance = 0, 1
        while distance < n:
            payload = b"".join(
                [h3, bytes([step])]
                + [SEED_ENTRY.pack(index[o], seed) for o, seed in sorted(known.items())]
            )
            dest, src = order[(here - distance) % n], order[(here + distance) % n]
            sends.append(asyncio.ensure_future(self._send_seeds(ctx, dest, payload)))
            if waiting:
                key = ("seed", h3.hex(), str(step))
                deadline = loop.time() + self.config.step_timeout
                got = await await_from(ctx.state, key, src, deadline, alive)
                if got is None:
                    waiting = False
                    ctx.observe("missing", "unmask", peer=src, detail=f"no seeds at step {step}")
                else:
                    _take_seeds(ctx, got, names, known)
            step, distance = step + 1, 2 * distance
        await asyncio.gather(*sends)
        return len(known) == n and ctx.session.can_finish()

    @staticmethod
    async def _send_seeds(ctx: StageContext, dest: str, payload: bytes) -> set[str]:
        return await ctx.net.broadcast(
            ctx.counters, [dest], KIND_SEED, payload, run=ctx.run, round=ctx.round, stage="unmask"
        )

    # -- the sum ------------------------------------------------------------------------

    async def _unmasked(self, ctx: StageContext) -> np.ndarray:
        """The sum, once the session can remove every mask: from the whole masked sum,
        or by owner unmasking of the chunks this node holds."""
        if ctx.scattered is not None:
            return await self._gather_sum(ctx)
        assert ctx.total is not None
        try:
            ctx.session.prepare_unmask()  # on the loop; the mask expansion off it
            result = await asyncio.to_thread(ctx.session.unmasked_sum, ctx.total)
        except (SecAggError, ValueError) as exc:
            raise RoundFailed("unmask", f"cannot remove the masks: {exc}") from exc
        ctx.lap("unmask")
        return result

    async def _gather_sum(self, ctx: StageContext) -> np.ndarray:
        """Owner unmasking: unmask the two chunks this node holds, serve them, and take
        the rest of the unmasked sum along the ring (``all_gather_sum``), or, when that
        breaks, chunk by chunk from members that hold them (``round.part``)."""
        scattered, order, attempt = ctx.scattered, ctx.order, ctx.attempt - 1
        assert scattered is not None
        acc = scattered.acc
        try:
            ctx.session.prepare_unmask()  # on the loop; the mask expansion off it if large
            for lo, hi in held_spans(scattered):
                part = acc[lo:hi]
                # the usual case's masks: every member's self mask over the part
                work = part.nbytes * (len(order) + 1)
                acc[lo:hi] = await run_sized(work, ctx.session.unmask_part, part, lo)
        except (SecAggError, ValueError) as exc:
            raise RoundFailed("unmask", f"cannot remove the masks: {exc}") from exc
        self.sums.keep_parts(ctx.run, ctx.round, attempt, frozenset(order), scattered)
        ctx.lap("unmask")
        await ctx.enter("gather")
        try:
            await self.ring.all_gather_sum(
                order,
                scattered,
                run=ctx.run,
                round=ctx.round,
                attempt=attempt,
                timeout=self.config.step_timeout,
                stats=ctx.counters.ring,
                on_step=ctx.step_hook(),
                alive=ctx.believed_alive(),
                bits=ctx.ring_bits,
            )
        except RingBroken as exc:
            logger.info("%s: the all-gather of the sum broke: %s", ctx.me, exc)
            await self.sums.fetch_parts(ctx.state, ctx.counters, order, attempt, scattered)
        # off the loop unless small, like the decoding: a copy of the vector when the sum
        # is a ring array (read, and written as float64 at most: three times its bytes)
        result = await run_sized(3 * acc.nbytes, decoded_copy, ctx.session.decode, acc)
        ctx.lap("gather")
        return result


def held_spans(scattered: Scattered) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` spans of the chunks a member holds after the reduce-scatter (its
    own and its predecessor's), as one span when they are adjacent (as they are but
    where the ring order wraps): each mask is then expanded from one keystream over
    both, not set up twice."""
    spans = sorted(scattered.bounds[i] for i in {scattered.own, scattered.held})
    if len(spans) == 2 and spans[0][1] == spans[1][0]:
        return [(spans[0][0], spans[1][1])]
    return spans


def decoded_copy(decode: Callable[[np.ndarray], np.ndarray], acc: np.ndarray) -> np.ndarray:
    """The decoded sum as an array of the caller's own: ``acc`` keeps the chunks this
    node serves to others after the round, so a sum that decodes to ``acc`` itself (a
    ring array) is copied."""
    result = decode(acc)
    return result.copy() if result is acc else result


def _take_seeds(ctx: StageContext, got: bytes, names: list[str], known: dict[str, bytes]) -> None:
    """Hand the seeds of one step's message to the session; ``known`` gets those taken."""
    for at in range(0, len(got), SEED_ENTRY.size):
        i, seed = SEED_ENTRY.unpack_from(got, at)
        owner = names[i] if i < len(names) else f"#{i}"
        if ctx.net.accept(ctx.session.receive_seed, owner, seed, "seed", ctx.run, ctx.round):
            known[owner] = seed


async def await_from(
    state: RoundState,
    key: tuple[str, ...],
    sender: str,
    deadline: float,
    alive: Callable[[str], bool] | None,
) -> bytes | None:
    """``sender``'s message under ``key`` once it came; ``None`` at ``deadline``, or as
    soon as ``sender`` left the round or membership no longer holds it alive."""
    loop = asyncio.get_running_loop()

    def arrived() -> bool:
        return sender in state.inbox.senders(key) or sender in state.gone()

    while True:
        got = state.inbox.item(key, sender)
        now = loop.time()
        if got is not None:
            return got
        if now >= deadline or sender in state.gone():
            return None
        if alive is not None and not alive(sender):
            return None
        until = deadline if alive is None else min(deadline, now + LIVENESS_POLL_S)
        await state.inbox.wait_any([key, _GONE], arrived, until, expect=(key, {sender}))


class _Releases:
    """The releases of one survivor set: sent, and taken until the session can finish.

    A node finishes as soon as the session holds every share it needs (a survivor that
    died after the reduce is simply not waited for), or at the stage deadline. Asking
    the session whether it can finish costs ``O(n k)`` (it plans every
    reconstruction), so it is asked once ``t - 1`` releases are in, then after each
    further sixteenth of the survivors or a quiet spell, not on every arrival (which
    made the stage ``O(n^3 k)`` CPU over a simulated federation).
    """

    def __init__(
        self,
        ctx: StageContext,
        exchange: PairwiseExchange,
        others: frozenset[str],
        message: bytes,
        h3: bytes,
    ) -> None:
        self.ctx = ctx
        self.exchange = exchange
        self.others = others
        self.message = message
        self.unwrap = functools.partial(_for_survivors, h3)
        self.accepted: set[str] = set()
        self.stride = max(1, len(others) // 16)
        self.check_at = ctx.t - 1
        self.checked = -1
        self.quiet = 0.05
        self.seen = 0
        self.lull = False
        self.end = 0.0
        self.pull_at: float | None = None

    async def send(self, peers: set[str] | list[str] | frozenset[str]) -> set[str]:
        ctx = self.ctx
        return await self.exchange.send(
            ctx.net, ctx.counters, peers, KIND_UNMASK, "unmask", self.message, unwrap=self.unwrap
        )

    async def collect(self, targets: list[str]) -> set[str]:
        """Take releases until the session can finish or the stage ends; the survivors
        that send first get a moment, then those still silent are asked (one that
        finished by the seeds sends its release only when asked). Returns the
        survivors whose release was taken."""
        ctx, loop = self.ctx, asyncio.get_running_loop()
        self.end = loop.time() + ctx.config.stage_timeout
        self.pull_at = loop.time() + patience(ctx.config)
        while True:
            if self.pull_at is not None and loop.time() >= self.pull_at:
                self.pull_at = None
                await self.send(
                    self.others - self.exchange.heard() - set(targets) - ctx.state.gone()
                )
            if self._take_arrived():
                break
            last = len(self.accepted) >= len(self.others) or loop.time() >= self.end
            if (self.lull and len(self.accepted) != self.checked) or last:
                if self._can_finish():
                    break
                self.checked, self.check_at = len(self.accepted), len(self.accepted) + self.stride
                if self.lull:  # each quiet spell that ends in a check doubles the next one
                    self.quiet = min(2 * self.quiet, ctx.config.step_timeout)
            if last:
                break
            await self._wait(loop)
        return self.accepted

    def _can_finish(self) -> bool:
        return len(self.accepted) + 1 >= self.ctx.t and self.ctx.session.can_finish()

    def _take_arrived(self) -> bool:
        """Decode the releases that came, one by one, up to the next check (those still
        queued when the session can finish are never decoded); whether it can."""
        ctx = self.ctx
        for org, payload in ctx.state.inbox.since(self.exchange.key, self.seen):
            self.seen += 1
            if org in self.others and org not in self.accepted:
                self.accepted.add(org)
                ctx.net.accept(
                    ctx.session.receive_release, org, payload, "release", ctx.run, ctx.round
                )
                if len(self.accepted) >= self.check_at:
                    finished = self._can_finish()
                    self.checked = len(self.accepted)
                    self.check_at = len(self.accepted) + self.stride
                    if finished:
                        return True
        return False

    async def _wait(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait for the releases up to the next check, a quiet spell or the pull."""
        count = self.seen + max(1, self.check_at - len(self.accepted))

        def wake() -> bool:
            return len(self.exchange.heard()) >= count

        until = min(self.end, loop.time() + self.quiet)
        if self.pull_at is not None:
            until = min(until, self.pull_at)
        key = self.exchange.key
        await self.ctx.state.inbox.wait_any([key], wake, until, expect=(key, self.others))
        self.lull = not wake()
