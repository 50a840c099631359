"""What the round engine puts on the wire: its message kinds and the bytes they carry.

Every message travels in an Ed25519-signed envelope (:mod:`coordinator_free.wire`);
this module fixes the payloads. The pairwise exchanges carry a hash of the sender's
view before the session's own bytes (``round.share``, ``round.unmask``); an
agreement carries a :class:`View` (``round.view``) or the :class:`Token`
(``round.token``); the sums a member serves are asked for by the structs below.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from coordinator_free.rounds.config import RoundConfig

__all__ = [
    "COMPLETED",
    "HASH_BYTES",
    "KIND_LEAVE",
    "KIND_MODEL",
    "KIND_PART",
    "KIND_PERMIT",
    "KIND_READIES",
    "KIND_READY",
    "KIND_SEED",
    "KIND_SHARE",
    "KIND_TOKEN",
    "KIND_TOTAL",
    "KIND_UNMASK",
    "KIND_VIEW",
    "PART_REQUEST",
    "SEED_ENTRY",
    "SETTLED",
    "TOKEN_COLLECT",
    "TOKEN_DECIDE",
    "TOKEN_PROBE",
    "TOTAL_REQUEST",
    "Token",
    "View",
    "decisive",
    "decode_view",
    "known_tag",
    "mutual_set",
    "view_hash",
]

KIND_READY = "round.ready"
KIND_READIES = "round.readies"
KIND_VIEW = "round.view"
KIND_SHARE = "round.share"
KIND_UNMASK = "round.unmask"
KIND_TOKEN = "round.token"
KIND_LEAVE = "round.leave"
KIND_MODEL = "round.model"
KIND_TOTAL = "round.total"
KIND_PART = "round.part"
KIND_SEED = "round.seed"
KIND_PERMIT = "round.permit"

HASH_BYTES = 32
# the reply of a member whose ring attempt completed to a token or probe of that
# attempt's agreement: it holds the masked sum, which settles the attempt for all
COMPLETED = b"completed"
# the reply of a member to the token's decision when it settles on it (it had not given
# up on the token): the starter counts these before it permits revealing seeds
SETTLED = b"settled"
# attempt, [lo, hi) of the elements wanted
TOTAL_REQUEST = struct.Struct(">IQQ")
# attempt, chunk index, [lo, hi) of the elements wanted (within that chunk)
PART_REQUEST = struct.Struct(">IIQQ")
# one revealed self-mask seed: the owner's index among the sorted survivors, the seed
SEED_ENTRY = struct.Struct(">H32s")


@dataclass(frozen=True)
class View:
    """One node's proposal for a set agreed in a stage: the members and a flag."""

    tag: str
    attempt: int
    members: frozenset[str]
    flag: bool = True

    def digest(self) -> bytes:
        return view_hash(self.tag, self.members, self.flag)

    def to_bytes(self) -> bytes:
        tag = self.tag.encode("utf-8")
        parts = [
            struct.pack(">H", len(tag)),
            tag,
            struct.pack(">IBI", self.attempt, self.flag, len(self.members)),
        ]
        for org in sorted(self.members):
            raw = org.encode("utf-8")
            parts += [struct.pack(">H", len(raw)), raw]
        parts.append(self.digest())
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> View:
        """Decode a view; ``ValueError`` on anything but a canonical encoding."""
        try:
            pos = 0
            (n,) = struct.unpack_from(">H", data, pos)
            pos += 2
            tag = data[pos : pos + n].decode("utf-8")
            pos += n
            attempt, flag, count = struct.unpack_from(">IBI", data, pos)
            pos += 9
            if flag > 1 or count > len(data):
                raise ValueError("bad flag or count")
            members: list[str] = []
            for _ in range(count):
                (n,) = struct.unpack_from(">H", data, pos)
                pos += 2
                members.append(data[pos : pos + n].decode("utf-8"))
                pos += n
            digest = data[pos:]
        except (struct.error, UnicodeDecodeError) as exc:
            raise ValueError(f"malformed view: {exc}") from None
        if members != sorted(set(members)):
            raise ValueError("view members must be sorted and distinct")
        view = cls(tag, attempt, frozenset(members), bool(flag))
        if digest != view.digest():
            raise ValueError("view digest does not match its members")
        return view


