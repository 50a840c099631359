"""Org identity: an Ed25519 key and an X.509 certificate naming the org.

Each org signs every protocol message with its Ed25519 key (RFC 8032) and presents the
certificate in mutual TLS. Peers do not trust a CA: they pin the SHA-256 fingerprint of
each member's DER certificate, as published in the federation manifest. A self-signed
certificate (``generate``) is the default; a CA-issued certificate for the same key is
accepted as well (``from_pem``), since pinning only looks at the certificate itself.

At rest (``save``/``load``) the key is a PKCS#8 PEM file, and both files are created
with mode 0600 in a 0700 directory. With a passphrase the key is encrypted (PKCS#8
PBES2, AES-256-CBC, the format TLS libraries read) under a password derived from the
passphrase by scrypt (RFC 7914, n=2^15, r=8, p=1) salted with the certificate
(:func:`key_password`), so a guess costs a scrypt, not PBES2's few PBKDF2 rounds. A key
file readable by group or others is refused on load.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from coordinator_free.errors import IdentityError
from coordinator_free.files import require_private
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "CERT_FILE",
    "KEY_FILE",
    "OrgIdentity",
    "certificate_fingerprint",
    "certificate_org_id",
    "key_is_encrypted",
    "key_password",
    "load_certificate",
    "verify_signature",
]

KEY_FILE = "identity.key"
CERT_FILE = "identity.crt"
_DEFAULT_NOT_BEFORE = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
_VALIDITY = dt.timedelta(days=365 * 30)
_KEY_SALT_DOMAIN = b"fedweave/identity-key-password/v1\x00"
_SCRYPT_N = 1 << 15


@functools.lru_cache(maxsize=8)
def key_password(passphrase: bytes, certificate_pem: bytes) -> bytes:
    """The password the identity key's PKCS#8 file is encrypted under: scrypt of the
    passphrase, salted with the SHA-256 of the certificate (unique per identity), hex.

    Remembered per (passphrase, certificate): the node derives it once when it loads its
    identity, and the peer server's TLS options (built on the event loop) reuse it."""
    salt = hashlib.sha256(_KEY_SALT_DOMAIN + certificate_pem.strip()).digest()
    derived = Scrypt(salt=salt, length=32, n=_SCRYPT_N, r=8, p=1).derive(passphrase)
    return derived.hex().encode("ascii")


def key_is_encrypted(key_pem: bytes) -> bool:
    """True when the PEM holds an encrypted private key."""
    return b"-----BEGIN ENCRYPTED PRIVATE KEY-----" in key_pem


def verify_signature(public_key: bytes, data: bytes, signature: bytes) -> bool:
    """True iff ``signature`` is a valid Ed25519 signature of ``data`` by ``public_key``.

    Never raises: a malformed key or signature is simply not valid.
    """
    if len(public_key) != 32 or len(signature) != 64:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


def load_certificate(
    certificate_pem: bytes, what: str = "not a PEM certificate"
) -> x509.Certificate:
    """Parse a PEM certificate; :class:`IdentityError` (``what: reason``) on any bad input.

    ``cryptography`` raises ``ValueError`` for most malformed certificates but
    ``x509.InvalidVersion`` (not a ``ValueError``) for a bad version field: both are
    the caller's bad input.
    """
    try:
        return x509.load_pem_x509_certificate(certificate_pem)
    except (ValueError, x509.InvalidVersion) as exc:
        raise IdentityError(f"{what}: {exc}") from None


