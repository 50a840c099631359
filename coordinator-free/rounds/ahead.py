"""Shares sealed a round ahead: the keys they are sealed to, and the ready that carries them.

``docs/ARCHITECTURE.md``, "A round", step 1. Bonawitz et al. seal each org's Shamir
shares to a holder under the holder's ``c`` key of the round, so the shares wait for
the advertisements and travel in a second exchange (``round.share``). Here every
``round.ready`` also advertises a fresh X25519 key for a later round (``next_pk``);
in its next round an org seals its shares to each holder under the key that holder
advertised last, and they ride with its ready: no share exchange, and no round trip
between the readies and the ring. A holder whose key the org does not know (a first
round, a new member) or that no longer holds it (it restarted: the keys live in
memory only) gets and sends its shares by the share exchange as before
(:mod:`~coordinator_free.rounds.share`): each ready lists the keys its org still
holds, so both ends of a pair know from the two readies whether the pair needs it.

:class:`AheadKeys` holds this node's keys (the private halves, never written
anywhere, each dropped once :data:`RETAINED` newer ones were advertised) and the last
key each peer advertised. :class:`Ready` is a ready's bytes: the hash of ``U0``, the
``AdvertiseKeys``, and the ahead part (:class:`Ahead`).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from secure_agg.keys import generate_keypair
from secure_agg.protocol.config import usable_public_key

__all__ = ["KEY_ID_BYTES", "RETAINED", "Ahead", "AheadKeys", "Ready", "key_id"]

KEY_ID_BYTES = 8
"""A key is named by the first bytes of its public half's domain-tagged SHA-256."""
RETAINED = 8
"""How many of its own keys a node keeps: each key it advertised until eight newer
ones were (concurrent runs each advertise one per ready)."""
PUBLIC_BYTES = 32
_MAX_BLOB = 1024
_HEAD = struct.Struct(">I")  # the AdvertiseKeys' length
_BLOB = struct.Struct(">H8sH")  # holder's index in U0, key id, ciphertext length


def key_id(public: bytes) -> bytes:
    """The id of an X25519 public key, as readies list and blobs name it."""
    return hashlib.sha256(b"fedweave/ahead-key/v1\x00" + public).digest()[:KEY_ID_BYTES]


@dataclass(frozen=True)
class Blob:
    """One holder's shares, sealed to the key of id ``key`` that the holder advertised."""

    key: bytes
    ciphertext: bytes


@dataclass(frozen=True)
class Ahead:
    """The ahead part of a ready: this org's key for a later round, the ids of the keys
    it still holds, and its shares sealed to holders' earlier keys (by index in U0)."""

    next_pk: bytes
    held: frozenset[bytes] = frozenset()
    blobs: Mapping[int, Blob] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        held = sorted(self.held)
        parts = [self.next_pk, struct.pack(">B", len(held)), *held]
        parts.append(struct.pack(">H", len(self.blobs)))
        for index in sorted(self.blobs):
            blob = self.blobs[index]
            parts += [_BLOB.pack(index, blob.key, len(blob.ciphertext)), blob.ciphertext]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes, only: int | None = None) -> Ahead:
        """Parse; ``ValueError`` on anything malformed. ``only``: keep the blob of that
        holder alone (what one holder reads of a peer's ready): every blob's header is
        still checked, but no other ciphertext is copied."""
        if len(data) < PUBLIC_BYTES + 3:
            raise ValueError("ahead part too short")
        count, pos = data[PUBLIC_BYTES], PUBLIC_BYTES + 1
        end = pos + count * KEY_ID_BYTES
        held = frozenset(data[i : i + KEY_ID_BYTES] for i in range(pos, end, KEY_ID_BYTES))
        if count > RETAINED or end + 2 > len(data) or len(held) != count:
            raise ValueError("ahead part: bad list of held keys")
        blobs = _read_blobs(data, end, only)
        return cls(bytes(data[:PUBLIC_BYTES]), held, blobs)


