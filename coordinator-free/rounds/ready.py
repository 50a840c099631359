"""Stage 1, ready: who is ready to take part, and with which public keys.

``docs/ARCHITECTURE.md``, "A round", step 1; Bonawitz et al., CCS'17, §4 round 0. The
node opens its masked-sum session over the members ``U0`` (the federation's members,
the same on every node) and exchanges with every member a signed ``round.ready``
carrying the hash of ``U0`` and its ``AdvertiseKeys``: one request per pair
(:class:`~coordinator_free.rounds.exchange.PairwiseExchange`). A peer it cannot reach
(a partition, a peer still starting) is tried again a few times before the deadline,
so a partition that heals in time costs nothing. The wait lasts until the deadline and
ends early only when every member is ready, or when at least ``t`` are and every missing
one is confirmed dead by membership (never merely suspect: latency is not death). The orgs whose ``ready`` came with the same ``U0`` and an
advertisement the session takes are this node's ready set.

From ``RoundConfig.ready_relay_from`` members on, the readies travel first as signed
records relayed by recursive doubling (:mod:`~coordinator_free.rounds.ready_relay`,
``ceil(log2 n)`` requests per node); the pairwise ``round.ready`` then goes only to the
members whose record did not come through, and to those whose ready came before this
node had its own. The ready set is the same either way: the readies seen by the
deadline.

From ``RoundConfig.shares_ahead_from`` members on, each ready also carries the ahead part
(:mod:`~coordinator_free.rounds.ahead`): a key for a later round, the masking key of
this org's next round of the run (the session of that round takes the secrets, once:
:meth:`~coordinator_free.rounds.ahead.AheadKeys.take_masking`), the keys this org
still holds, and the digests of its shares sealed to the keys its holders advertised
before; the sealed shares themselves go beside it, each towards its holder only (a
direct ready carries its receiver's). The exchange files a ready's core, the blobs
are kept apart (:func:`file_direct`). The node opens the shares sealed for it as it
takes the readies, and notes the holders with which both directions travelled ahead
(``StageContext.ahead_done``): the share stage leaves them out. A holder whose blob no
relayed copy brought whole asks its author by a direct ready (:func:`_blobless`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import Callable, Iterable

from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.rounds.ahead import (
    Ahead,
    AheadKeys,
    Blob,
    Ready,
    encode_blobs,
    key_id,
    read_blobs,
)
from coordinator_free.rounds.config import patience
from coordinator_free.rounds.context import StageContext
from coordinator_free.rounds.exchange import PairwiseExchange
from coordinator_free.rounds.ready_relay import OWED, ReadyRelay, blobs_key
from coordinator_free.rounds.results import RoundFailed
from coordinator_free.rounds.session import SessionContext, SessionFactory
from coordinator_free.rounds.state import RoundState, RoundTable
from coordinator_free.rounds.wire import HASH_BYTES, KIND_READY, view_hash
from coordinator_free.wire import Envelope

__all__ = ["READY", "ReadyStage", "wait_is_over"]

logger = logging.getLogger(__name__)

READY = ("ready",)
"""The inbox key of the ready exchange."""

_POLL_S = 0.1
"""How often a waiting ready stage looks again at membership and later attempts."""


def _silent(ctx: StageContext, exchange: PairwiseExchange) -> set[str]:
    """The members not heard from in this exchange, not answered, and not confirmed
    dead (when there is a membership view)."""
    silent = set(ctx.u0) - set(exchange.heard()) - exchange.served - {ctx.me}
    if ctx.live is not None:
        silent &= set(ctx.live())
    return silent


def _direct_blobs(author: str) -> tuple[str, ...]:
    """The inbox key of the blobs of ``author``'s direct ready (kept apart from those of
    the copies relays brought, under the same key by ``author``)."""
    return (*blobs_key(author), "direct")


def file_direct(state: RoundState, sender: str, payload: bytes) -> bytes:
    """What of ``sender``'s direct ready the exchange files: its core (the same bytes
    as its relayed record's, so two copies compare equal); the blob after it is kept
    for :func:`blob_for`. A ready whose core does not parse is filed whole, and
    reported as malformed when the readies are taken."""
    try:
        core, blobs = Ready.split(payload, HASH_BYTES)
    except ValueError:
        return payload
    if blobs:
        state.inbox.put(_direct_blobs(sender), sender, blobs)
    return core


def blob_for(state: RoundState, author: str, ahead: Ahead, mine: int) -> Blob | None:
    """The blob ``author`` sealed for this node (index ``mine`` in ``U0``), from any
    copy that brought one whose digest its core lists; ``None`` when it sealed none,
    or no copy brought it whole."""
    want = ahead.digest_for(mine)
    if want is None:
        return None
    inbox = state.inbox
    sections = [*inbox.get(_direct_blobs(author)).values(), *inbox.get(blobs_key(author)).values()]
    for section in sections:
        try:
            blob = read_blobs(section, only=mine).get(mine)
        except ValueError:
            continue
        if blob is not None and blob.digest() == want:
            return blob
    return None


Parsed = dict[str, tuple[bytes, Ready, Blob | None]]
"""The readies parsed so far, by org: the core they were parsed from, the ready, and
the blob sealed for this node found with it."""


def _blobless(ctx: StageContext, parsed: Parsed) -> set[str]:
    """The members whose ready lists a blob sealed for this node that no copy brought
    whole (a relay dropped or spoiled it): a direct ready takes it from its author.
    The readies parsed on the way are kept in ``parsed``."""
    mine, state, out = ctx.u0.index(ctx.me), ctx.state, set()
    for org, core in state.inbox.get(READY).items():
        if org == ctx.me:
            continue
        try:
            ready = Ready.from_bytes(core, HASH_BYTES)
        except ValueError:
            continue
        blob = None if ready.ahead is None else blob_for(state, org, ready.ahead, mine)
        parsed[org] = (core, ready, blob)
        if blob is None and ready.ahead is not None and ready.ahead.digest_for(mine):
            out.add(org)
    return out


def wait_is_over(ctx: StageContext) -> bool:
    """Whether the ready stage may stop waiting before its deadline: every member of
    ``U0`` is ready, or at least ``t`` are and every missing one is confirmed dead by
    the membership layer (``ctx.live()`` lists the members not known to have failed,
    suspects included: a suspect is waited for, it may only be slow)."""
    u0 = set(ctx.u0)
    ready = set(ctx.state.inbox.senders(READY)) & u0
    if ready >= u0:
        return True
    if ctx.live is None or len(ready) < ctx.t:
        return False
    return not (u0 - ready) & set(ctx.live())


def _direct(ctx: StageContext, ready: Ready, core: bytes) -> bytes | dict[str, bytes]:
    """This node's direct ready for each member: the core, and the blob it sealed for
    that member, if any (the others' blobs are not that member's business)."""
    blobs = {} if ready.ahead is None else ready.ahead.blobs
    if not blobs:
        return core
    out: dict[str, bytes] = {}
    for i, org in enumerate(ctx.u0):
        blob = blobs.get(i)
        if org != ctx.me:
            out[org] = core if blob is None else core + encode_blobs({i: blob})
    return out


class ReadyStage:
    """The ready stage of this node's rounds, and its handler of ``round.ready``."""

    def __init__(
        self,
        table: RoundTable,
        federation: str,
        peers: Callable[[], Iterable[str]],
        session_factory: SessionFactory,
        relay: ReadyRelay | None = None,
        ahead: AheadKeys | None = None,
    ) -> None:
        self.table = table
        self.federation = federation
        self.peers = peers
        self.session_factory = session_factory
        self.relay = relay
        self.ahead = ahead

    async def on_ready(self, env: Envelope) -> bytes:
        """A peer's ready: filed, and answered with this node's own when it has one
        (else this node owes it its own, and sends it once it has one)."""
        state = self.table.state(env.run, env.round, env.sender)
        core = file_direct(state, env.sender, env.payload)
        reply = await state.exchange(READY).serve(env.sender, core, "ready")
        if not reply:
            state.inbox.put(OWED, env.sender, b"")
        return reply

    async def run(self, ctx: StageContext) -> None:
        await ctx.enter("ready")
        self._open_session(ctx)
        h0 = view_hash("members", ctx.u0)
        ready = self._own_ready(ctx, h0)
        own = ready.core()
        parsed: Parsed = {}
        ctx.state.inbox.put(READY, ctx.me, own)
        exchange = ctx.state.exchange(READY)
        exchange.offer(_direct(ctx, ready, own))
        now, wait_s = asyncio.get_running_loop().time(), max(0.0, self._wait_s(ctx))
        ready_end = now + wait_s
        if self.relay is not None and ctx.config.relays_readies(len(ctx.u0)):
            # the relay waits at most half the window: the rest is left to ask the
            # members whose records it did not bring directly
            blobs = b"" if ready.ahead is None else encode_blobs(ready.ahead.blobs)
            await self.relay.spread(ctx, own, now + wait_s / 2, blobs)
            # the pairwise ready goes to the members still missing, to those owed, and
            # to those whose blob for this node no copy brought
            inbox = ctx.state.inbox
            pending = set(ctx.u0) - set(inbox.senders(READY)) - {ctx.me}
            pending |= set(inbox.senders(OWED)) - exchange.served
            pending |= _blobless(ctx, parsed)
            if ctx.live is not None:
                pending &= set(ctx.live()) | set(inbox.senders(OWED))
        else:
            pending = set(exchange.targets(ctx.u0))
        await self._exchange(ctx, exchange, pending, ready_end)
        ctx.ready_set = self._take_readies(ctx, h0, parsed)
        ctx.lap("ready")

    def _open_session(self, ctx: StageContext) -> None:
        """``U0``, ``t``, SecAgg+'s ``k`` and this org's session for the round."""
        cfg = ctx.config
        ctx.u0 = u0 = tuple(sorted(set(self.peers()) | {ctx.me}))
        ctx.t = cfg.threshold_for(len(u0))
        if not 2 <= ctx.t <= len(u0):
            raise RoundFailed("ready", f"threshold {ctx.t} does not fit {len(u0)} members")
        ctx.k = cfg.neighbours_for(len(u0))
        # the s pair and b this node's last ready of the run advertised for this round
        masking = None
        if self.ahead is not None and cfg.seals_ahead(len(u0)):
            masking = self.ahead.take_masking(ctx.run)
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
                masking,
            )
        )

    def _own_ready(self, ctx: StageContext, h0: bytes) -> Ready:
        """This node's ready: its advertisement and, with shares sealed ahead, a new key
        for a later round, the masking key of its next round of the run, the keys it
        holds, and its shares for each holder whose key it knows, sealed to that key."""
        advert = ctx.session.advertise()
        if self.ahead is None or not ctx.config.seals_ahead(len(ctx.u0)):
            return Ready(h0, advert)
        next_pk, ctx.ahead_keys = self.ahead.rotate(os.urandom(32))
        next_spk = self.ahead.rotate_masking(ctx.run, os.urandom(32), os.urandom(32))
        known = self.ahead.known(ctx.session.holders(frozenset(ctx.u0)))
        index = {org: i for i, org in enumerate(ctx.u0)}
        blobs: dict[int, Blob] = {}
        for org, sealed in ctx.session.seal_ahead(known).items():
            ctx.ahead_sent[org] = key_id(known[org])
            blobs[index[org]] = Blob(ctx.ahead_sent[org], bytes(sealed))
        ahead = Ahead.sealing(next_pk, frozenset(ctx.ahead_keys), blobs, next_spk)
        return Ready(h0, advert, ahead)

    @staticmethod
    def _wait_s(ctx: StageContext) -> float:
        """Seconds the ready stage may wait from now."""
        if ctx.deadline is not None:
            return ctx.deadline - ctx.clock()
        return ctx.config.ready_timeout

    async def _exchange(
        self, ctx: StageContext, exchange: PairwiseExchange, pending: set[str], ready_end: float
    ) -> None:
        """Send this node's ready to ``pending`` (the peers it initiates with and those
        whose ready came first; after a relay, the members it still misses), retrying the unreached (past :func:`patience`, to every member still
        silent too); wait until the deadline, or until
        :func:`wait_is_over` says the wait may end early. A peer's ready for a later
        attempt of the same training round ends this attempt at once
        (``RoundConfig.attempts_per_round``): this node joins the others there."""
        loop = asyncio.get_running_loop()
        u0 = ctx.u0
        wait_s = self._wait_s(ctx)
        retry_s = max(0.05, wait_s / 8)
        next_send = loop.time()
        # past patience, a member still silent may run another attempt of this round:
        # with numbered attempts, this node sends its ready there too (never to one
        # confirmed dead), so that member learns where the others are
        widen_at: float | None = None
        if ctx.config.attempts_per_round is not None:
            widen_at = loop.time() + patience(ctx.config)
        tries = 0

        def closed(peer: str, error: Refused) -> None:
            # a member that refused this node's ready as stale closed the round
            # without it: its ready, filed before, makes no participant of it here
            if error.reason is RefusalReason.STALE:
                ctx.closed_without_me.add(peer)

        while True:
            now = loop.time()
            if widen_at is not None and now >= widen_at:
                widen_at = None
                silent = _silent(ctx, exchange) - pending
                if silent:
                    pending |= silent
                    next_send = now
            if pending and now >= next_send:
                if tries:
                    for org in sorted(pending):
                        ctx.observe("retry", "ready", peer=org, detail="ready re-sent")
                tries += 1
                pending = await exchange.send(
                    ctx.net,
                    ctx.counters,
                    pending,
                    KIND_READY,
                    "ready",
                    unwrap=functools.partial(file_direct, ctx.state),
                    on_refused=closed,
                )
                next_send = loop.time() + retry_s
            self._check_superseded(ctx)
            if wait_is_over(ctx) or loop.time() >= ready_end:
                return
            until = min(ready_end, loop.time() + _POLL_S)
            if pending:
                until = min(until, next_send)
            await ctx.state.inbox.wait(READY, u0, until)

    def _check_superseded(self, ctx: StageContext) -> None:
        """Leave this attempt when a peer already runs a later one of the same round."""
        later = self.table.later_ready(ctx.run, ctx.round, ctx.config.attempts_end(ctx.round))
        if later is not None:
            raise RoundFailed(
                "ready", f"superseded: peers already run protocol round {later} of this round"
            )

    def _take_readies(self, ctx: StageContext, h0: bytes, parsed: Parsed) -> frozenset[str]:
        """The orgs ready with this node's member list whose advertisement the session
        takes, this node included; the others are reported. ``parsed``: the readies
        parsed already, each used while its core is still the one filed (a blob that
        came since, by a direct ready, is looked for again)."""
        readies = {o: p for o, p in ctx.state.inbox.get(READY).items() if o in ctx.u0}
        ready_set = {ctx.me}
        mine = ctx.u0.index(ctx.me)  # the index the blobs sealed for this node carry
        for org, payload in sorted(readies.items()):
            if org == ctx.me:
                continue
            if org in ctx.closed_without_me:
                ctx.observe("missing", "ready", peer=org, detail="it closed the round without us")
                continue
            known = parsed.get(org)
            try:
                ready = (
                    known[1]
                    if known and known[0] == payload
                    else Ready.from_bytes(payload, HASH_BYTES)
                )
            except ValueError as exc:
                ctx.observe("mismatch", "ready", peer=org, detail=f"malformed ready: {exc}")
                continue
            if ready.h0 != h0:
                logger.warning("%s: %s is ready with another member list; left out", ctx.me, org)
                ctx.observe("mismatch", "ready", peer=org, detail="another member list")
                continue
            if ctx.net.accept(
                ctx.session.receive_advert, org, ready.advert, "advertisement", ctx.run, ctx.round
            ):
                ready_set.add(org)
                if ready.ahead is not None:
                    blob = known[2] if known and known[0] == payload else None
                    if blob is None:
                        blob = blob_for(ctx.state, org, ready.ahead, mine)
                    self._take_ahead(ctx, org, ready.ahead, blob)
        for org in sorted(set(ctx.u0) - readies.keys() - {ctx.me}):
            ctx.observe("missing", "ready", peer=org, detail="no ready by the deadline")
        return frozenset(ready_set)

    def _take_ahead(self, ctx: StageContext, org: str, ahead: Ahead, blob: Blob | None) -> None:
        """Keep ``org``'s key for a later round; open the shares it sealed ahead for this
        node (``blob``), with a key this node held when it made its ready. The pair
        needs no share exchange when they open and ``org`` holds the key this node
        sealed its own to."""
        if self.ahead is not None:
            self.ahead.learn(org, ahead.next_pk)
            self.ahead.learn_masking(ctx.run, org, ahead.next_spk)
        key = None if blob is None else ctx.ahead_keys.get(blob.key)
        if blob is None or key is None:
            return
        opened = ctx.net.accept(
            functools.partial(ctx.session.open_ahead, key=key),
            org,
            blob.ciphertext,
            "shares sealed ahead",
            ctx.run,
            ctx.round,
        )
        if opened:
            ctx.ahead_in.add(org)
            if ctx.ahead_sent.get(org) in ahead.held:
                ctx.ahead_done |= {org}
