"""SWIM membership: failure detection and infection-style dissemination.

This module implements the protocol of Das, Gupta and Motivala, *SWIM: Scalable
Weakly-consistent Infection-style Process Group Membership Protocol* (DSN 2002),
with a few refinements from HashiCorp memberlist:

* **Failure detector (SWIM §3.1).** Every protocol period ``T'`` (``period_s``) a
  member pings one target. Without an ack within ``ping_timeout_s`` it asks
  ``indirect_k`` other members to ``ping-req`` the target; if none of them reports an
  ack by the end of the period, the target becomes SUSPECT.
* **Round-robin probe order (SWIM §4.3).** Targets are probed in a random
  permutation that is re-drawn at the end of every cycle, so each member is probed
  once per cycle and detection time is bounded, not only expected.
* **Suspicion (SWIM §4.2).** A SUSPECT member is declared DEAD when its suspicion
  times out (``suspicion_mult * max(1, log10 n) * period_s``, memberlist's rule)
  unless it refutes first. Every member that hears of a suspicion runs its own timer.
  The suspect refutes by raising its incarnation number and spreading ``alive``.
* **Dissemination (SWIM §4.1).** Updates ride piggy-backed on ping, ack and
  ping-req payloads, at most ``piggyback_max`` per message, each one sent at most
  ``retransmit_mult * ceil(log10(n + 1))`` times (memberlist's retransmit limit),
  least-sent first.
* **Precedence.** An update ``(status, incarnation)`` replaces the current one when
  ``(incarnation, rank)`` is larger, with ranks ALIVE < SUSPECT < DEAD < LEFT. This
  is SWIM's rule set: a suspicion overrides ``alive`` of the same incarnation, only a
  higher incarnation overrides a suspicion, death or departure, and a confirmation
  of death at an incarnation is final for that incarnation.
* **Healing partitions and rejoining.** Every message carries the sender's own
  incarnation (signed by the envelope), and a message to a member we hold SUSPECT,
  DEAD or LEFT leads with that belief so the member can refute at once (a restarted
  member starts at incarnation 0 and so learns which incarnation to exceed). Every
  ``dead_probe_periods`` periods a member pings one random DEAD member, so two
  sides of a healed partition (or a restarted member) find each other again.

Members of the federation are fixed by the manifest (``update_members`` follows its
changes); this protocol only says which of them are up. Message kinds are
``swim.ping`` (reply: ack) and ``swim.ping_req`` (reply: the indirect probe's
outcome), in stage ``"swim"``. Payloads are canonical JSON; a payload that does not
decode is refused with ``RefusalReason.MALFORMED`` and counted, never a crash.

Threat model: peers are honest-but-curious (``docs/SECURITY.md``); a member's claims
about *other* members are trusted as in SWIM, while its claims about itself are
authenticated by the envelope signature.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import RefusalReason, Refused, TransportError
from coordinator_free.periodic import run_periodically
from coordinator_free.validate import check_integer, check_keys, check_number, field_error
from coordinator_free.wire import Envelope

__all__ = [
    "PING",
    "PING_REQ",
    "STAGE",
    "EventKind",
    "MemberState",
    "MemberStatus",
    "Membership",
    "MembershipEvent",
    "SwimConfig",
    "SwimMessage",
    "Update",
    "decode_message",
    "encode_message",
]

logger = logging.getLogger(__name__)

PING = "swim.ping"
PING_REQ = "swim.ping_req"
STAGE = "swim"


class MemberStatus(StrEnum):
    """What a member's view says about another member (SWIM §4.2)."""

    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


_RANK: dict[MemberStatus, int] = {
    MemberStatus.ALIVE: 0,
    MemberStatus.SUSPECT: 1,
    MemberStatus.DEAD: 2,
    MemberStatus.LEFT: 3,
}
_BY_RANK: dict[int, MemberStatus] = {rank: status for status, rank in _RANK.items()}


class EventKind(StrEnum):
    """A change in one member's status, as seen by the local view."""

    JOIN = "join"  # added to the federation, or back from DEAD/LEFT
    ALIVE = "alive"  # a suspicion was refuted
    SUSPECT = "suspect"
    DEAD = "dead"
    LEAVE = "leave"  # left gracefully


@dataclass(frozen=True)
class MemberState:
    """One member in the local view.

    org_id: the member.
    status: ALIVE, SUSPECT, DEAD or LEFT.
    incarnation: the member's incarnation number the status refers to.
    last_seen: ``clock()`` time of the last message received from the member, or None.
    rtt: seconds of the last direct ping round trip to the member, or None.
    since: ``clock()`` time of the last status change.
    """

    org_id: str
    status: MemberStatus
    incarnation: int
    last_seen: float | None
    rtt: float | None
    since: float


@dataclass(frozen=True)
class MembershipEvent:
    """A status change delivered to subscribers (``Membership.subscribe``)."""

    kind: EventKind
    org_id: str
    incarnation: int
    at: float


