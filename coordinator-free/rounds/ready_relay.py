"""Stage 1's readies relayed: ``O(log n)`` messages per node instead of ``n - 1``.

``docs/ARCHITECTURE.md``, "A round", step 1. From ``RoundConfig.ready_relay_from``
members on, a node does not send its ``ready`` to every member: it signs it once as a
**ready record** (its org, and the ready's bytes, under a signature bound to the
federation, run and round, :func:`record_signing_bytes`) and the records spread by
recursive doubling over the round's ring order of ``U0`` (``round.readies``): at step
``i`` a node sends every record it holds to the member ``2**i`` places after it and
waits for the member ``2**i`` places before it, so after ``ceil(log2 n)`` steps each
holds every record, for ``ceil(log2 n)`` requests (and as many replies) per node. The
reply carries the receiver's own record.

A relay can withhold a record, never forge or change one: each record is checked
against its author's key before it is filed (a record whose author is the envelope's
sender is authenticated by the envelope), and one relayed for another federation, run
or round fails that check. The check is the author's Ed25519 signature, or, once the
receiver learned the author's record key from a record whose signature it verified,
the author's MAC tag for this receiver (:mod:`~coordinator_free.rounds.record_keys`):
a hash and a MAC instead of a verification, for every record after the first. A copy
carries only the tags of the members it reaches from the step it is sent at (the
receiver and those ``2 * 2**i``, ``4 * 2**i``, ... places after it), about ``n / 2``
entries a step per node instead of ``n - 1`` per record, and a record goes at the
steps after the one whose sender put it on schedule (:func:`_on_schedule`), so that
each member's first copy carries its tag. Two
valid records of one author with different bytes are an equivocation, as two
different direct readies are (:meth:`~coordinator_free.rounds.exchange.PairwiseExchange.file`). A
member whose record did not arrive by the last step (a relay died, or a member is
late) is asked directly by the pairwise ``round.ready`` of
:mod:`~coordinator_free.rounds.ready`, so ``U0`` stays what it was: the readies this
node saw by the deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.rounds.ahead import kept_blobs
from coordinator_free.rounds.config import patience
from coordinator_free.rounds.context import StageContext
from coordinator_free.rounds.messenger import Messenger
from coordinator_free.rounds.record_keys import RecordKeys, kept_entries
from coordinator_free.rounds.state import RoundState, RoundTable
from coordinator_free.rounds.unmask import await_from
from coordinator_free.rounds.wire import KIND_READIES
from coordinator_free.wire import Envelope

__all__ = [
    "RECORDS",
    "ReadyRecord",
    "ReadyRelay",
    "Verify",
    "blobs_key",
    "decode_batch",
    "encode_batch",
    "record_signing_bytes",
]

READY = ("ready",)
RECORDS = ("ready", "record")
"""The inbox key of the signed ready records (their heads), by author."""


def _tags(author: str) -> tuple[str, ...]:
    """The inbox key of the tag entries the copies of ``author``'s record came with,
    by the member that relayed each (and charged to it)."""
    return ("ready", "tags", author)


def blobs_key(author: str) -> tuple[str, ...]:
    """The inbox key of the blobs that came with ``author``'s ready, by the member that
    brought each copy (a relay, or the author itself in a direct ready)."""
    return ("ready", "blobs", author)


OWED = ("ready", "owed")
"""The inbox key of the members whose direct ready this node answered empty."""

SIGNING_DOMAIN = b"fedweave/ready-record/v2\x00"
_HEAD = struct.Struct(">BH")  # step, count
_MAX_STEP = 64

Sign = Callable[[bytes], bytes]
Verify = Callable[[str, bytes, bytes], bool]


def _text(value: str) -> bytes:
    raw = value.encode("utf-8")
    return struct.pack(">H", len(raw)) + raw


def record_signing_bytes(
    federation: str, run: str, round: int, author: str, ready: bytes, key: bytes = b""
) -> bytes:
    """What an author signs for its ready record: domain-separated, bound to the
    federation, run and round, with the author's record key (none: empty)."""
    return b"".join(
        (
            SIGNING_DOMAIN,
            _text(federation),
            _text(run),
            struct.pack(">Q", round),
            _text(author),
            struct.pack(">I", len(ready)),
            ready,
            _text_bytes(key),
        )
    )


