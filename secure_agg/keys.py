"""Per-round key agreement, key derivation and authenticated share encryption.

* Key agreement: ephemeral X25519 (RFC 7748, Section 6.1) per round, one key pair per org.
* Derivation: HKDF-SHA256 (RFC 5869) of the shared secret. The ``info`` string binds a
  domain label, the round (federation, run, round number) and the unordered pair of
  org ids, written in sorted order, so both ends of a pair derive the same key and no
  key is ever reused across rounds, runs, federations or purposes (Bonawitz et al.,
  CCS'17, Section 4: ``s_{u,v} = KA.agree(s_u^SK, s_v^PK)`` then ``PRG(s_{u,v})``).
* Share encryption: AES-256-GCM (NIST SP 800-38D) with a 96-bit nonce, returned as
  ``nonce || ciphertext || tag``. Every failure of :func:`decrypt` is one opaque
  :class:`~secure_agg.errors.DecryptionError`.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import ConfigError, DecryptionError

__all__ = [
    "KEY_BYTES",
    "MASK_LABEL",
    "NONCE_BYTES",
    "SHARE_ENC_LABEL",
    "KeyPair",
    "RoundContext",
    "agree",
    "decrypt",
    "encrypt",
    "generate_keypair",
    "pairwise_mask_seed",
    "share_encryption_key",
]

#: Length of X25519 keys, derived keys and AES-256 keys.
KEY_BYTES = 32
#: Length of an AES-GCM nonce.
NONCE_BYTES = 12
#: HKDF label of pairwise mask seeds.
MASK_LABEL = b"fedweave/mask"
#: HKDF label of keys that encrypt Shamir shares between a pair of orgs.
SHARE_ENC_LABEL = b"fedweave/share-enc"

_CONTEXT_TAG = b"fedweave/round-context/v1"
_MAX_ROUND = (1 << 64) - 1


def _lp(data: bytes) -> bytes:
    """Length-prefix ``data`` with a 4-byte big-endian length."""
    return struct.pack(">I", len(data)) + data


@dataclass(frozen=True)
class RoundContext:
    """The round a key belongs to; its canonical bytes go into every HKDF ``info``."""

    federation: str
    """Federation identifier (non-empty)."""
    run: str
    """Training run identifier within the federation (non-empty)."""
    round: int
    """Round number, ``0 <= round < 2**64``."""

    def __post_init__(self) -> None:
        for name in ("federation", "run"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{name} must be a non-empty str, got {value!r}")
        if isinstance(self.round, bool) or not isinstance(self.round, int):
            raise ConfigError(f"round must be an int, got {self.round!r}")
        if not 0 <= self.round <= _MAX_ROUND:
            raise ConfigError(f"round must be in [0, 2**64), got {self.round}")

    def to_bytes(self) -> bytes:
        """Canonical encoding: tag, then length-prefixed UTF-8 fields, then the round (u64 BE)."""
        return (
            _lp(_CONTEXT_TAG)
            + _lp(self.federation.encode())
            + _lp(self.run.encode())
            + struct.pack(">Q", self.round)
        )


@dataclass(frozen=True)
class KeyPair:
    """An ephemeral X25519 key pair; ``public`` is the 32-byte raw public key."""

    private: X25519PrivateKey
    public: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.public, bytes) or len(self.public) != KEY_BYTES:
            raise ConfigError(f"public must be {KEY_BYTES} raw bytes")
        derived = self.private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        if derived != self.public:
            raise ConfigError("public does not match the private key")


def generate_keypair(private_bytes: bytes | None = None) -> KeyPair:
    """Return a fresh X25519 key pair, or the one whose raw private key is ``private_bytes``.

    Raises:
        ConfigError: ``private_bytes`` is not 32 bytes.
    """
    if private_bytes is None:
        private = X25519PrivateKey.generate()
    else:
        if not isinstance(private_bytes, bytes) or len(private_bytes) != KEY_BYTES:
            raise ConfigError(f"private_bytes must be {KEY_BYTES} bytes")
        private = X25519PrivateKey.from_private_bytes(private_bytes)
    public = private.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    return KeyPair(private=private, public=public)


def agree(private: X25519PrivateKey, peer_public: bytes) -> bytes:
    """X25519 shared secret with the peer's 32-byte raw public key.

    Raises:
        ConfigError: ``peer_public`` is not 32 bytes, or is a low-order point whose
            shared secret would be all zeros (RFC 7748, Section 6.1).
    """
    if not isinstance(peer_public, bytes) or len(peer_public) != KEY_BYTES:
        raise ConfigError(f"peer_public must be {KEY_BYTES} raw bytes")
    try:
        shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as exc:
        raise ConfigError("peer_public is not a valid X25519 public key") from exc
    if shared == bytes(KEY_BYTES):
        raise ConfigError("peer_public is a low-order X25519 point")
    return shared


def _derive(label: bytes, shared: bytes, ctx: RoundContext, a: str, b: str) -> bytes:
    if not isinstance(shared, bytes) or len(shared) != KEY_BYTES:
        raise ConfigError(f"shared must be {KEY_BYTES} bytes")
    if not isinstance(ctx, RoundContext):
        raise ConfigError("ctx must be a RoundContext")
    for name, value in (("a", a), ("b", b)):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{name} must be a non-empty org id, got {value!r}")
    if a == b:
        raise ConfigError("a and b must be two different org ids")
    low, high = sorted((a, b))
    info = _lp(label) + ctx.to_bytes() + _lp(low.encode()) + _lp(high.encode())
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info)
    return hkdf.derive(shared)


def pairwise_mask_seed(shared: bytes, ctx: RoundContext, a: str, b: str) -> bytes:
    """32-byte PRG seed of the pairwise mask between orgs ``a`` and ``b`` in round ``ctx``.

    Symmetric in ``a`` and ``b``. HKDF-SHA256, ``info`` = label ``fedweave/mask`` ||
    ``ctx.to_bytes()`` || the sorted pair, every field length-prefixed.
    """
    return _derive(MASK_LABEL, shared, ctx, a, b)


def share_encryption_key(shared: bytes, ctx: RoundContext, a: str, b: str) -> bytes:
    """32-byte AES-256-GCM key for Shamir shares exchanged between ``a`` and ``b``.

    Same construction as :func:`pairwise_mask_seed` with the label ``fedweave/share-enc``,
    so the two keys are independent.
    """
    return _derive(SHARE_ENC_LABEL, shared, ctx, a, b)


def encrypt(key: bytes, plaintext: bytes, aad: bytes, nonce: bytes | None = None) -> bytes:
    """AES-256-GCM encryption; returns ``nonce || ciphertext || tag``.

    ``nonce`` (12 bytes) defaults to ``os.urandom(12)``; pass it only for test vectors.

    Raises:
        ConfigError: ``key`` is not 32 bytes or ``nonce`` is not 12 bytes.
    """
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ConfigError(f"key must be {KEY_BYTES} bytes")
    if nonce is None:
        nonce = os.urandom(NONCE_BYTES)
    elif not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise ConfigError(f"nonce must be {NONCE_BYTES} bytes")
    return nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def decrypt(key: bytes, blob: bytes, aad: bytes) -> bytes:
    """Inverse of :func:`encrypt`.

    Raises:
        DecryptionError: for any failure (wrong key or AAD, truncated or tampered blob).
    """
    try:
        if len(key) != KEY_BYTES or len(blob) < NONCE_BYTES + 16:
            raise DecryptionError("decryption failed")
        return AESGCM(bytes(key)).decrypt(bytes(blob[:NONCE_BYTES]), bytes(blob[NONCE_BYTES:]), aad)
    except (InvalidTag, ValueError, TypeError):
        raise DecryptionError("decryption failed") from None