@dataclass(frozen=True)
class Update:
    """A disseminated claim: ``org_id`` has ``status`` at ``incarnation``."""

    org_id: str
    status: MemberStatus
    incarnation: int

    def supersedes(self, status: MemberStatus, incarnation: int) -> bool:
        """SWIM's precedence rules as one lexicographic comparison (module docstring)."""
        return (self.incarnation, _RANK[self.status]) > (incarnation, _RANK[status])


_bad = field_error(ValueError)
_mistyped = field_error(TypeError)


@dataclass(frozen=True)
class SwimConfig:
    """Timing and dissemination parameters of the SWIM protocol.

    period_s: the protocol period T' (SWIM §3.1); one probe per period.
    ping_timeout_s: how long a direct ping waits for its ack; below ``period_s / 2``
        so the indirect probes fit in the rest of the period.
    indirect_k: how many members are asked to ping-req a target that missed its ack.
    suspicion_mult: suspicion timeout, in periods, per ``max(1, log10 n)``.
    retransmit_mult: each update is piggy-backed at most
        ``retransmit_mult * ceil(log10(n + 1))`` times by each member (lambda log n).
    piggyback_max: most updates carried by one message.
    dead_probe_periods: every that many periods, one random DEAD member is pinged so
        healed partitions and restarted members converge; 0 disables it.
    """

    period_s: float = 1.0
    ping_timeout_s: float = 0.3
    indirect_k: int = 3
    suspicion_mult: float = 4.0
    retransmit_mult: int = 4
    piggyback_max: int = 8
    dead_probe_periods: int = 3

    def __post_init__(self) -> None:
        for name in ("period_s", "ping_timeout_s", "suspicion_mult"):
            check_number(f"SwimConfig.{name}", getattr(self, name), _bad, type_error=_mistyped)
        for name, low in (
            ("indirect_k", 0),
            ("retransmit_mult", 1),
            ("piggyback_max", 1),
            ("dead_probe_periods", 0),
        ):
            check_integer(
                f"SwimConfig.{name}", getattr(self, name), _bad, low=low, type_error=_mistyped
            )
        if self.ping_timeout_s * 2 > self.period_s:
            raise ValueError(
                f"SwimConfig.ping_timeout_s ({self.ping_timeout_s}) must be at most half of "
                f"period_s ({self.period_s}) so that indirect probes fit in the period"
            )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> SwimConfig:
        """Build a config from a mapping, refusing unknown keys."""
        return cls(**check_keys(cls, values, "SwimConfig", _bad))

    def suspicion_timeout(self, n: int) -> float:
        """Seconds a suspicion lasts before the member is declared DEAD, for n members."""
        return self.suspicion_mult * max(1.0, math.log10(max(n, 1))) * self.period_s

    def retransmit_limit(self, n: int) -> int:
        """How many times each member piggy-backs one update, for n members."""
        return self.retransmit_mult * max(1, math.ceil(math.log10(n + 1)))


@dataclass
class _Member:
    status: MemberStatus
    incarnation: int
    since: float
    last_seen: float | None = None
    rtt: float | None = None
    suspect_deadline: float | None = None


class _Broadcasts:
    """Updates waiting to be piggy-backed, least-transmitted first (memberlist's
    TransmitLimitedQueue). A newer update about a member replaces the older one."""

    def __init__(self) -> None:
        self._items: dict[str, list[Any]] = {}  # org -> [Update, transmits]

    def __len__(self) -> int:
        return len(self._items)

    def put(self, update: Update) -> None:
        self._items[update.org_id] = [update, 0]

    def take(self, max_n: int, limit: int) -> list[Update]:
        if not self._items:
            return []
        chosen = sorted(self._items.values(), key=lambda item: item[1])[:max_n]
        out: list[Update] = []
        for item in chosen:
            update: Update = item[0]
            out.append(update)
            item[1] += 1
            if item[1] >= limit:
                del self._items[update.org_id]
        return out


@dataclass(frozen=True)
class SwimMessage:
    """A decoded SWIM payload.

    incarnation: the sender's own incarnation (it is alive at least at this one).
    updates: piggy-backed updates.
    target: the member to probe (``swim.ping_req`` only).
    ok: whether the indirect probe got an ack (``swim.ping_req`` replies only).
    """

    incarnation: int
    updates: tuple[Update, ...]
    target: str | None = None
    ok: bool | None = None


