"""SWIM's failure detector and dissemination for one member: :class:`Membership`.

The protocol period, the direct and indirect probes, suspicion and its timeout, the
refutation of claims about this member and the piggy-backing of updates, as the
package docstring (:mod:`coordinator_free.membership`) describes them; the
handlers of ``swim.ping`` and ``swim.ping_req``; the live view and its subscribers.
Timeouts follow each peer's measured round trip and this member's local health
(:mod:`coordinator_free.membership.timing`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import RefusalReason, Refused, TransportError
from coordinator_free.membership.messages import (
    PING,
    PING_REQ,
    STAGE,
    MemberStatus,
    SwimMessage,
    Update,
    decode_message,
    encode_message,
)
from coordinator_free.membership.state import (
    Broadcasts,
    EventKind,
    Member,
    MembershipEvent,
    MemberState,
    SwimConfig,
)
from coordinator_free.membership.timing import LocalHealth, RttEstimator
from coordinator_free.periodic import run_periodically
from coordinator_free.wire import Envelope

__all__ = ["Membership"]

logger = logging.getLogger(__name__)


class Membership:
    """One member's SWIM protocol instance and its live view of the federation.

    Build with :meth:`create` (it registers the ``swim.*`` handlers on the endpoint and
    starts the protocol loop); the endpoint itself is started and closed by its owner.
    Read the view with :meth:`view`, :meth:`status` and :meth:`live`; follow changes
    with :meth:`subscribe`; end with :meth:`leave` (graceful) or :meth:`stop`.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        members: Iterable[str],
        config: SwimConfig,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = endpoint
        self.config = config
        self.me = endpoint.org_id
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        now = clock()
        self._incarnation = 0
        self._left = False
        self._members: dict[str, Member] = {
            m: self._new_member(now) for m in sorted(set(members)) if m != self.me
        }
        self.health = LocalHealth(config.local_health_max)
        """Lifeguard's local health; its multiplier scales periods and timeouts."""
        self._broadcasts = Broadcasts()
        self._probe_order: list[str] = []
        self._subscribers: list[asyncio.Queue[MembershipEvent]] = []
        self._task: asyncio.Task[None] | None = None
        self._side_tasks: set[asyncio.Task[Any]] = set()
        self._running = False
        self._stopping = asyncio.Event()
        self.periods = 0
        """Protocol periods run so far."""
        self.counters: Counter[str] = Counter()
        """pings, ping_reqs, acks_missed, suspected, refuted, malformed, ..."""

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def create(
        cls,
        endpoint: Endpoint,
        members: Iterable[str],
        config: SwimConfig | None = None,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> Membership:
        """Register the SWIM handlers on ``endpoint`` and start probing ``members``.

        Every member starts ALIVE at incarnation 0 (optimistic); ``rng`` drives probe
        order and helper choice; ``clock`` stamps the view and times suspicions.
        """
        self = cls(endpoint, members, config or SwimConfig(), rng=rng, clock=clock)
        endpoint.on(PING, self._on_ping)
        endpoint.on(PING_REQ, self._on_ping_req)
        self._running = True
        self._task = asyncio.create_task(self._run(), name=f"swim:{self.me}")
        return self

    async def stop(self) -> None:
        """Stop probing and answering (to others this member then looks failed)."""
        self._running = False
        self._stopping.set()
        while True:  # a task being cancelled may still have started a late-ack wait
            tasks = [t for t in (self._task, *self._side_tasks) if t is not None and not t.done()]
            if not tasks:
                break
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._task = None
        self._task = None
        self._side_tasks.clear()

    async def leave(self) -> None:
        """Leave gracefully: tell up to ``retransmit_limit`` live members, then stop.

        The LEFT update spreads from them by piggy-backing; no one suspects us.
        """
        if self._left:
            return
        peers = [p for p in self.live(include_suspect=False) if p != self.me]
        self._left = True
        update = Update(self.me, MemberStatus.LEFT, self._incarnation)
        fanout = min(len(peers), max(self.config.indirect_k, self._retransmit_limit()))
        chosen = self._rng.sample(peers, fanout)
        payload = encode_message(self._incarnation, [update])

        async def notify(peer: str) -> None:
            with contextlib.suppress(TransportError):
                await self._send(peer, PING, payload, self.config.ping_timeout_s)

        await asyncio.gather(*(notify(p) for p in chosen))
        await self.stop()

    # ------------------------------------------------------------------ the view

    @property
    def incarnation(self) -> int:
        """This member's own incarnation number."""
        return self._incarnation

    @property
    def size(self) -> int:
        """Number of federation members, this one included, whatever their status."""
        return len(self._members) + 1

    def view(self) -> Mapping[str, MemberState]:
        """A snapshot of every member's state, this member included."""
        now = self._clock()
        out = {
            org: MemberState(org, m.status, m.incarnation, m.last_seen, m.rtt.srtt, m.since)
            for org, m in self._members.items()
        }
        own = MemberStatus.LEFT if self._left else MemberStatus.ALIVE
        out[self.me] = MemberState(self.me, own, self._incarnation, now, None, now)
        return MappingProxyType(dict(sorted(out.items())))

    def status(self, org_id: str) -> MemberStatus:
        """The status of one member; ``KeyError`` if it is not a member."""
        if org_id == self.me:
            return MemberStatus.LEFT if self._left else MemberStatus.ALIVE
        return self._members[org_id].status

    def live(self, *, include_suspect: bool = True) -> list[str]:
        """Sorted ids of members not known to have failed or left, this one included.

        SWIM treats a SUSPECT member as non-faulty until confirmed DEAD; pass
        ``include_suspect=False`` to get only ALIVE members.
        """
        ok = {MemberStatus.ALIVE, MemberStatus.SUSPECT} if include_suspect else {MemberStatus.ALIVE}
        out = [org for org, m in self._members.items() if m.status in ok]
        if not self._left:
            out.append(self.me)
        return sorted(out)

    def subscribe(self) -> asyncio.Queue[MembershipEvent]:
        """A queue receiving every later status change (unbounded; drain it)."""
        queue: asyncio.Queue[MembershipEvent] = asyncio.Queue()
        self._subscribers.append(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[MembershipEvent]) -> None:
        """Stop delivering events to ``queue``."""
        with contextlib.suppress(ValueError):
            self._subscribers.remove(queue)

    def update_members(self, members: Iterable[str]) -> None:
        """Follow a manifest change: new members join ALIVE, removed ones are dropped
        (with a LEAVE event)."""
        wanted = set(members) - {self.me}
        now = self._clock()
        for org in sorted(set(self._members) - wanted):
            gone = self._members.pop(org)
            self._emit(EventKind.LEAVE, org, gone.incarnation, now)
        for org in sorted(wanted - set(self._members)):
            self._members[org] = self._new_member(now)
            self._emit(EventKind.JOIN, org, 0, now)

    # ------------------------------------------------------------------ rules

    def _n(self) -> int:
        return len(self._members) + 1

    def _new_member(self, now: float) -> Member:
        """A member as it joins the view: ALIVE at incarnation 0, its round trip unknown."""
        rtt = RttEstimator(self.config.ping_timeout_s, self.config.max_ping_timeout_s)
        return Member(MemberStatus.ALIVE, 0, now, rtt)

    def period_s(self) -> float:
        """The current protocol period: the configured one times the local health."""
        return self.health.scale(self.config.period_s)

    def ping_timeout(self, org_id: str) -> float:
        """How long a direct ping to ``org_id`` waits for its ack now: the peer's
        round-trip timeout times the local health, at most ``max_ping_timeout_s``."""
        member = self._members.get(org_id)
        base = self.config.ping_timeout_s if member is None else member.rtt.rto
        return min(self.health.scale(base), self.config.max_ping_timeout_s)

    def suspicion_timeout(self, org_id: str) -> float:
        """How long a suspicion of ``org_id`` lasts if it is raised now: the configured
        timeout for this many members, at least ``suspicion_mult`` measured round-trip
        timeouts of the suspect (room for its refutation to come back; backoff left
        out), times the local health."""
        member = self._members.get(org_id)
        measured = None if member is None else member.rtt.measured
        base = self.config.suspicion_timeout(self._n())
        if measured is not None:
            base = max(base, self.config.suspicion_mult * measured)
        return self.health.scale(base)

    def _retransmit_limit(self) -> int:
        return self.config.retransmit_limit(self._n())

    def _emit(self, kind: EventKind, org: str, incarnation: int, at: float) -> None:
        event = MembershipEvent(kind, org, incarnation, at)
        logger.debug("%s: %s %s@%d", self.me, kind.value, org, incarnation)
        for queue in self._subscribers:
            queue.put_nowait(event)

    def _apply(self, update: Update) -> None:
        """Apply one update (SWIM §4.2 precedence); refute it if it is about us."""
        if update.org_id == self.me:
            self._about_me(update)
            return
        member = self._members.get(update.org_id)
        if member is None or not update.supersedes(member.status, member.incarnation):
            return
        now = self._clock()
        before = member.status
        member.incarnation = update.incarnation
        if update.status != before:
            member.status = update.status
            member.since = now
        member.suspect_deadline = None
        kind: EventKind | None = None
        if update.status is MemberStatus.ALIVE:
            if before is MemberStatus.SUSPECT:
                kind = EventKind.ALIVE
            elif before in (MemberStatus.DEAD, MemberStatus.LEFT):
                kind = EventKind.JOIN
        elif update.status is MemberStatus.SUSPECT:
            member.suspect_deadline = now + self.suspicion_timeout(update.org_id)
            if before is not MemberStatus.SUSPECT:
                kind = EventKind.SUSPECT
                self.counters["suspected"] += 1
        elif update.status is MemberStatus.DEAD:
            kind = EventKind.DEAD
        else:
            kind = EventKind.LEAVE
        self._broadcasts.put(update)
        if kind is not None:
            self._emit(kind, update.org_id, update.incarnation, now)

    def _about_me(self, update: Update) -> None:
        """Refute a suspicion, death or foreign departure claim about this member."""
        if self._left:
            return
        if update.incarnation < self._incarnation:
            return
        if update.status is MemberStatus.ALIVE and update.incarnation == self._incarnation:
            return
        self._incarnation = update.incarnation + 1
        self.counters["refuted"] += 1
        self.health.apply(+1)  # others could not hear from us in time: we may be slow
        self._broadcasts.put(Update(self.me, MemberStatus.ALIVE, self._incarnation))

    def _heard_from(self, sender: str, incarnation: int) -> None:
        """A signed message from ``sender`` proves it was alive at ``incarnation``."""
        member = self._members.get(sender)
        if member is None:
            return
        member.last_seen = self._clock()
        self._apply(Update(sender, MemberStatus.ALIVE, incarnation))

    def _outgoing(self, peer: str) -> list[Update]:
        """Updates to piggy-back on a message to ``peer``: first our belief that it is
        SUSPECT, DEAD or LEFT (so it can refute at once, or rejoin after a restart), then
        the broadcast queue."""
        out: list[Update] = []
        member = self._members.get(peer)
        if member is not None and member.status is not MemberStatus.ALIVE:
            out.append(Update(peer, member.status, member.incarnation))
        room = self.config.piggyback_max - len(out)
        if self._left:
            out.append(Update(self.me, MemberStatus.LEFT, self._incarnation))
            room -= 1
        if room > 0:
            out.extend(self._broadcasts.take(room, self._retransmit_limit()))
        return out

    def _decode(self, payload: bytes) -> SwimMessage:
        return decode_message(payload, max_updates=max(self.config.piggyback_max, 64))

    def _absorb(self, sender: str, message: SwimMessage) -> None:
        """Take in a message of ``sender``: it is alive, and its updates apply."""
        self._heard_from(sender, message.incarnation)
        for update in message.updates:
            self._apply(update)

    def _receive(self, env: Envelope) -> SwimMessage:
        try:
            message = self._decode(env.payload)
        except Refused:
            self.counters["malformed"] += 1
            raise
        self._absorb(env.sender, message)
        return message

    # ------------------------------------------------------------------ handlers

    def _check_running(self) -> None:
        if not self._running:
            raise Refused(RefusalReason.NO_HANDLER, "membership stopped")

    async def _on_ping(self, env: Envelope) -> bytes:
        self._check_running()
        self._receive(env)
        return encode_message(self._incarnation, self._outgoing(env.sender))

    async def _on_ping_req(self, env: Envelope) -> bytes:
        self._check_running()
        message = self._receive(env)
        target = message.target
        if target is None or target == self.me or target not in self._members:
            self.counters["malformed"] += 1
            raise Refused(RefusalReason.MALFORMED, "ping-req without a valid target")
        ok = await self._ping(target)
        return encode_message(self._incarnation, self._outgoing(env.sender), ok=ok)

    # ------------------------------------------------------------------ probing

    async def _send(self, peer: str, kind: str, payload: bytes, timeout: float) -> bytes:
        return await self.endpoint.send(peer, kind, payload, stage=STAGE, timeout=timeout)

    async def _exchange(self, target: str, payload: bytes) -> bool:
        """Send one ping and wait for its ack up to ``max_ping_timeout_s``; the ack's round
        trip feeds the target's estimator and its updates apply, even when the probe that
        sent it stopped waiting earlier (a late ack still teaches the round trip)."""
        started = time.perf_counter()
        try:
            reply = await self._send(target, PING, payload, self.config.max_ping_timeout_s)
            message = self._decode(reply)
        except (TransportError, Refused):
            return False
        member = self._members.get(target)
        if member is not None:
            member.rtt.sample(time.perf_counter() - started)
        self._absorb(target, message)
        return True

    async def _ping(self, target: str, timeout: float | None = None) -> bool:
        """Ping ``target`` directly; True on an ack within ``timeout`` (default: the
        target's adaptive :meth:`ping_timeout`). Without one, the target's next timeout
        backs off and the ping goes on waiting in the background for a late ack."""
        self.counters["pings"] += 1
        wait = timeout or self.ping_timeout(target)
        payload = encode_message(self._incarnation, self._outgoing(target))
        exchange = asyncio.create_task(self._exchange(target, payload))
        try:
            done, _ = await asyncio.wait({exchange}, timeout=wait)
        except asyncio.CancelledError:
            exchange.cancel()
            raise
        if done:
            return exchange.result()
        member = self._members.get(target)
        if member is not None:
            member.rtt.missed()
        self._side_tasks.add(exchange)
        exchange.add_done_callback(self._side_tasks.discard)
        return False

    async def _ping_req(self, helper: str, target: str, timeout: float) -> bool | None:
        """Ask ``helper`` to probe ``target`` for us (SWIM §3.1): True on an ack, False on
        the helper's nack (it answered, the target did not), None when the helper did not
        answer at all (Lifeguard's missed nack: a hint that we are the slow one)."""
        self.counters["ping_reqs"] += 1
        payload = encode_message(self._incarnation, self._outgoing(helper), target=target)
        try:
            reply = await self._send(helper, PING_REQ, payload, timeout)
            message = self._decode(reply)
        except (TransportError, Refused):
            return None
        self._absorb(helper, message)
        return bool(message.ok)

    def _next_target(self) -> str | None:
        """The next member in the round-robin order (SWIM §4.3), skipping failed ones."""
        for _ in range(2):
            while self._probe_order:
                org = self._probe_order.pop()
                member = self._members.get(org)
                if member is not None and member.status in (
                    MemberStatus.ALIVE,
                    MemberStatus.SUSPECT,
                ):
                    return org
            candidates = [
                org
                for org, m in self._members.items()
                if m.status in (MemberStatus.ALIVE, MemberStatus.SUSPECT)
            ]
            self._rng.shuffle(candidates)
            self._probe_order = candidates
        return None

    async def _probe(self, target: str, started: float) -> None:
        """One SWIM probe: direct ping, then indirect ping-req through k helpers; the
        outcome adjusts the local health (Lifeguard)."""
        if await self._ping(target):
            self.health.apply(-1)
            return
        self.counters["acks_missed"] += 1
        loop = asyncio.get_running_loop()
        helpers = [
            org
            for org, m in self._members.items()
            if org != target and m.status is MemberStatus.ALIVE
        ]
        chosen = self._rng.sample(helpers, min(self.config.indirect_k, len(helpers)))
        if chosen:
            remaining = self.period_s() - (loop.time() - started)
            results = await asyncio.gather(
                *(
                    self._ping_req(h, target, max(remaining, self._indirect_timeout(h, target)))
                    for h in chosen
                )
            )
            if any(results):
                return
            # helpers that answered (nacks) vouch for our own health; silence does not
            self.health.apply(sum(1 for r in results if r is None))
        else:
            self.health.apply(+1)
        member = self._members.get(target)
        if member is not None and member.status is MemberStatus.ALIVE:
            self._apply(Update(target, MemberStatus.SUSPECT, member.incarnation))

    def _indirect_timeout(self, helper: str, target: str) -> float:
        """How long a ping-req through ``helper`` may take: a round trip to the helper
        and its own ping of the target (estimated by ours, doubled: the helper's estimate
        may be longer than ours)."""
        return self.ping_timeout(helper) + 2 * self.ping_timeout(target)

    def _expire_suspicions(self) -> None:
        now = self._clock()
        for org, member in list(self._members.items()):
            deadline = member.suspect_deadline
            if member.status is MemberStatus.SUSPECT and deadline is not None and now >= deadline:
                self._apply(Update(org, MemberStatus.DEAD, member.incarnation))

    def _probe_dead(self) -> None:
        dead = [org for org, m in self._members.items() if m.status is MemberStatus.DEAD]
        if not dead:
            return
        target = self._rng.choice(dead)
        task = asyncio.create_task(self._ping(target))
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    async def _run(self) -> None:
        """A protocol period every :meth:`period_s` until :meth:`stop`; a bug in one
        period is logged and does not stop failure detection."""
        await run_periodically(
            self._period,
            self.period_s,
            self._stopping,
            logger=logger,
            describe=lambda: f"{self.me}: SWIM period {self.periods}",
        )

    async def _period(self, started: float) -> None:
        """One protocol period begun at loop time ``started``: expire suspicions, now
        and then ping a DEAD member, probe the next target."""
        self.periods += 1
        self._expire_suspicions()
        every = self.config.dead_probe_periods
        if every and self.periods % every == 0:
            self._probe_dead()
        target = self._next_target()
        if target is not None:
            await self._probe(target, started)
        self._expire_suspicions()
