"""Epidemic broadcast of signed records over the SWIM membership.

Each record is a small byte string published by one org under a ``(topic, key)``
(``ready`` messages, model hashes, view hashes, audit chain heads). The origin signs
it with its :class:`~coordinator_free.identity.OrgIdentity`; every receiver verifies
the signature against the manifest's key for the origin before it stores or forwards
the record, so no relay can forge or alter one. A record that fails verification is
dropped and counted (``counters["forged"]``).

Dissemination is push gossip in rounds (Demers et al., *Epidemic Algorithms for
Replicated Database Maintenance*, PODC 1987; the "infection-style" dissemination of
SWIM §4.1): every ``period_s`` a member sends the records it is still spreading to
``fanout`` random ALIVE members; each record is pushed in at most
``ceil(retransmit_mult * log2(n + 1))`` rounds by each member, least-pushed first. A
record thus reaches every live member in O(log n) periods with high probability.
A member that comes back (a healed partition, a restart, a refuted suspicion) is
sent the whole store by about ``fanout`` members, since push rounds alone never
reach a member that was away while a record's retransmissions were spent.

Records are deduplicated by their digest, the SHA-256 of their signing bytes (which
bind federation, origin, topic, key and record). Two different records signed by one
origin for the same ``(topic, key)`` are an *equivocation*: the first is kept as the
value, every distinct one is kept as evidence (:meth:`Gossip.equivocations`) and
forwarded, so every member learns of it; the round engine uses this to detect split
views. Memory is bounded: at most ``max_records_per_topic`` ``(origin, key)`` entries
per topic and ``max_topics`` topics (oldest evicted first), and entries expire
``ttl_s`` after they were first received.

Signing bytes of a record (all lengths big-endian)::

    b"fedweave/gossip-record/v1\\x00"
    federation, origin, topic, key : u16 length + UTF-8
    record : u32 length + bytes

Push payload (``gossip.push``, stage ``"gossip"``): u16 count, then per record
origin, topic, key (u16 length + UTF-8), record (u32 length + bytes), signature
(u16 length + bytes). A payload that does not decode is refused with
``RefusalReason.MALFORMED`` and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import random
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import CoordinatorFreeError, RefusalReason, Refused, TransportError
from coordinator_free.identity import OrgIdentity, verify_signature
from coordinator_free.membership import EventKind, Membership, MembershipEvent
from coordinator_free.periodic import run_periodically
from coordinator_free.validate import check_integer, check_keys, check_number, field_error
from coordinator_free.wire import Envelope

__all__ = [
    "PUSH",
    "STAGE",
    "Equivocation",
    "Gossip",
    "GossipConfig",
    "RecordConflict",
    "SignedRecord",
    "decode_records",
    "encode_records",
    "record_signing_bytes",
]

logger = logging.getLogger(__name__)

PUSH = "gossip.push"
STAGE = "gossip"
SIGNING_DOMAIN = b"fedweave/gossip-record/v1\x00"
MAX_NAME_BYTES = 1024
"""Longest origin, topic or key, in UTF-8 bytes."""


class RecordConflict(CoordinatorFreeError):
    """This org tried to publish a second, different record under one (topic, key)."""


def _name(value: str, what: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string")
    encoded = value.encode("utf-8")
    if len(encoded) > MAX_NAME_BYTES:
        raise ValueError(f"{what} is longer than {MAX_NAME_BYTES} bytes")
    return encoded


def record_signing_bytes(
    federation: str, origin: str, topic: str, key: str, record: bytes
) -> bytes:
    """The bytes an origin signs for a record (module docstring); domain-separated."""
    encoded = [
        federation.encode("utf-8"),
        _name(origin, "origin"),
        _name(topic, "topic"),
        _name(key, "key"),
    ]
    parts = [SIGNING_DOMAIN]
    for value in encoded:
        parts.append(struct.pack(">H", len(value)))
        parts.append(value)
    parts.append(struct.pack(">I", len(record)))
    parts.append(record)
    return b"".join(parts)


@dataclass(frozen=True)
class SignedRecord:
    """A record and its origin's signature; ``digest`` identifies it."""

    origin: str
    topic: str
    key: str
    record: bytes
    signature: bytes
    digest: bytes = field(repr=False, compare=False, default=b"")
    """SHA-256 of the signing bytes; filled in by :meth:`sign` and :meth:`with_digest`."""

    @classmethod
    def sign(
        cls, identity: OrgIdentity, federation: str, topic: str, key: str, record: bytes
    ) -> SignedRecord:
        """A record published by ``identity`` (Ed25519 is deterministic)."""
        data = record_signing_bytes(federation, identity.org_id, topic, key, record)
        return cls(
            identity.org_id, topic, key, record, identity.sign(data), hashlib.sha256(data).digest()
        )

    def signing_bytes(self, federation: str) -> bytes:
        """The bytes the origin signed."""
        return record_signing_bytes(federation, self.origin, self.topic, self.key, self.record)

    def with_digest(self, federation: str) -> SignedRecord:
        """A copy carrying its digest in ``federation``."""
        digest = hashlib.sha256(self.signing_bytes(federation)).digest()
        return SignedRecord(self.origin, self.topic, self.key, self.record, self.signature, digest)

    def verify(self, federation: str, public_key: bytes) -> bool:
        """Whether the origin's ``public_key`` signed this record in ``federation``."""
        return verify_signature(public_key, self.signing_bytes(federation), self.signature)