@functools.lru_cache(maxsize=1024)
def decode_view(data: bytes) -> View:
    """:meth:`View.from_bytes`, remembered: in an agreement every node receives nearly
    the same view from each of ``n`` peers, and decoding one (parsing and hashing its
    ``n`` members) costs ``O(n)``, so without this an attempt costs ``O(n^3)`` CPU in
    all. A :class:`View` is immutable; a malformed view raises and is not remembered."""
    return View.from_bytes(data)


TOKEN_PROBE = 0
TOKEN_COLLECT = 1
TOKEN_DECIDE = 2


@dataclass(frozen=True)
class Token:
    """The agreement token of one stage (see :mod:`coordinator_free.rounds.agreement`).

    ``phase``: 0 asks whether the receiver runs the round (no entries), 1 collects
    the proposals along the ring, 2 carries the starter's decision (the collected
    proposals) to every member that proposed. ``base`` is the hash of the ring the token travels (the set every node
    agrees from); ``starter`` the member that started it; ``entries`` each member's
    ``(org, proposal, flag)`` in ring order. The member sets are written once each, as
    most members propose the same set.
    """

    phase: int
    tag: str
    base: bytes
    starter: str
    entries: tuple[tuple[str, frozenset[str], bool], ...] = ()

    def decision(self) -> tuple[frozenset[str], bool]:
        """The intersection of the proposals (of members that made one) and the AND of
        the flags: the same on every node that holds the same token. For a ring
        attempt's outcome (``reduce:N``) a member whose ring completed (flag set)
        decides alone: its proposal, completed (see :func:`decisive`). For the
        participants (``ready``) the larger of the intersection and
        :func:`mutual_set`'s set, so that one member whose proposal leaves out
        others it could not exchange shares with is left out rather than them."""
        if decisive(self.tag):
            for _, proposal, flag in self.entries:
                if flag:
                    return proposal, True
        proposers = members = frozenset(org for org, _, _ in self.entries)
        ok = all(flag for _, _, flag in self.entries)
        # most members propose the same set, which a decoded token holds once: each
        # distinct set is intersected once, not once per member (n² at n members)
        for proposal in {id(p): p for _, p, _ in self.entries}.values():
            members &= proposal
        # a mutual set is a set of proposers: it can only be larger when some are out
        if self.tag == "ready" and members != proposers:
            mutual = mutual_set({org: proposal for org, proposal, _ in self.entries})
            if len(mutual) > len(members):
                members = mutual
        return members, ok

    def to_bytes(self) -> bytes:
        def text(value: str) -> bytes:
            raw = value.encode("utf-8")
            return struct.pack(">H", len(raw)) + raw

        sets: dict[frozenset[str], int] = {}
        for _, proposal, _ in self.entries:
            sets.setdefault(proposal, len(sets))
        parts = [struct.pack(">B", self.phase), text(self.tag), self.base, text(self.starter)]
        parts.append(struct.pack(">H", len(sets)))
        for members in sets:
            parts.append(struct.pack(">H", len(members)))
            parts.extend(text(o) for o in sorted(members))
        parts.append(struct.pack(">H", len(self.entries)))
        for org, proposal, flag in self.entries:
            parts += [text(org), struct.pack(">HB", sets[proposal], flag)]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> Token:
        """Decode a token; ``ValueError`` on anything malformed."""
        pos = 0

        def take(fmt: str) -> tuple[int, ...]:
            nonlocal pos
            values = struct.unpack_from(fmt, data, pos)
            pos += struct.calcsize(fmt)
            return values

        def text() -> str:
            nonlocal pos
            (n,) = take(">H")
            raw = data[pos : pos + n]
            if len(raw) != n:
                raise ValueError("truncated")
            pos += n
            return raw.decode("utf-8")

        try:
            (phase,) = take(">B")
            tag = text()
            base = data[pos : pos + HASH_BYTES]
            pos += HASH_BYTES
            starter = text()
            sets: list[frozenset[str]] = []
            for _ in range(take(">H")[0]):
                sets.append(frozenset(text() for _ in range(take(">H")[0])))
            entries = []
            seen: set[str] = set()
            for _ in range(take(">H")[0]):
                org = text()
                index, flag = take(">HB")
                if org in seen or index >= len(sets) or flag > 1:
                    raise ValueError("a repeated member, an unknown set or a bad flag")
                seen.add(org)
                entries.append((org, sets[index], bool(flag)))
        except (struct.error, UnicodeDecodeError) as exc:
            raise ValueError(f"malformed token: {exc}") from None
        if phase not in (TOKEN_PROBE, TOKEN_COLLECT, TOKEN_DECIDE) or len(base) != HASH_BYTES:
            raise ValueError("unknown token phase or short base hash")
        if pos != len(data):
            raise ValueError("trailing bytes after the token")
        return cls(phase, tag, base, starter, tuple(entries))