@dataclass(frozen=True)
class ReadyRecord:
    """One author's signed ready (its core, :meth:`~coordinator_free.rounds.ahead.Ready.core`),
    its record key (none: empty), its tags for the receivers whose record keys it
    knows, and the blobs of its shares sealed ahead. ``head`` is its encoding up to
    the tags: what every copy of the record shares, as relays pass on only the tags
    and blobs of the members after them (:func:`with_tags`)."""

    author: str
    ready: bytes
    signature: bytes
    head: bytes
    key: bytes = b""
    tags: bytes = b""
    blobs: bytes = b""

    @classmethod
    def make(
        cls,
        author: str,
        ready: bytes,
        signature: bytes,
        key: bytes = b"",
        tags: bytes = b"",
        blobs: bytes = b"",
    ) -> ReadyRecord:
        head = b"".join(
            [
                _text(author),
                struct.pack(">I", len(ready)),
                ready,
                _text_bytes(signature),
                _text_bytes(key),
            ]
        )
        return cls(author, ready, signature, head, key, tags, blobs)

    @property
    def raw(self) -> bytes:
        """The record's encoding, as relayed, with all its tags and blobs."""
        return with_tags(self.head, self.tags, self.blobs)


def with_tags(head: bytes, tags: bytes, blobs: bytes = b"") -> bytes:
    """A record's encoding from its ``head`` and the tag entries and blobs it carries."""
    return head + _U32.pack(len(tags)) + tags + _U32.pack(len(blobs)) + blobs


def _text_bytes(data: bytes) -> bytes:
    return struct.pack(">H", len(data)) + data


def encode_batch(step: int, records: list[bytes]) -> bytes:
    """A ``round.readies`` payload: the step and the records (their ``raw`` bytes)."""
    return _HEAD.pack(step, len(records)) + b"".join(records)


def _field(data: bytes, pos: int, size: struct.Struct) -> tuple[bytes, int]:
    """The length-prefixed field at ``pos`` (its length packed as ``size``) and the
    position after it; ``ValueError`` when the data ends inside it."""
    (n,) = size.unpack_from(data, pos)
    start = pos + size.size
    if start + n > len(data):
        raise ValueError("truncated record")
    return data[start : start + n], start + n


_U16, _U32 = struct.Struct(">H"), struct.Struct(">I")


def decode_batch(data: bytes) -> tuple[int, list[ReadyRecord]]:
    """The step and records of a ``round.readies`` payload; ``ValueError`` on anything
    malformed (a truncated record, trailing bytes, a step past any federation's)."""
    try:
        step, count = _HEAD.unpack_from(data, 0)
        pos = _HEAD.size
        records: list[ReadyRecord] = []
        for _ in range(count):
            start = pos
            author, pos = _field(data, pos, _U16)
            ready, pos = _field(data, pos, _U32)
            signature, pos = _field(data, pos, _U16)
            key, pos = _field(data, pos, _U16)
            head = data[start:pos]
            tags, pos = _field(data, pos, _U32)
            blobs, pos = _field(data, pos, _U32)
            records.append(
                ReadyRecord(author.decode("utf-8"), ready, signature, head, key, tags, blobs)
            )
    except (struct.error, UnicodeDecodeError) as exc:
        raise ValueError(f"malformed ready records: {exc}") from None
    if pos != len(data):
        raise ValueError("trailing bytes after the ready records")
    if step >= _MAX_STEP:
        raise ValueError(f"step {step} out of range")
    return step, records