@dataclass(frozen=True)
class Equivocation:
    """Evidence that ``origin`` signed several different records for one (topic, key)."""

    origin: str
    topic: str
    key: str
    records: tuple[SignedRecord, ...]


def encode_records(records: Iterable[SignedRecord]) -> bytes:
    """The ``gossip.push`` payload for ``records`` (module docstring)."""
    items = list(records)
    if len(items) > 0xFFFF:
        raise ValueError("at most 65535 records per message")
    parts = [struct.pack(">H", len(items))]
    for r in items:
        for value in (r.origin, r.topic, r.key):
            encoded = value.encode("utf-8")
            parts.append(struct.pack(">H", len(encoded)))
            parts.append(encoded)
        parts.append(struct.pack(">I", len(r.record)))
        parts.append(r.record)
        parts.append(struct.pack(">H", len(r.signature)))
        parts.append(r.signature)
    return b"".join(parts)


def decode_records(payload: bytes, *, max_record_bytes: int) -> list[SignedRecord]:
    """Decode a ``gossip.push`` payload; raise ``Refused(MALFORMED)`` on any defect.

    Returned records carry no digest yet (it depends on the federation).
    """
    view = memoryview(payload)
    pos = 0

    def take(n: int) -> bytes:
        nonlocal pos
        if n > len(view) - pos:
            raise Refused(RefusalReason.MALFORMED, "truncated gossip payload")
        chunk = bytes(view[pos : pos + n])
        pos += n
        return chunk

    def length(fmt: str) -> int:
        value: int = struct.unpack(fmt, take(struct.calcsize(fmt)))[0]
        return value

    out: list[SignedRecord] = []
    for _ in range(length(">H")):
        names: list[str] = []
        for what in ("origin", "topic", "key"):
            raw = take(length(">H"))
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise Refused(RefusalReason.MALFORMED, f"gossip {what} is not UTF-8") from None
            if not text or len(raw) > MAX_NAME_BYTES:
                raise Refused(RefusalReason.MALFORMED, f"bad gossip {what}")
            names.append(text)
        size = length(">I")
        if size > max_record_bytes:
            raise Refused(RefusalReason.MALFORMED, f"gossip record of {size} bytes")
        record = take(size)
        signature = take(length(">H"))
        out.append(SignedRecord(names[0], names[1], names[2], record, signature))
    if pos != len(view):
        raise Refused(RefusalReason.MALFORMED, "trailing bytes in gossip payload")
    return out


_bad = field_error(ValueError)
_mistyped = field_error(TypeError)


