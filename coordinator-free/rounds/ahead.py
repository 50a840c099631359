"""Shares sealed a round ahead: the keys they are sealed to, and the ready that carries them.

``docs/ARCHITECTURE.md``, "A round", step 1. Bonawitz et al. seal each org's Shamir
shares to a holder under the holder's ``c`` key of the round, so the shares wait for
the advertisements and travel in a second exchange (``round.share``). Here every
``round.ready`` also advertises a fresh X25519 key for a later round (``next_pk``);
in its next round an org seals its shares to each holder under the key that holder
advertised last, and they ride beside its ready: no share exchange, and no round trip
between the readies and the ring. The ready's core, which its org signs, lists a
digest of each sealed blob; the blobs travel only towards their holders (a direct
ready carries its receiver's, a relayed record those of the members its copy
reaches: :func:`kept_blobs`), and a holder takes the one whose digest the core
lists. A holder whose key the org does not know (a first round, a new member) or that
no longer holds it (it restarted: the keys live in memory only) gets and sends its
shares by the share exchange as before
(:mod:`~coordinator_free.rounds.share`): each ready lists the keys its org still
holds, so both ends of a pair know from the two readies whether the pair needs it.

The same ready also advertises the ``s`` key of its org's next round of the run
(``next_spk``): that round's advertisement carries it, and its self-mask seed ``b``
was drawn with it. Every peer that saw it can agree on its pairwise mask with that org
before the round, so a node expands its next round's masks while its update trains
(:mod:`~coordinator_free.rounds.prepared`).

:class:`AheadKeys` holds this node's keys (the private halves, never written
anywhere, each dropped once :data:`RETAINED` newer ones were advertised) and the last
key each peer advertised. :class:`Ready` is a ready's bytes: the hash of ``U0``, the
``AdvertiseKeys``, and the ahead part (:class:`Ahead`), then the blobs that travel
with it.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from secure_agg.keys import generate_keypair
from secure_agg.protocol import MaskingSecrets
from secure_agg.protocol.config import usable_public_key

__all__ = [
    "DIGEST_BYTES",
    "KEY_ID_BYTES",
    "RETAINED",
    "Ahead",
    "AheadKeys",
    "Blob",
    "Ready",
    "encode_blobs",
    "kept_blobs",
    "key_id",
    "read_blobs",
]

KEY_ID_BYTES = 8
"""A key is named by the first bytes of its public half's domain-tagged SHA-256."""
RETAINED = 8
"""How many of its own keys a node keeps: each key it advertised until eight newer
ones were (concurrent runs each advertise one per ready)."""
PUBLIC_BYTES = 32
_KEYS = 2 * PUBLIC_BYTES  # the two keys a ready's ahead part starts with
NO_KEY = bytes(PUBLIC_BYTES)
"""The masking key of an ahead part that advertises none (not a usable X25519 key)."""
_MAX_BLOB = 1024
_HEAD = struct.Struct(">I")  # the AdvertiseKeys' length
_BLOB = struct.Struct(">H8sH")  # holder's index in U0, key id, ciphertext length
DIGEST_BYTES = 8
"""A blob is listed in its author's ready by the first bytes of its domain-tagged
SHA-256: enough that no relay can find another blob with the same digest."""
_SEALED = struct.Struct(">H8s")  # holder's index in U0, the blob's digest
_BLOB_DOMAIN = b"fedweave/ahead-blob/v1\x00"


def key_id(public: bytes) -> bytes:
    """The id of an X25519 public key, as readies list and blobs name it."""
    return hashlib.sha256(b"fedweave/ahead-key/v1\x00" + public).digest()[:KEY_ID_BYTES]


@dataclass(frozen=True)
class Blob:
    """One holder's shares, sealed to the key of id ``key`` that the holder advertised."""

    key: bytes
    ciphertext: bytes

    def digest(self) -> bytes:
        """What the author's ready lists for this blob (:attr:`Ahead.sealed`): the
        holder takes a blob, from whoever brought it, only when it matches."""
        return hashlib.sha256(_BLOB_DOMAIN + self.key + self.ciphertext).digest()[:DIGEST_BYTES]


