"""Encrypt-then-code: sealing an org's private state, the recovery secret, its backup.

An org's private state (local optimizer state, local-only layers, DP accountant state,
run progress) is sealed with AES-256-GCM (NIST SP 800-38D) before it is erasure-coded,
so the peers that hold its shards cannot read it. The key is derived with HKDF-SHA256
(RFC 5869) from the org's 32-byte **recovery secret**, with the org id and a purpose
label as ``info``; the associated data binds the owner, set id and version, so a shard
set cannot be passed off as another one.

Sealed blob::

    b"FWSL" | version u8 (=1) | key check (16 bytes) | nonce (12 bytes) | AES-GCM ciphertext+tag

The key check is a second HKDF output of the same secret: a wrong secret is reported as
:class:`WrongRecoverySecret` before any decryption is tried; a right secret with a
failing tag is :class:`SealedCorrupt`.

The secret lives offline in a :class:`RecoveryBackup` file, together with the org id,
its identity key (PKCS#8 PEM, optionally passphrase-encrypted under a scrypt-derived
password: :func:`coordinator_free.identity.key_password`) and certificate, the
federation id, the manifest hash it last knew and its peers' endpoints. With a
passphrase, the secret is also encrypted (AES-GCM under a scrypt key, RFC 7914:
:func:`seal_with_passphrase`, which also seals a node's ``recovery.secret`` file). The
file is written atomically (temporary file, fsync, rename: :mod:`coordinator_free.files`)
with mode 0600.
"""

from __future__ import annotations

import hmac
import json
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator_free.address import PeerAddress
from coordinator_free.errors import CoordinatorFreeError, IdentityError
from coordinator_free.files import atomic_write, require_private
from coordinator_free.identity import OrgIdentity, key_is_encrypted
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

__all__ = [
    "BACKUP_FORMAT",
    "SECRET_BYTES",
    "BackupError",
    "RecoveryBackup",
    "RecoverySecret",
    "SealedCorrupt",
    "SealedError",
    "WrongRecoverySecret",
    "atomic_write",
    "open_sealed",
    "open_with_passphrase",
    "pack_parts",
    "seal",
    "seal_with_passphrase",
    "unpack_parts",
]

SECRET_BYTES = 32
BACKUP_FORMAT = "fedweave-recovery-backup/v1"
_MAGIC = b"FWSL\x01"
_CHECK_BYTES = 16
_NONCE_BYTES = 12
_HEADER = len(_MAGIC) + _CHECK_BYTES + _NONCE_BYTES
_KEY_INFO = b"fedweave/checkpoint/key/v1\x00"
_CHECK_INFO = b"fedweave/checkpoint/key-check/v1\x00"
_AAD_DOMAIN = b"fedweave/checkpoint/aad/v1\x00"
_MAX_PLAINTEXT = (1 << 31) - 1 - 16
_PARTS_MAGIC = b"FWPS\x01"


class SealedError(CoordinatorFreeError):
    """A sealed checkpoint could not be opened."""


class WrongRecoverySecret(SealedError):
    """The recovery secret is not the one the checkpoint was sealed with."""


class SealedCorrupt(SealedError):
    """The sealed bytes are malformed or were modified (authentication failed)."""


class BackupError(CoordinatorFreeError):
    """A recovery backup file is unreadable, malformed, or has unsafe permissions."""


@dataclass(frozen=True)
class RecoverySecret:
    """An org's 32-byte recovery secret (kept offline, in the backup file)."""

    value: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.value, bytes) or len(self.value) != SECRET_BYTES:
            raise ValueError(f"a recovery secret is {SECRET_BYTES} bytes")

    @classmethod
    def generate(cls, rng: Callable[[int], bytes] = os.urandom) -> RecoverySecret:
        """A fresh secret from ``rng`` (``os.urandom`` unless a test gives its own)."""
        return cls(rng(SECRET_BYTES))

    def _hkdf(self, owner: str, info: bytes) -> bytes:
        return HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=info + owner.encode()
        ).derive(self.value)

    def key(self, owner: str) -> bytes:
        """The AES-256-GCM key sealing ``owner``'s checkpoints (HKDF, RFC 5869)."""
        return self._hkdf(owner, _KEY_INFO)

    def key_check(self, owner: str) -> bytes:
        """A 16-byte value that identifies the key without revealing it."""
        return self._hkdf(owner, _CHECK_INFO)[:_CHECK_BYTES]

    def hex(self) -> str:
        return self.value.hex()

    @classmethod
    def from_hex(cls, text: str) -> RecoverySecret:
        try:
            return cls(bytes.fromhex(text))
        except ValueError as exc:
            raise ValueError(f"not a recovery secret: {exc}") from None