@dataclass(frozen=True)
class GossipConfig:
    """Parameters of the epidemic broadcast.

    period_s: seconds between push rounds.
    fanout: members pushed to in each round.
    retransmit_mult: each record is pushed in ``ceil(retransmit_mult * log2(n + 1))``
        rounds by each member that holds it (the ``c log n`` of epidemic broadcast).
    max_records_per_message: most records in one push.
    max_record_bytes: largest record accepted (larger ones are refused).
    max_records_per_topic: most (origin, key) entries kept per topic.
    max_topics: most topics kept.
    max_conflicts: most distinct records kept per (origin, topic, key) as evidence.
    ttl_s: seconds an entry is kept after it was first received.
    push_timeout_s: timeout of one push request (a round lasts at least as long as
        its slowest push).
    """

    period_s: float = 0.5
    fanout: int = 3
    retransmit_mult: float = 2.0
    max_records_per_message: int = 64
    max_record_bytes: int = 64 << 10
    max_records_per_topic: int = 4096
    max_topics: int = 1024
    max_conflicts: int = 4
    ttl_s: float = 3600.0
    push_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("period_s", "retransmit_mult", "ttl_s", "push_timeout_s"):
            check_number(f"GossipConfig.{name}", getattr(self, name), _bad, type_error=_mistyped)
        for name in (
            "fanout",
            "max_records_per_message",
            "max_record_bytes",
            "max_records_per_topic",
            "max_topics",
            "max_conflicts",
        ):
            check_integer(
                f"GossipConfig.{name}", getattr(self, name), _bad, low=1, type_error=_mistyped
            )
        if self.max_conflicts < 2:
            raise ValueError("GossipConfig.max_conflicts must be at least 2 (one conflict)")
        if self.max_records_per_message > 0xFFFF:
            raise ValueError("GossipConfig.max_records_per_message must fit in 16 bits")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> GossipConfig:
        """Build a config from a mapping, refusing unknown keys."""
        return cls(**check_keys(cls, values, "GossipConfig", _bad))

    def retransmit_limit(self, n: int) -> int:
        """Rounds in which each member pushes one record, for n members."""
        return max(1, math.ceil(self.retransmit_mult * math.log2(n + 1)))


@dataclass
class _Entry:
    records: list[SignedRecord]  # first is the value; more are equivocation evidence
    received_at: float