def encode_message(
    incarnation: int,
    updates: Iterable[Update],
    *,
    target: str | None = None,
    ok: bool | None = None,
) -> bytes:
    """Canonical JSON payload of a SWIM message (see :func:`decode_message`)."""
    body: dict[str, Any] = {
        "i": incarnation,
        "u": [[u.org_id, _RANK[u.status], u.incarnation] for u in updates],
    }
    if target is not None:
        body["t"] = target
    if ok is not None:
        body["ok"] = ok
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def _is_uint(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def decode_message(payload: bytes, *, max_updates: int = 1024) -> SwimMessage:
    """Decode a SWIM payload; raise ``Refused(MALFORMED)`` on anything unexpected.

    Payload: canonical JSON ``{"i": incarnation, "u": [[org, rank, incarnation], ...],
    "t": target?, "ok": outcome?}`` with ranks 0 alive, 1 suspect, 2 dead, 3 left.
    """
    try:
        body = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        raise Refused(RefusalReason.MALFORMED, "SWIM payload is not JSON") from None
    if not isinstance(body, dict) or not set(body) <= {"i", "u", "t", "ok"}:
        raise Refused(RefusalReason.MALFORMED, "SWIM payload has unexpected fields")
    incarnation, raw_updates = body.get("i"), body.get("u")
    if not _is_uint(incarnation) or not isinstance(raw_updates, list):
        raise Refused(RefusalReason.MALFORMED, "SWIM payload lacks incarnation or updates")
    if len(raw_updates) > max_updates:
        raise Refused(RefusalReason.MALFORMED, "too many SWIM updates")
    updates: list[Update] = []
    for item in raw_updates:
        if (
            not isinstance(item, list)
            or len(item) != 3
            or not isinstance(item[0], str)
            or item[1] not in _BY_RANK
            or isinstance(item[1], bool)
            or not _is_uint(item[2])
        ):
            raise Refused(RefusalReason.MALFORMED, "bad SWIM update")
        updates.append(Update(item[0], _BY_RANK[item[1]], item[2]))
    target, ok = body.get("t"), body.get("ok")
    if target is not None and not isinstance(target, str):
        raise Refused(RefusalReason.MALFORMED, "bad ping-req target")
    if ok is not None and not isinstance(ok, bool):
        raise Refused(RefusalReason.MALFORMED, "bad ping-req outcome")
    assert isinstance(incarnation, int)
    return SwimMessage(incarnation, tuple(updates), target, ok)


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
        self._members: dict[str, _Member] = {
            m: _Member(MemberStatus.ALIVE, 0, now) for m in sorted(set(members)) if m != self.me
        }
        self._broadcasts = _Broadcasts()
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
        tasks = [t for t in (self._task, *self._side_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
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
            org: MemberState(org, m.status, m.incarnation, m.last_seen, m.rtt, m.since)
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
            self._members[org] = _Member(MemberStatus.ALIVE, 0, now)
            self._emit(EventKind.JOIN, org, 0, now)

    # ------------------------------------------------------------------ rules

    def _n(self) -> int:
        return len(self._members) + 1

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
            member.suspect_deadline = now + self.config.suspicion_timeout(self._n())
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

    def _receive(self, env: Envelope) -> SwimMessage:
        try:
            message = decode_message(env.payload, max_updates=max(self.config.piggyback_max, 64))
        except Refused:
            self.counters["malformed"] += 1
            raise
        self._heard_from(env.sender, message.incarnation)
        for update in message.updates:
            self._apply(update)
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

    async def _ping(self, target: str, timeout: float | None = None) -> bool:
        """Ping ``target`` directly; True on an ack."""
        self.counters["pings"] += 1
        started = time.perf_counter()
        payload = encode_message(self._incarnation, self._outgoing(target))
        try:
            reply = await self._send(target, PING, payload, timeout or self.config.ping_timeout_s)
            message = decode_message(reply, max_updates=max(self.config.piggyback_max, 64))
        except (TransportError, Refused):
            return False
        member = self._members.get(target)
        if member is not None:
            member.rtt = time.perf_counter() - started
        self._heard_from(target, message.incarnation)
        for update in message.updates:
            self._apply(update)
        return True

    async def _ping_req(self, helper: str, target: str, timeout: float) -> bool:
        """Ask ``helper`` to probe ``target`` for us (SWIM §3.1); True on an ack."""
        self.counters["ping_reqs"] += 1
        payload = encode_message(self._incarnation, self._outgoing(helper), target=target)
        try:
            reply = await self._send(helper, PING_REQ, payload, timeout)
            message = decode_message(reply, max_updates=max(self.config.piggyback_max, 64))
        except (TransportError, Refused):
            return False
        self._heard_from(helper, message.incarnation)
        for update in message.updates:
            self._apply(update)
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
        """One SWIM probe: direct ping, then indirect ping-req through k helpers."""
        if await self._ping(target):
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
            remaining = self.config.period_s - (loop.time() - started)
            timeout = max(remaining, self.config.ping_timeout_s)
            results = await asyncio.gather(*(self._ping_req(h, target, timeout) for h in chosen))
            if any(results):
                return
        member = self._members.get(target)
        if member is not None and member.status is MemberStatus.ALIVE:
            self._apply(Update(target, MemberStatus.SUSPECT, member.incarnation))

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
        """A protocol period every ``config.period_s`` until :meth:`stop`; a bug in one
        period is logged and does not stop failure detection."""
        await run_periodically(
            self._period,
            lambda: self.config.period_s,
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