def _aad(owner: str, set_id: str, version: int) -> bytes:
    fields = [owner.encode(), set_id.encode()]
    return (
        _AAD_DOMAIN
        + b"".join(struct.pack(">H", len(f)) + f for f in fields)
        + struct.pack(">Q", version)
    )


def seal(
    secret: RecoverySecret,
    owner: str,
    set_id: str,
    version: int,
    plaintext: bytes | bytearray | memoryview,
    *,
    nonce: bytes | None = None,
) -> bytes:
    """Encrypt ``plaintext`` under ``owner``'s checkpoint key (format in module doc).

    ``nonce`` (12 bytes) is random unless given, for byte-exact test vectors only: a
    nonce must never be used twice with one key.
    """
    if len(plaintext) > _MAX_PLAINTEXT:
        raise SealedError(f"state of {len(plaintext)} bytes exceeds AES-GCM's one-shot limit")
    nonce = os.urandom(_NONCE_BYTES) if nonce is None else nonce
    if len(nonce) != _NONCE_BYTES:
        raise ValueError(f"nonce must be {_NONCE_BYTES} bytes")
    ciphertext = AESGCM(secret.key(owner)).encrypt(nonce, plaintext, _aad(owner, set_id, version))
    return _MAGIC + secret.key_check(owner) + nonce + ciphertext


def open_sealed(
    secret: RecoverySecret, owner: str, set_id: str, version: int, sealed: bytes
) -> bytes:
    """Decrypt a blob from :func:`seal`.

    Raises :class:`WrongRecoverySecret` when ``secret`` is not the sealing one and
    :class:`SealedCorrupt` when the blob is malformed or was tampered with.
    """
    if len(sealed) < _HEADER + 16 or sealed[: len(_MAGIC)] != _MAGIC:
        raise SealedCorrupt("not a sealed checkpoint")
    check = sealed[len(_MAGIC) : len(_MAGIC) + _CHECK_BYTES]
    if not hmac.compare_digest(check, secret.key_check(owner)):
        raise WrongRecoverySecret(
            f"the recovery secret does not match the one {owner!r} sealed this checkpoint "
            "with; use the secret from the org's recovery backup file"
        )
    nonce = sealed[len(_MAGIC) + _CHECK_BYTES : _HEADER]
    try:
        return AESGCM(secret.key(owner)).decrypt(
            nonce, memoryview(sealed)[_HEADER:], _aad(owner, set_id, version)
        )
    except InvalidTag:
        raise SealedCorrupt(
            f"checkpoint {owner}/{set_id}@{version} failed authentication"
        ) from None


def pack_parts(parts: Mapping[str, bytes]) -> bytes:
    """Frame named byte strings (optimizer state, local layers, accountant, progress).

    ``b"FWPS\\x01" | u32 count | (u16 name length | name | u64 length | bytes)*``, by name.
    """
    out = [_PARTS_MAGIC, struct.pack(">I", len(parts))]
    for name in sorted(parts):
        encoded = name.encode("utf-8")
        if not encoded or len(encoded) > 0xFFFF:
            raise ValueError(f"bad part name {name!r}")
        out += [struct.pack(">H", len(encoded)), encoded, struct.pack(">Q", len(parts[name]))]
        out.append(bytes(parts[name]))
    return b"".join(out)