class Gossip:
    """Epidemic broadcast of signed records for one member.

    Build with :meth:`create`; publish with :meth:`publish`; read with :meth:`get`,
    :meth:`records`, :meth:`equivocations`; follow with :meth:`subscribe`; end with
    :meth:`stop`.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        membership: Membership,
        config: GossipConfig,
        *,
        identity: OrgIdentity,
        federation: str,
        public_keys: Callable[[], Mapping[str, bytes]],
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = endpoint
        self.membership = membership
        self.config = config
        self.me = endpoint.org_id
        self._identity = identity
        self._federation = federation
        self._public_keys = public_keys
        self._rng = rng if rng is not None else random.Random()
        self._clock = clock
        self._topics: dict[str, dict[tuple[str, str], _Entry]] = {}
        self._seen: dict[bytes, float] = {}  # digest -> received_at, insertion-ordered
        self._pending: dict[bytes, list[Any]] = {}  # digest -> [record, rounds pushed]
        self._subscribers: dict[str, list[asyncio.Queue[SignedRecord]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._catchup: asyncio.Task[None] | None = None
        self._events: asyncio.Queue[MembershipEvent] | None = None
        self._running = False
        self._stopping = asyncio.Event()
        self.periods = 0
        """Push rounds run so far."""
        self.counters: Counter[str] = Counter()
        """accepted, duplicates, forged, malformed, equivocations, evicted, expired,
        pushes, push_failures, catchup_records."""

    @classmethod
    async def create(
        cls,
        endpoint: Endpoint,
        membership: Membership,
        config: GossipConfig | None = None,
        *,
        identity: OrgIdentity | None = None,
        public_keys: Callable[[], Mapping[str, bytes]] | None = None,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> Gossip:
        """Register ``gossip.push`` on ``endpoint`` and start the push rounds.

        ``identity`` signs this org's records (default: the endpoint's);
        ``public_keys`` maps org ids to Ed25519 keys from the manifest (default: the
        endpoint's member keys); ``rng`` picks push targets; ``clock`` ages entries.
        """
        self = cls(
            endpoint,
            membership,
            config or GossipConfig(),
            identity=identity or endpoint.identity,
            federation=endpoint.federation,
            public_keys=public_keys or endpoint.guard.members,
            rng=rng,
            clock=clock,
        )
        endpoint.on(PUSH, self._on_push)
        self._running = True
        self._task = asyncio.create_task(self._run(), name=f"gossip:{self.me}")
        self._events = membership.subscribe()
        self._catchup = asyncio.create_task(self._follow(), name=f"gossip-catchup:{self.me}")
        return self

    async def stop(self) -> None:
        """Stop pushing and refuse incoming pushes."""
        self._running = False
        self._stopping.set()
        if self._events is not None:
            self.membership.unsubscribe(self._events)
        for task in (self._task, self._catchup):
            if task is None:
                continue
            # cancel again if a cancellation was swallowed (asyncio.wait_for, 3.11)
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=0.1)
            with contextlib.suppress(asyncio.CancelledError):
                task.result()
        self._task = self._catchup = None

    # ------------------------------------------------------------------ public API

    def publish(self, topic: str, key: str, record: bytes) -> SignedRecord:
        """Sign ``record`` as this org's value for ``(topic, key)`` and spread it.

        Publishing the same record again is a no-op; a different record for a
        ``(topic, key)`` this org already published raises :class:`RecordConflict`.
        """
        if not isinstance(record, bytes):
            raise TypeError("a gossip record must be bytes")
        if len(record) > self.config.max_record_bytes:
            raise ValueError(
                f"record of {len(record)} bytes exceeds max_record_bytes "
                f"({self.config.max_record_bytes})"
            )
        signed = SignedRecord.sign(self._identity, self._federation, topic, key, record)
        entry = self._topics.get(topic, {}).get((self.me, key))
        if entry is not None:
            if entry.records[0].digest == signed.digest:
                return entry.records[0]
            raise RecordConflict(
                f"{self.me!r} already published a different record for ({topic!r}, {key!r})"
            )
        self._accept(signed)
        return signed

    def get(self, topic: str, key: str) -> dict[str, bytes]:
        """The value each origin published for ``(topic, key)``: origin -> record."""
        entries = self._topics.get(topic, {})
        return {
            origin: entry.records[0].record
            for (origin, k), entry in sorted(entries.items())
            if k == key
        }

    def records(self, topic: str) -> list[SignedRecord]:
        """Every stored value in ``topic`` (first record per origin and key)."""
        return [e.records[0] for _, e in sorted(self._topics.get(topic, {}).items())]

    def equivocations(self, topic: str | None = None) -> list[Equivocation]:
        """Every (origin, topic, key) with more than one distinct signed record."""
        topics = [topic] if topic is not None else sorted(self._topics)
        out: list[Equivocation] = []
        for t in topics:
            for (origin, key), entry in sorted(self._topics.get(t, {}).items()):
                if len(entry.records) > 1:
                    out.append(Equivocation(origin, t, key, tuple(entry.records)))
        return out

    def subscribe(self, topic: str) -> asyncio.Queue[SignedRecord]:
        """A queue receiving each new value in ``topic`` (own records included) and
        each new conflicting record (compare ``origin`` and ``key`` to spot one)."""
        queue: asyncio.Queue[SignedRecord] = asyncio.Queue()
        self._subscribers.setdefault(topic, []).append(queue)
        return queue

    def unsubscribe(self, topic: str, queue: asyncio.Queue[SignedRecord]) -> None:
        """Stop delivering ``topic`` to ``queue``."""
        with contextlib.suppress(KeyError, ValueError):
            self._subscribers[topic].remove(queue)

    # ------------------------------------------------------------------ receiving

    def _accept(self, record: SignedRecord) -> bool:
        """Store a verified record; False if it was a duplicate or evidence overflow."""
        if record.digest in self._seen:
            self.counters["duplicates"] += 1
            return False
        now = self._clock()
        entries = self._topics.get(record.topic)
        if entries is None:
            if len(self._topics) >= self.config.max_topics:
                oldest = min(
                    self._topics,
                    key=lambda t: max((e.received_at for e in self._topics[t].values()), default=0),
                )
                self.counters["evicted"] += len(self._topics.pop(oldest))
            entries = self._topics[record.topic] = {}
        slot = (record.origin, record.key)
        entry = entries.get(slot)
        if entry is None:
            if len(entries) >= self.config.max_records_per_topic:
                victim = min(entries, key=lambda s: entries[s].received_at)
                del entries[victim]
                self.counters["evicted"] += 1
            entries[slot] = _Entry([record], now)
        else:
            if len(entry.records) >= self.config.max_conflicts:
                self._seen[record.digest] = now
                return False
            entry.records.append(record)
            self.counters["equivocations"] += 1
            logger.warning(
                "%s: %s signed conflicting records for (%r, %r)",
                self.me,
                record.origin,
                record.topic,
                record.key,
            )
        self._seen[record.digest] = now
        self._pending[record.digest] = [record, 0]
        self.counters["accepted"] += 1
        for queue in self._subscribers.get(record.topic, ()):
            queue.put_nowait(record)
        return True

    async def _on_push(self, env: Envelope) -> bytes:
        if not self._running:
            raise Refused(RefusalReason.NO_HANDLER, "gossip stopped")
        try:
            records = decode_records(env.payload, max_record_bytes=self.config.max_record_bytes)
        except Refused:
            self.counters["malformed"] += 1
            raise
        if len(records) > self.config.max_records_per_message:
            self.counters["malformed"] += 1
            raise Refused(RefusalReason.MALFORMED, "too many records in one push")
        keys = self._public_keys()
        for raw in records:
            record = raw.with_digest(self._federation)
            if record.digest in self._seen:
                self.counters["duplicates"] += 1
                continue
            key = keys.get(record.origin)
            if key is None or not record.verify(self._federation, key):
                self.counters["forged"] += 1
                logger.warning(
                    "%s: dropped a record for (%r, %r) not signed by its origin %r (via %s)",
                    self.me,
                    record.topic,
                    record.key,
                    record.origin,
                    env.sender,
                )
                continue
            self._accept(record)
        return b""

    # ------------------------------------------------------------------ pushing

    def _expire(self) -> None:
        cutoff = self._clock() - self.config.ttl_s
        while self._seen:
            digest, at = next(iter(self._seen.items()))
            if at > cutoff:
                break
            del self._seen[digest]
            self._pending.pop(digest, None)
        for topic in list(self._topics):
            entries = self._topics[topic]
            for slot in [s for s, e in entries.items() if e.received_at <= cutoff]:
                del entries[slot]
                self.counters["expired"] += 1
            if not entries:
                del self._topics[topic]

    def _batch(self, limit: int) -> list[SignedRecord]:
        if not self._pending:
            return []
        chosen = sorted(self._pending.items(), key=lambda kv: kv[1][1])
        out: list[SignedRecord] = []
        for digest, item in chosen[: self.config.max_records_per_message]:
            out.append(item[0])
            item[1] += 1
            if item[1] >= limit:
                del self._pending[digest]
        return out

    async def _push(self, peer: str, payload: bytes) -> None:
        self.counters["pushes"] += 1
        try:
            await self.endpoint.send(
                peer, PUSH, payload, stage=STAGE, timeout=self.config.push_timeout_s
            )
        except TransportError:
            self.counters["push_failures"] += 1

    async def _round(self) -> None:
        self._expire()
        peers = [p for p in self.membership.live(include_suspect=False) if p != self.me]
        if not peers or not self._pending:
            return
        limit = self.config.retransmit_limit(self.membership.size)
        batch = self._batch(limit)
        payload = encode_records(batch)
        targets = self._rng.sample(peers, min(self.config.fanout, len(peers)))
        await asyncio.gather(*(self._push(p, payload) for p in targets))

    async def _send_all(self, peer: str) -> None:
        """Push every stored record (values and evidence) to ``peer``, in batches."""
        stored = [
            r for entries in self._topics.values() for e in entries.values() for r in e.records
        ]
        size = self.config.max_records_per_message
        for i in range(0, len(stored), size):
            batch = stored[i : i + size]
            try:
                await self.endpoint.send(
                    peer,
                    PUSH,
                    encode_records(batch),
                    stage=STAGE,
                    timeout=self.config.push_timeout_s,
                )
            except TransportError:
                self.counters["push_failures"] += 1
                return
            self.counters["catchup_records"] += len(batch)

    async def _follow(self) -> None:
        """Anti-entropy for members that come back (a healed partition, a restart).

        Push rounds stop once a record's retransmit limit is spent, so a member that
        was unreachable meanwhile would never get it (nor is a SUSPECT member a push
        target). When the membership reports a JOIN (a member back from DEAD or LEFT)
        or ALIVE (a refuted suspicion), each member that sees it sends the returning
        member its whole store with probability ``fanout / live``, so about ``fanout``
        members do so.
        """
        assert self._events is not None
        while self._running:
            event = await self._events.get()
            if event.kind not in (EventKind.JOIN, EventKind.ALIVE) or event.org_id == self.me:
                continue
            live = max(1, len(self.membership.live(include_suspect=False)) - 1)
            if self._rng.random() < min(1.0, self.config.fanout / live):
                await self._send_all(event.org_id)

    async def _run(self) -> None:
        """A push round every ``config.period_s`` until :meth:`stop`; a failed round is
        logged and does not stop the broadcast."""
        await run_periodically(
            self._period,
            lambda: self.config.period_s,
            self._stopping,
            logger=logger,
            describe=lambda: f"{self.me}: gossip round {self.periods}",
        )

    async def _period(self, started: float) -> None:
        self.periods += 1
        await self._round()