def certificate_fingerprint(certificate_pem: bytes) -> str:
    """SHA-256 of the DER encoding of a PEM certificate, lowercase hex."""
    cert = load_certificate(certificate_pem)
    return hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def certificate_org_id(certificate_pem: bytes) -> str:
    """The org id named in the certificate's subject common name."""
    cert = load_certificate(certificate_pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names:
        raise IdentityError("certificate has no subject common name")
    value = names[0].value
    return value if isinstance(value, str) else value.decode("utf-8")


def _self_signed(key: Ed25519PrivateKey, org_id: str, not_before: dt.datetime) -> bytes:
    """A deterministic self-signed certificate: serial and dates derive from the inputs."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, org_id)])
    public_raw = key.public_key().public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    serial = int.from_bytes(hashlib.sha256(public_raw).digest()[:16], "big") >> 1
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(not_before)
        .not_valid_after(not_before + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(key, algorithm=None)
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class OrgIdentity:
    """An org's Ed25519 identity key and its certificate (org id in the subject CN)."""

    org_id: str
    _key: Ed25519PrivateKey = field(repr=False, compare=False)
    certificate_pem: bytes = field(repr=False)

    @classmethod
    def generate(
        cls,
        org_id: str,
        private_bytes: bytes | None = None,
        *,
        not_before: dt.datetime | None = None,
    ) -> OrgIdentity:
        """A new identity; with ``private_bytes`` (32-byte seed) it is deterministic."""
        if not org_id:
            raise IdentityError("org id must not be empty")
        if private_bytes is None:
            key = Ed25519PrivateKey.generate()
        else:
            if len(private_bytes) != 32:
                raise IdentityError("an Ed25519 private key is 32 bytes")
            key = Ed25519PrivateKey.from_private_bytes(private_bytes)
        cert = _self_signed(key, org_id, not_before or _DEFAULT_NOT_BEFORE)
        return cls(org_id=org_id, _key=key, certificate_pem=cert)

    @classmethod
    def from_pem(
        cls, key_pem: bytes, certificate_pem: bytes, passphrase: bytes | None = None
    ) -> OrgIdentity:
        """An identity from a PEM key and a certificate (self-signed or CA-issued).

        The certificate must carry the key's public half; the org id is its subject CN.
        An encrypted key needs ``passphrase`` (one line says so, or that it is wrong); a
        key in clear ignores it.
        """
        cert = load_certificate(certificate_pem, "cannot read the certificate")
        password = None
        if key_is_encrypted(key_pem):
            if not passphrase:
                raise IdentityError("the identity key is encrypted: a passphrase is needed")
            password = key_password(passphrase, certificate_pem)
        try:
            key = serialization.load_pem_private_key(key_pem, password=password)
        except (ValueError, TypeError) as exc:
            if password is not None:
                raise IdentityError("wrong passphrase for the identity key") from None
            raise IdentityError(f"cannot read the identity key: {exc}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise IdentityError("the identity key is not an Ed25519 key")
        raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
        if cert.public_key().public_bytes(*raw) != key.public_key().public_bytes(*raw):
            raise IdentityError("the certificate does not belong to the identity key")
        return cls(
            org_id=certificate_org_id(certificate_pem), _key=key, certificate_pem=certificate_pem
        )

    @cached_property
    def public_key(self) -> bytes:
        """The 32 raw bytes of the Ed25519 public key."""
        return self._key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 of the DER certificate, lowercase hex (what peers pin)."""
        return certificate_fingerprint(self.certificate_pem)

    def sign(self, data: bytes) -> bytes:
        """Ed25519 signature of ``data`` (deterministic, 64 bytes)."""
        return self._key.sign(data)

    def private_key_pem(self, password: bytes | None = None) -> bytes:
        """The key as PKCS#8 PEM, encrypted under ``password`` itself when one is given
        (for a random one-time password; a passphrase goes through :meth:`key_at_rest`)."""
        encryption: serialization.KeySerializationEncryption = (
            serialization.BestAvailableEncryption(password)
            if password
            else serialization.NoEncryption()
        )
        return self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption
        )

    def key_at_rest(self, passphrase: bytes | None = None) -> bytes:
        """The key as stored on disk: PKCS#8 PEM, encrypted under :func:`key_password`
        when a passphrase is given, in clear otherwise."""
        if not passphrase:
            return self.private_key_pem()
        return self.private_key_pem(key_password(passphrase, self.certificate_pem))

    def save(self, directory: Path, passphrase: bytes | None = None) -> None:
        """Write ``identity.key`` and ``identity.crt`` into ``directory`` (mode 0600)."""
        directory = Path(directory)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write_private(directory / KEY_FILE, self.key_at_rest(passphrase))
        _write_private(directory / CERT_FILE, self.certificate_pem)

    @classmethod
    def load(cls, directory: Path, passphrase: bytes | None = None) -> OrgIdentity:
        """Read an identity written by :meth:`save` (or placed there by an operator)."""
        directory = Path(directory)
        key_path, cert_path = directory / KEY_FILE, directory / CERT_FILE
        try:
            require_private(key_path, IdentityError)
            key_pem = key_path.read_bytes()
            cert_pem = cert_path.read_bytes()
        except OSError as exc:
            raise IdentityError(f"cannot read the identity in {directory}: {exc}") from None
        return cls.from_pem(key_pem, cert_pem, passphrase)