def mutual_set(proposals: Mapping[str, frozenset[str]]) -> frozenset[str]:
    """A set of proposers each of whose proposals holds the whole set, found greedily:
    two proposers conflict when either's proposal leaves the other out, and the one
    with the most conflicts (then the greatest id) goes until none is left. A pure
    function of ``proposals``: every node holding the same token finds the same set."""
    members = set(proposals)
    conflicts = {
        p: {q for q in members if q != p and (q not in proposals[p] or p not in proposals[q])}
        for p in members
    }
    while True:
        worst = max(members, key=lambda p: (len(conflicts[p]), p), default=None)
        if worst is None or not conflicts[worst]:
            return frozenset(members)
        members.discard(worst)
        for q in conflicts.pop(worst):
            conflicts[q].discard(worst)


def decisive(tag: str) -> bool:
    """Whether one flagged proposal decides the agreement of ``tag`` on its own.

    So it is for the outcome of a ring attempt (``reduce:N``): the flag says the
    proposer's ring completed, so it holds the masked sum of every member of the
    attempt, and that sum is the attempt's outcome for all: a member whose ring broke
    takes the sum from one that completed (``round.total``) rather than having the
    ring run again. A member whose ring completed therefore settles at once, with no
    message, and releases its shares for the attempt's members.

    So it is for the participants (``ready``) too: a member proposes its set
    unflagged, and the flag says that its ring over every member, started before
    ``U1`` was settled (``RoundConfig.ring_first``), completed, so every member
    masked with every member: that settles ``U1`` as every member.
    """
    return tag == "ready" or tag.startswith("reduce:")


def view_hash(tag: str, members: Iterable[str], flag: bool = True) -> bytes:
    """SHA-256 over a stage tag, the sorted member set and a flag (the signed view hash)."""
    h = hashlib.sha256(b"fedweave/view\x00")
    for part in (tag, *sorted(members)):
        raw = part.encode("utf-8")
        h.update(struct.pack(">H", len(raw)) + raw)
    h.update(b"\x01" if flag else b"\x00")
    return h.digest()


def known_tag(tag: str, config: RoundConfig) -> bool:
    """Whether ``tag`` names an agreement a round of ``config`` can run: on a stage's
    set (``ready``, ``share``), or on the outcome of a ring attempt it may still make
    (``reduce:N``, ``scatter:N``)."""
    if tag in ("ready", "share"):
        return True
    prefix, _, num = tag.partition(":")
    return (
        prefix in ("reduce", "scatter") and num.isdigit() and int(num) < config.max_reduce_attempts
    )
