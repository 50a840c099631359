"""Relayed ready records authenticated by a MAC per receiver, once the record keys are known.

``docs/ARCHITECTURE.md``, "A round", step 1. A relayed ready record
(:mod:`~coordinator_free.rounds.ready_relay`) is signed by its author, and every member
takes every other member's record: ``n - 1`` Ed25519 verifications per node and round,
``n (n - 1)`` in the federation. From a member's second relayed round on, a record also
carries one HMAC-SHA-256 tag for each receiver whose **record key** the author knows,
and a receiver that knows the author's record key checks its tag (a hash and a MAC, a
few microseconds) instead of the signature.

Each node holds one X25519 **record key** pair, made when the node starts, in memory
only (a restarted node has a new one). Its records carry the public half, under the
author's Ed25519 signature, so a receiver learns an author's record key only from a
record whose signature it verified (or that the author's own envelope carried). The
pair of members ``(a, b)`` shares the MAC key ``HKDF-SHA-256(X25519(a, b))``, bound
to the federation and to both members' ids and record keys; the tag of a record for
receiver ``b`` is ``HMAC(key, b's id || SHA-256(the record's signing bytes))``, the
first :data:`TAG_BYTES` bytes. The signing bytes bind the federation, run, round,
author, ready and record key, so a tag cannot be moved to another record, round or
run, and a relay, which holds neither private half of the pair, cannot make one. A
record whose tag is missing or wrong, or whose key is not the one the receiver
learned for its author, is checked by its signature as before.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterable

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = [
    "ENTRY_BYTES",
    "KEY_ID_BYTES",
    "PUBLIC_BYTES",
    "TAG_BYTES",
    "RecordKeys",
    "kept_entries",
    "key_id",
]

PUBLIC_BYTES = 32
KEY_ID_BYTES = 4
"""A receiver's entry is found by the first bytes of its record key's SHA-256 (a
collision only costs the receiver a second MAC or a signature check)."""
TAG_BYTES = 16
ENTRY_BYTES = KEY_ID_BYTES + TAG_BYTES
_KDF_INFO = b"fedweave/record-mac/v1\x00"
_ID_DOMAIN = b"fedweave/record-key/v1\x00"


def key_id(public: bytes) -> bytes:
    """The id a record's tag entries name a receiver's record key by."""
    return hashlib.sha256(_ID_DOMAIN + public).digest()[:KEY_ID_BYTES]


def _text(value: str) -> bytes:
    raw = value.encode("utf-8")
    return struct.pack(">H", len(raw)) + raw


def _tag(mac_key: bytes, receiver: str, digest: bytes) -> bytes:
    return hmac.digest(mac_key, _text(receiver) + digest, "sha256")[:TAG_BYTES]


def kept_entries(copies: Iterable[bytes], keep: frozenset[bytes], known: frozenset[bytes]) -> bytes:
    """The tag entries of ``copies`` (the tags of one record's copies), each once, that
    name a key id in ``keep`` or one not in ``known`` (a receiver the caller cannot
    place: its entry is kept)."""
    size = ENTRY_BYTES
    kept = [
        tags[i : i + size]
        for tags in copies
        for i in range(0, len(tags) - len(tags) % size, size)
        if tags[i : i + KEY_ID_BYTES] in keep or tags[i : i + KEY_ID_BYTES] not in known
    ]
    return b"".join(dict.fromkeys(kept))


class RecordKeys:
    """This node's record key, the record keys learned for its peers, and the pairs' MAC keys."""

    def __init__(self, federation: str, me: str, private: bytes | None = None) -> None:
        """``private``: the record key's 32 private bytes, for test vectors only; a
        node makes a fresh one."""
        self.federation = federation
        self.me = me
        self._private = (
            X25519PrivateKey.generate()
            if private is None
            else X25519PrivateKey.from_private_bytes(private)
        )
        self.public = self._private.public_key().public_bytes_raw()
        self.id = key_id(self.public)
        self._peers: dict[str, bytes] = {}
        self._macs: dict[str, tuple[bytes, bytes | None]] = {}  # org -> (its key, MAC key)

    def learn(self, org: str, public: bytes) -> None:
        """``public`` is ``org``'s record key: it came in a record whose signature (or
        whose author's envelope) this node verified."""
        if org != self.me and len(public) == PUBLIC_BYTES:
            self._peers[org] = public

    def known(self, org: str) -> bytes | None:
        """The record key learned for ``org``, if any."""
        return self._peers.get(org)

    def _mac_key(self, org: str) -> bytes | None:
        """The MAC key of this node and ``org``, for the record key learned for it;
        ``None`` when none was learned or it is not a usable X25519 key."""
        public = self._peers.get(org)
        if public is None:
            return None
        held = self._macs.get(org)
        if held is not None and held[0] == public:
            return held[1]
        try:
            shared = self._private.exchange(X25519PublicKey.from_public_bytes(public))
        except ValueError:  # a low-order point: no key agreement with it
            key = None
        else:
            ends = sorted([(self.me, self.public), (org, public)])
            info = _KDF_INFO + _text(self.federation)
            info += b"".join(_text(o) + k for o, k in ends)
            key = HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(shared)
        self._macs[org] = (public, key)
        return key

    def tags(self, digest: bytes, receivers: Iterable[str]) -> bytes:
        """The tag entries of this node's record (``digest``: the SHA-256 of its signing
        bytes) for each of ``receivers`` whose record key it knows."""
        parts: list[bytes] = []
        for org in receivers:
            key = None if org == self.me else self._mac_key(org)
            if key is not None:
                parts += [key_id(self._peers[org]), _tag(key, org, digest)]
        return b"".join(parts)

    def ids(self, orgs: Iterable[str]) -> frozenset[bytes]:
        """The ids that tag entries name the record keys learned for ``orgs`` by."""
        return frozenset(key_id(k) for k in map(self._peers.get, orgs) if k is not None)

    def check(self, author: str, public: bytes, digest: bytes, tags: bytes) -> bool:
        """Whether ``tags`` hold a valid tag for this node of ``author``'s record (of
        signing-bytes digest ``digest``) that names ``public`` as its record key, the
        one learned for ``author``. ``False`` means only "not shown by a tag": the
        caller checks the signature."""
        if not public or self._peers.get(author) != public or len(tags) % ENTRY_BYTES:
            return False
        key = self._mac_key(author)
        if key is None:
            return False
        expected = _tag(key, self.me, digest)
        at = tags.find(self.id)
        while at >= 0:
            if at % ENTRY_BYTES == 0 and hmac.compare_digest(
                tags[at + KEY_ID_BYTES : at + ENTRY_BYTES], expected
            ):
                return True
            at = tags.find(self.id, at + 1)
        return False