@dataclass(frozen=True)
class Ahead:
    """The ahead part of a ready: this org's key for a later round, the ids of the keys
    it still holds, its masking key for its next round of the run (``next_spk``, the
    ``s`` key that round advertises; :data:`NO_KEY` for none), the digest of each blob it sealed (``sealed``: 2-byte holder
    index in ``U0`` and :data:`DIGEST_BYTES`-byte digest per entry, in rising holder
    order), and the blobs that travel with these bytes (``blobs``, by holder index).

    The ready's **core** (:meth:`core`) is all of it but the blobs: what the author
    signs, every member files, and two copies of one ready are compared by. The blobs
    go only towards their holders (a direct ready carries its receiver's; a relayed
    record those of the members its copy reaches), and a holder takes the one whose
    digest the core lists.
    """

    next_pk: bytes
    held: frozenset[bytes] = frozenset()
    sealed: bytes = b""
    blobs: Mapping[int, Blob] = field(default_factory=dict)
    next_spk: bytes = NO_KEY

    @classmethod
    def sealing(
        cls,
        next_pk: bytes,
        held: frozenset[bytes],
        blobs: Mapping[int, Blob],
        next_spk: bytes = NO_KEY,
    ) -> Ahead:
        """The ahead part of an author's own ready: the digests of all its ``blobs``."""
        sealed = b"".join(_SEALED.pack(i, blobs[i].digest()) for i in sorted(blobs))
        return cls(next_pk, held, sealed, dict(blobs), next_spk)

    def core(self) -> bytes:
        held = sorted(self.held)
        count = len(self.sealed) // _SEALED.size
        return (
            b"".join([self.next_pk, self.next_spk, struct.pack(">B", len(held)), *held])
            + struct.pack(">H", count)
            + self.sealed
        )

    def to_bytes(self) -> bytes:
        """The core, then the blobs that travel with it (none: nothing more)."""
        return self.core() + encode_blobs(self.blobs)

    def digest_for(self, index: int) -> bytes | None:
        """The digest of the blob sealed for the holder of ``index`` (``None``: none)."""
        sealed, size = self.sealed, _SEALED.size
        lo, hi = 0, len(sealed) // size
        while lo < hi:
            mid = (lo + hi) // 2
            at, digest = _SEALED.unpack_from(sealed, mid * size)
            if at == index:
                return bytes(digest)
            lo, hi = (mid + 1, hi) if at < index else (lo, mid)
        return None

    @classmethod
    def from_bytes(cls, data: bytes, only: int | None = None) -> Ahead:
        """Parse; ``ValueError`` on anything malformed. ``only``: keep the blob of that
        holder alone (what one holder reads of a peer's ready): every blob's header is
        still checked, but no other ciphertext is copied."""
        end = _core_end(data, 0)
        count, pos = data[_KEYS], _KEYS + 1
        stop = pos + count * KEY_ID_BYTES
        held = frozenset(data[i : i + KEY_ID_BYTES] for i in range(pos, stop, KEY_ID_BYTES))
        sealed = bytes(data[stop + 2 : end])
        blobs = read_blobs(data[end:], only) if end < len(data) else {}
        next_spk = bytes(data[PUBLIC_BYTES:_KEYS])
        return cls(bytes(data[:PUBLIC_BYTES]), held, sealed, blobs, next_spk)


def _core_end(data: bytes, pos: int) -> int:
    """Where the ahead part's core that starts at ``pos`` ends; ``ValueError`` when it
    is malformed (too short, a bad list of held keys, sealed digests out of order)."""
    if len(data) < pos + _KEYS + 3:
        raise ValueError("ahead part too short")
    count = data[pos + _KEYS]
    at = pos + _KEYS + 1
    end = at + count * KEY_ID_BYTES
    held = {data[i : i + KEY_ID_BYTES] for i in range(at, end, KEY_ID_BYTES)}
    if count > RETAINED or end + 2 > len(data) or len(held) != count:
        raise ValueError("ahead part: bad list of held keys")
    (n_sealed,) = struct.unpack_from(">H", data, end)
    stop = end + 2 + int(n_sealed) * _SEALED.size
    if stop > len(data):
        raise ValueError("ahead part: truncated digests")
    # the holder indices in one unpack; strictly rising is the same as sorted and distinct
    indices = list(struct.unpack_from(">" + "H8x" * int(n_sealed), data, end + 2))
    if indices != sorted(set(indices)):
        raise ValueError("ahead part: digests out of holder order")
    return stop


def encode_blobs(blobs: Mapping[int, Blob]) -> bytes:
    """Blobs as they travel (their count, then each in rising holder order); none:
    no bytes at all."""
    if not blobs:
        return b""
    parts = [struct.pack(">H", len(blobs))]
    for index in sorted(blobs):
        blob = blobs[index]
        parts += [_BLOB.pack(index, blob.key, len(blob.ciphertext)), blob.ciphertext]
    return b"".join(parts)


def read_blobs(data: bytes, only: int | None = None) -> dict[int, Blob]:
    """The blobs of :func:`encode_blobs`' bytes (none: no bytes), in strictly rising
    holder order; with ``only``, that holder's blob alone. ``ValueError`` when
    malformed."""
    if not data:
        return {}
    if len(data) < 2:
        raise ValueError("ahead part: truncated blobs")
    (n_blobs,), pos = struct.unpack_from(">H", data, 0), 2
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


def kept_blobs(sections: Iterable[bytes], keep: frozenset[int]) -> bytes:
    """The blobs a relay passes on: of those its copies of a record came with, one per
    holder in ``keep`` (the members the copy it sends reaches), the first copy's when
    two differ (the holder checks the digest). A malformed section counts as none."""
    out: dict[int, Blob] = {}
    for section in sections:
        try:
            blobs = read_blobs(section)
        except ValueError:
            continue
        for index, blob in blobs.items():
            if index in keep:
                out.setdefault(index, blob)
    return encode_blobs(out)