def _on_schedule(
    state: RoundState,
    partners: set[str] | None,
    keep: frozenset[bytes],
    known: frozenset[bytes],
    holders: frozenset[int] = frozenset(),
) -> list[bytes]:
    """The records a step sends, each with the tag entries of the members it reaches
    from there (``keep``, and those of ids not in ``known``) and the blobs sealed for
    them (``holders``, their indices in ``U0``). Only the records on
    schedule go, those a copy of which came from one of ``partners``; ``None``: every
    record held. A record that reached this node early, by a later step than the one
    sent now, goes at its own step: passed on before it, it would carry no tag for
    the members it reached first, and cost each a signature check."""
    inbox, out = state.inbox, []
    for author, head in inbox.get(RECORDS).items():
        copies = inbox.get(_tags(author))
        if partners is None or not partners.isdisjoint(copies):
            tags = kept_entries(copies.values(), keep, known)
            blobs = kept_blobs(inbox.get(blobs_key(author)).values(), holders)
            out.append(with_tags(head, tags, blobs))
    return out


def _after(order: tuple[str, ...] | list[str], at: int, distance: int) -> list[str]:
    """The members a record sent at the step of ``distance`` to position ``at`` of
    ``order`` reaches: ``at`` itself and those the later steps (twice the distance
    and more) pass it on to, ``at + m * 2 * distance`` for every ``m`` below
    ``2**ceil(log2 n) / (2 * distance)``. Only their tags travel with it."""
    n = len(order)
    span = 1 << (n - 1).bit_length()
    return [order[(at + m * 2 * distance) % n] for m in range(span // (2 * distance))]


def _steps(n: int) -> Iterator[tuple[int, int]]:
    step, distance = 0, 1
    while distance < n:
        yield step, distance
        step, distance = step + 1, 2 * distance


class ReadyRelay:
    """The relayed readies of this node's rounds, and its handler of ``round.readies``."""

    def __init__(
        self, table: RoundTable, net: Messenger, federation: str, sign: Sign, verify: Verify
    ) -> None:
        self.table = table
        self.net = net
        self.federation = federation
        self.sign = sign
        self.verify = verify
        # this node's record key and those it learned: in its memory only
        self.keys = RecordKeys(federation, net.org_id)

    async def on_readies(self, env: Envelope) -> bytes:
        """A member's records at one step: each checked and filed; answered with this
        node's own record when it has one."""
        state = self.table.state(env.run, env.round, env.sender)
        try:
            step, records = decode_batch(env.payload)
        except ValueError as exc:
            raise Refused(RefusalReason.MALFORMED, str(exc)) from None
        self.take(state, env.sender, records)
        state.inbox.put(("ready", "step", str(step)), env.sender, b"")
        own = state.inbox.item(RECORDS, state.me)
        if own is None:
            return b""
        tags = state.inbox.item(_tags(state.me), state.me) or b""
        blobs = state.inbox.item(blobs_key(state.me), state.me) or b""
        return encode_batch(step, [with_tags(own, tags, blobs)])

    def take(self, state: RoundState, relayer: str, records: list[ReadyRecord]) -> int:
        """File the records of members not filed yet whose signature holds (a record
        relayed by its own author is authenticated by the envelope); returns how many
        were refused. An author with two valid, different readies equivocates."""
        refused = 0
        exchange = state.exchange(READY)
        for rec in records:
            if rec.author == state.me:
                continue
            held = state.inbox.item(RECORDS, rec.author)
            if held == rec.head:  # another copy of a record filed: its tags and blobs
                # are kept for the members after this one (a wrong tag only costs its
                # receiver a signature check, a wrong blob a direct ready), and who
                # relayed it puts it on schedule
                state.inbox.put(_tags(rec.author), relayer, rec.tags)
                state.inbox.put(blobs_key(rec.author), relayer, rec.blobs)
                continue
            if not self._authentic(state, relayer, rec):
                refused += 1
                self.net.observe(
                    "refused",
                    state.run,
                    state.round,
                    "ready",
                    peer=rec.author,
                    detail=f"a ready record relayed by {relayer} does not verify",
                )
                continue
            if held is None:
                state.inbox.put(RECORDS, rec.author, rec.head)
                state.inbox.put(_tags(rec.author), relayer, rec.tags)
                state.inbox.put(blobs_key(rec.author), relayer, rec.blobs)
            exchange.file(rec.author, rec.ready)
        return refused

    def _authentic(self, state: RoundState, relayer: str, rec: ReadyRecord) -> bool:
        """Whether ``rec`` is its author's: relayed by the author itself (the envelope
        authenticated it), or shown by the author's tag for this node, or by its
        signature. The record key of a record so authenticated is learned for its
        author, except from a tag (it is the one learned already)."""
        if rec.author == relayer:
            self.keys.learn(rec.author, rec.key)
            return True
        signing = record_signing_bytes(
            self.federation, state.run, state.round, rec.author, rec.ready, rec.key
        )
        if rec.tags and self.keys.check(
            rec.author, rec.key, hashlib.sha256(signing).digest(), rec.tags
        ):
            return True
        if not self.verify(rec.author, signing, rec.signature):
            return False
        self.keys.learn(rec.author, rec.key)
        return True

    def own_record(self, ctx: StageContext, ready: bytes, blobs: bytes = b"") -> bytes:
        """Sign this node's ready (its core) as a record, with its record key, a tag for
        every member whose record key it knows and its ``blobs`` (unsigned: their
        digests are in the core), and file it (it travels in every batch)."""
        key = self.keys.public
        signing = record_signing_bytes(self.federation, ctx.run, ctx.round, ctx.me, ready, key)
        tags = self.keys.tags(hashlib.sha256(signing).digest(), ctx.u0)
        record = ReadyRecord.make(ctx.me, ready, self.sign(signing), key, tags, blobs)
        ctx.state.inbox.put(RECORDS, ctx.me, record.head)
        ctx.state.inbox.put(_tags(ctx.me), ctx.me, record.tags)
        ctx.state.inbox.put(blobs_key(ctx.me), ctx.me, blobs)
        return record.raw

    async def spread(
        self, ctx: StageContext, ready: bytes, until: float, blobs: bytes = b""
    ) -> None:
        """Recursive doubling of the records over the ring order of ``U0``: at each step
        send the records on schedule to the member ``2**i`` places on, then wait (up
        to :func:`patience`, and never past ``until``, loop time) for the step's
        records from the member ``2**i`` places back. Once every member's ready is
        held, or a sender stays silent, the remaining steps go out at once: the
        members after this one still need them; after a silent sender, with every
        record held, on schedule or not."""
        self.own_record(ctx, ready, blobs)
        state = ctx.state
        order = state.ring_order(ctx.u0)
        n, here = len(order), order.index(ctx.me)
        loop = asyncio.get_running_loop()
        alive = ctx.believed_alive()
        u0 = set(ctx.u0)
        sends: list[asyncio.Future[set[str]]] = []
        waiting = True
        # the members whose copies of a record put it on schedule: the author itself,
        # and those this node met at an earlier step; None once a sender was silent
        partners: set[str] | None = {ctx.me}
        known = self.keys.ids(ctx.u0) | {self.keys.id}
        index = {org: i for i, org in enumerate(ctx.u0)}
        for step, distance in _steps(n):
            dest, src = order[(here + distance) % n], order[(here - distance) % n]
            reached = _after(order, here + distance, distance)
            keep = self.keys.ids(reached)
            holders = frozenset(index[o] for o in reached)
            batch = encode_batch(step, _on_schedule(state, partners, keep, known, holders))
            sends.append(asyncio.ensure_future(self._send(ctx, dest, batch)))
            if partners is not None:
                partners |= {dest, src}
            if waiting and u0 <= state.inbox.senders(READY):
                waiting = False
            if waiting:
                key = ("ready", "step", str(step))
                deadline = min(until, loop.time() + patience(ctx.config))
                if await await_from(state, key, src, deadline, alive) is None:
                    waiting, partners = False, None
                    ctx.observe("missing", "ready", peer=src, detail=f"no records at step {step}")
        await asyncio.gather(*sends)

    async def _send(self, ctx: StageContext, dest: str, batch: bytes) -> set[str]:
        def take(peer: str, data: bytes) -> None:
            try:
                _, records = decode_batch(data)
            except ValueError:
                ctx.observe("refused", "ready", peer=peer, detail="malformed ready records")
                return
            self.take(ctx.state, peer, records)

        return await ctx.net.broadcast(
            ctx.counters,
            [dest],
            KIND_READIES,
            batch,
            run=ctx.run,
            round=ctx.round,
            stage="ready",
            on_reply=take,
        )