def unpack_parts(data: bytes) -> dict[str, bytes]:
    """Inverse of :func:`pack_parts`; raises :class:`SealedCorrupt` on malformed input."""
    view = memoryview(data)
    if bytes(view[:5]) != _PARTS_MAGIC or len(view) < 9:
        raise SealedCorrupt("not a packed state")
    (count,) = struct.unpack(">I", view[5:9])
    pos = 9
    parts: dict[str, bytes] = {}
    try:
        for _ in range(count):
            (name_len,) = struct.unpack(">H", view[pos : pos + 2])
            name = bytes(view[pos + 2 : pos + 2 + name_len]).decode("utf-8")
            pos += 2 + name_len
            (size,) = struct.unpack(">Q", view[pos : pos + 8])
            pos += 8
            if pos + size > len(view) or name in parts:
                raise SealedCorrupt("truncated packed state or repeated part")
            parts[name] = bytes(view[pos : pos + size])
            pos += size
    except (struct.error, UnicodeDecodeError):
        raise SealedCorrupt("truncated packed state") from None
    if pos != len(view):
        raise SealedCorrupt("trailing bytes after the packed state")
    return parts


@dataclass(frozen=True)
class RecoveryBackup:
    """Everything a wiped org needs to rebuild itself from its peers.

    org_id: the org.
    federation: the federation id.
    key_pem: the identity key, PKCS#8 PEM (encrypted when the backup has a passphrase).
    certificate_pem: the org's certificate.
    secret: the recovery secret.
    peers: org id -> where that peer listens and the certificate it must present.
    manifest_digest: the federation manifest version (digest, hex) known at backup time.
    """

    org_id: str
    federation: str
    key_pem: bytes = field(repr=False)
    certificate_pem: bytes = field(repr=False)
    secret: RecoverySecret
    peers: Mapping[str, PeerAddress] = field(default_factory=dict)
    manifest_digest: str = ""

    @classmethod
    def create(
        cls,
        identity: OrgIdentity,
        federation: str,
        secret: RecoverySecret,
        *,
        peers: Mapping[str, PeerAddress] | None = None,
        manifest_digest: str = "",
        passphrase: bytes | None = None,
    ) -> RecoveryBackup:
        """A backup of ``identity`` (key encrypted under ``passphrase`` when given)."""
        return cls(
            org_id=identity.org_id,
            federation=federation,
            key_pem=identity.key_at_rest(passphrase),
            certificate_pem=identity.certificate_pem,
            secret=secret,
            peers=dict(peers or {}),
            manifest_digest=manifest_digest,
        )

    @property
    def encrypted(self) -> bool:
        """True when the identity key in the backup is passphrase-encrypted."""
        return key_is_encrypted(self.key_pem)

    def identity(self, passphrase: bytes | None = None) -> OrgIdentity:
        """The org's identity; raises :class:`BackupError` on a wrong passphrase."""
        try:
            identity = OrgIdentity.from_pem(self.key_pem, self.certificate_pem, passphrase)
        except IdentityError as exc:
            raise BackupError(f"cannot open the identity in the backup: {exc}") from None
        if identity.org_id != self.org_id:
            raise BackupError(f"the backup's certificate names {identity.org_id!r}")
        return identity

    def save(self, path: Path, passphrase: bytes | None = None, *, scrypt_n: int = 1 << 15) -> None:
        """Write the backup atomically with mode 0600.

        With ``passphrase``, the recovery secret is stored AES-GCM-encrypted under
        ``scrypt(passphrase, salt, n=scrypt_n, r=8, p=1)``; the key PEM should then be
        encrypted with the same passphrase (:meth:`create` does so).
        """
        body: dict[str, Any] = {
            "format": BACKUP_FORMAT,
            "org_id": self.org_id,
            "federation": self.federation,
            "key_pem": self.key_pem.decode("ascii"),
            "certificate_pem": self.certificate_pem.decode("ascii"),
            "manifest_digest": self.manifest_digest,
            "peers": {
                org: {"url": a.url, "fingerprint": a.fingerprint}
                for org, a in sorted(self.peers.items())
            },
        }
        if passphrase:
            body["secret"] = seal_with_passphrase(
                self.secret.value, passphrase, BACKUP_FORMAT.encode(), scrypt_n=scrypt_n
            )
        else:
            body["secret"] = {"plain": self.secret.hex()}
        atomic_write(Path(path), json.dumps(body, indent=2, sort_keys=True).encode() + b"\n")

    @classmethod
    def load(cls, path: Path, passphrase: bytes | None = None) -> RecoveryBackup:
        """Read a backup; refuses a file readable by group or others."""
        path = Path(path)
        try:
            require_private(path, BackupError)
            obj = json.loads(path.read_bytes())
        except OSError as exc:
            raise BackupError(f"cannot read the recovery backup: {exc}") from None
        except ValueError:
            raise BackupError("the recovery backup is not JSON") from None
        expected = {
            "format",
            "org_id",
            "federation",
            "key_pem",
            "certificate_pem",
            "manifest_digest",
            "peers",
            "secret",
        }
        if not isinstance(obj, dict) or set(obj) != expected:
            raise BackupError("the recovery backup's fields are not the expected ones")
        if obj["format"] != BACKUP_FORMAT:
            raise BackupError(f"unknown backup format {obj['format']!r}")
        try:
            secret = _open_secret(obj["secret"], passphrase)
            peers = {
                str(org): PeerAddress(str(a["url"]), str(a["fingerprint"]))
                for org, a in obj["peers"].items()
            }
            return cls(
                org_id=str(obj["org_id"]),
                federation=str(obj["federation"]),
                key_pem=str(obj["key_pem"]).encode("ascii"),
                certificate_pem=str(obj["certificate_pem"]).encode("ascii"),
                secret=secret,
                peers=peers,
                manifest_digest=str(obj["manifest_digest"]),
            )
        except BackupError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise BackupError(f"the recovery backup is malformed: {exc}") from None