@dataclass(frozen=True)
class Ready:
    """A ``round.ready``'s bytes: its core (the same for every receiver, relayed or
    direct), then the blobs that travel with it."""

    h0: bytes
    advert: bytes
    ahead: Ahead | None = None

    def core(self) -> bytes:
        """What the author signs and every member files (:meth:`Ahead.core`)."""
        tail = b"" if self.ahead is None else self.ahead.core()
        return self.h0 + _HEAD.pack(len(self.advert)) + self.advert + tail

    def to_bytes(self) -> bytes:
        tail = b"" if self.ahead is None else self.ahead.to_bytes()
        return self.h0 + _HEAD.pack(len(self.advert)) + self.advert + tail

    @staticmethod
    def split(data: bytes, hash_bytes: int) -> tuple[bytes, bytes]:
        """A ready's bytes as its core and the blobs after it; ``ValueError`` when the
        core is malformed (the blobs are read, and checked, by their holder)."""
        start = _advert_end(data, hash_bytes)
        if start == len(data):
            return data, b""
        end = _core_end(data, start)
        return data[:end], data[end:]

    @classmethod
    def from_bytes(cls, data: bytes, hash_bytes: int, only: int | None = None) -> Ready:
        """Parse; ``ValueError`` on anything malformed. ``only``: as for
        :meth:`Ahead.from_bytes`, the blob of that holder alone."""
        start = _advert_end(data, hash_bytes)
        rest = data[start:]
        ahead = Ahead.from_bytes(rest, only) if rest else None
        return cls(data[:hash_bytes], data[hash_bytes + _HEAD.size : start], ahead)


def _advert_end(data: bytes, hash_bytes: int) -> int:
    if len(data) < hash_bytes + _HEAD.size:
        raise ValueError("ready too short")
    (size,) = _HEAD.unpack_from(data, hash_bytes)
    end = hash_bytes + _HEAD.size + int(size)
    if end > len(data):
        raise ValueError("ready: truncated advertisement")
    return end


class AheadKeys:
    """This node's keys advertised for later rounds, and the last one of each peer; and
    the masking secrets of this node's next round of each run, and each peer's masking
    key for its next round of each run.

    In memory only: a restarted node holds none, lists none in its readies, and its
    peers send it their shares by the share exchange until it advertised again.
    """

    def __init__(self, retained: int = RETAINED) -> None:
        if retained < 1:
            raise ValueError("AheadKeys keeps at least one key")
        self.retained = retained
        self._own: OrderedDict[bytes, X25519PrivateKey] = OrderedDict()
        self._peers: dict[str, bytes] = {}
        # masking: this node's s pair and b for its next round of each run, and the
        # masking key each peer advertised last in each run
        self._masking: dict[str, MaskingSecrets] = {}
        self._peer_masking: dict[tuple[str, str], bytes] = {}

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

    def rotate_masking(self, run: str, s_seed: bytes, b: bytes) -> bytes:
        """The ``s`` pair and ``b`` of this node's next round of ``run`` (from 32 random
        bytes each), in place of any drawn before and not taken: its public key, which
        this round's ready advertises."""
        secrets = MaskingSecrets.draw(s_seed, b)
        self._masking[run] = secrets
        return secrets.s.public

    def masking(self, run: str) -> MaskingSecrets | None:
        """The secrets this node advertised for its next round of ``run``, still held."""
        return self._masking.get(run)

    def take_masking(self, run: str) -> MaskingSecrets | None:
        """The secrets for this round of ``run``, handed out once: a round that takes
        them advertises them, and no later round gets them again."""
        return self._masking.pop(run, None)

    def learn_masking(self, run: str, org: str, public: bytes) -> None:
        """Keep the masking key ``org`` advertised for its next round of ``run``; one
        that is not a usable X25519 key (a ready that advertised none) drops what was
        kept: that peer's next round draws its own."""
        if len(public) == PUBLIC_BYTES and usable_public_key(public):
            self._peer_masking[(run, org)] = public
        else:
            self._peer_masking.pop((run, org), None)

    def masking_keys(self, run: str, orgs: Iterable[str]) -> dict[str, bytes]:
        """The masking key each of ``orgs`` advertised last for ``run``, where one did."""
        found = ((o, self._peer_masking.get((run, o))) for o in orgs)
        return {o: k for o, k in found if k is not None}

    def forget_run(self, run: str) -> None:
        """``run`` ended here: its masking secrets and keys are dropped."""
        self._masking.pop(run, None)
        for key in [k for k in self._peer_masking if k[0] == run]:
            del self._peer_masking[key]

    def held_ids(self) -> frozenset[bytes]:
        """The ids of the keys this node holds (tests and the docs' claims)."""
        return frozenset(self._own)