def _read_blobs(data: bytes, pos: int, only: int | None) -> dict[int, Blob]:
    """The blobs from ``pos`` (their count first) to the end of ``data``, in strictly
    rising holder order as :meth:`Ahead.to_bytes` writes them; with ``only``, that
    holder's blob alone."""
    (n_blobs,), pos = struct.unpack_from(">H", data, pos), pos + 2
    unpack, header, total = _BLOB.unpack_from, _BLOB.size, len(data)
    blobs: dict[int, Blob] = {}
    last = -1
    for _ in range(n_blobs):
        if pos + header > total:
            raise ValueError("ahead part: truncated blob")
        index, key, size = unpack(data, pos)
        pos += header
        if index <= last or size > _MAX_BLOB or pos + size > total:
            raise ValueError("ahead part: bad blob (out of order, too long or cut)")
        if only is None or index == only:
            blobs[index] = Blob(key, bytes(data[pos : pos + size]))
        last, pos = index, pos + size
    if pos != total:
        raise ValueError("ahead part: trailing bytes")
    return blobs


@dataclass(frozen=True)
class Ready:
    """A ``round.ready``'s bytes (the same for every receiver, relayed or direct)."""

    h0: bytes
    advert: bytes
    ahead: Ahead | None = None

    def to_bytes(self) -> bytes:
        tail = b"" if self.ahead is None else self.ahead.to_bytes()
        return self.h0 + _HEAD.pack(len(self.advert)) + self.advert + tail

    @classmethod
    def from_bytes(cls, data: bytes, hash_bytes: int, only: int | None = None) -> Ready:
        """Parse; ``ValueError`` on anything malformed. ``only``: as for
        :meth:`Ahead.from_bytes`, the blob of that holder alone."""
        if len(data) < hash_bytes + _HEAD.size:
            raise ValueError("ready too short")
        (size,) = _HEAD.unpack_from(data, hash_bytes)
        start = hash_bytes + _HEAD.size
        if start + size > len(data):
            raise ValueError("ready: truncated advertisement")
        rest = data[start + size :]
        ahead = Ahead.from_bytes(rest, only) if rest else None
        return cls(data[:hash_bytes], data[start : start + size], ahead)


class AheadKeys:
    """This node's keys advertised for later rounds, and the last one of each peer.

    In memory only: a restarted node holds none, lists none in its readies, and its
    peers send it their shares by the share exchange until it advertised again.
    """

    def __init__(self, retained: int = RETAINED) -> None:
        if retained < 1:
            raise ValueError("AheadKeys keeps at least one key")
        self.retained = retained
        self._own: OrderedDict[bytes, X25519PrivateKey] = OrderedDict()
        self._peers: dict[str, bytes] = {}

    def rotate(self, seed: bytes) -> tuple[bytes, dict[bytes, X25519PrivateKey]]:
        """A new key (from 32 random bytes ``seed``) to advertise, and the keys held
        before it (id -> private half): the ones a ready of this round may open. The
        oldest beyond :attr:`retained` is dropped."""
        held = dict(self._own)
        pair = generate_keypair(seed)
        self._own[key_id(pair.public)] = pair.private
        while len(self._own) > self.retained:
            self._own.popitem(last=False)
        return pair.public, held

    def learn(self, org: str, public: bytes) -> bool:
        """Keep ``org``'s newest advertised key; ``False`` (kept nothing) when it is not
        32 bytes. Whether it is a usable X25519 key is checked when it is used
        (:meth:`known`): a node learns every member's key and seals to its holders' only."""
        if len(public) != PUBLIC_BYTES:
            return False
        self._peers[org] = public
        return True

    def known(self, orgs: Iterable[str]) -> dict[str, bytes]:
        """The last key each of ``orgs`` advertised, for those that did and whose key is
        a usable X25519 key (not of low order): no share is sealed to any other."""
        found = ((o, self._peers.get(o)) for o in orgs)
        return {o: k for o, k in found if k is not None and usable_public_key(k)}

    def held_ids(self) -> frozenset[bytes]:
        """The ids of the keys this node holds (tests and the docs' claims)."""
        return frozenset(self._own)