def _open_secret(obj: Any, passphrase: bytes | None) -> RecoverySecret:
    if not isinstance(obj, dict):
        raise BackupError("malformed secret entry")
    if "plain" in obj:
        return RecoverySecret.from_hex(str(obj["plain"]))
    value = open_with_passphrase(
        obj, passphrase, BACKUP_FORMAT.encode(), what="the recovery backup", error=BackupError
    )
    return RecoverySecret(value)


def seal_with_passphrase(
    plaintext: bytes, passphrase: bytes, aad: bytes, *, scrypt_n: int = 1 << 15
) -> dict[str, Any]:
    """``plaintext`` AES-256-GCM-encrypted under ``scrypt(passphrase, salt, n=scrypt_n,
    r=8, p=1)`` (RFC 7914) with a fresh salt and nonce, as a JSON-ready mapping."""
    salt, nonce = os.urandom(16), os.urandom(12)
    key = Scrypt(salt=salt, length=32, n=scrypt_n, r=8, p=1).derive(passphrase)
    sealed = AESGCM(key).encrypt(nonce, plaintext, aad)
    return {
        "scrypt": {"salt": salt.hex(), "n": scrypt_n, "r": 8, "p": 1},
        "nonce": nonce.hex(),
        "ciphertext": sealed.hex(),
    }


def open_with_passphrase(
    obj: Mapping[str, Any],
    passphrase: bytes | None,
    aad: bytes,
    *,
    what: str,
    error: Callable[[str], Exception] = BackupError,
) -> bytes:
    """The plaintext of :func:`seal_with_passphrase`'s ``obj``; ``error`` (one line naming
    ``what``) when the passphrase is missing or wrong or the entry is malformed."""
    if not passphrase:
        raise error(f"{what} is passphrase-protected; give the passphrase")
    try:
        params = obj["scrypt"]
        n, r, p = int(params["n"]), int(params["r"]), int(params["p"])
        if not (1 < n <= 1 << 20 and n & (n - 1) == 0 and 0 < r <= 32 and 0 < p <= 16):
            raise ValueError("scrypt parameters out of range")
        key = Scrypt(salt=bytes.fromhex(params["salt"]), length=32, n=n, r=r, p=p).derive(
            passphrase
        )
        nonce, ciphertext = bytes.fromhex(obj["nonce"]), bytes.fromhex(obj["ciphertext"])
    except (KeyError, TypeError, ValueError) as exc:
        raise error(f"{what} is malformed: {exc}") from None
    try:
        return AESGCM(key).decrypt(nonce, ciphertext, aad)
    except (InvalidTag, ValueError):
        raise error(f"wrong passphrase for {what}") from None
