"""Org identity: deterministic keys and certificates, signatures, storage at rest."""

from __future__ import annotations

import base64
import datetime as dt
import json
import stat
from pathlib import Path

import pytest
from coordinator_free.errors import IdentityError
from coordinator_free.identity import (
    CERT_FILE,
    KEY_FILE,
    OrgIdentity,
    certificate_fingerprint,
    certificate_org_id,
    verify_signature,
)
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID

VECTOR = json.loads(
    (Path(__file__).resolve().parents[1] / "vectors" / "coordinator_free_envelope.json").read_text()
)["identity"]


def test_identity_vector_is_byte_exact() -> None:
    ident = OrgIdentity.generate(VECTOR["org_id"], bytes.fromhex(VECTOR["seed"]))
    assert ident.public_key.hex() == VECTOR["public_key"]
    assert ident.certificate_pem.decode() == VECTOR["certificate_pem"]
    assert ident.fingerprint == VECTOR["certificate_fingerprint"]
    assert certificate_fingerprint(ident.certificate_pem) == ident.fingerprint


def test_certificate_names_the_org_and_is_self_signed() -> None:
    ident = OrgIdentity.generate("hospital-a")
    cert = x509.load_pem_x509_certificate(ident.certificate_pem)
    assert cert.subject == cert.issuer
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "hospital-a"
    assert certificate_org_id(ident.certificate_pem) == "hospital-a"
    raw = cert.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert raw == ident.public_key
    cert.verify_directly_issued_by(cert)


def test_a_certificate_with_a_bad_version_field_is_an_identity_error() -> None:
    # cryptography raises x509.InvalidVersion, not a ValueError, for this one
    der = x509.load_pem_x509_certificate(OrgIdentity.generate("x").certificate_pem).public_bytes(
        serialization.Encoding.DER
    )
    version_field = bytes.fromhex("a003020102")  # [0] EXPLICIT INTEGER 2 (v3)
    assert der.count(version_field) == 1
    bad = der.replace(version_field, bytes.fromhex("a00302013f"))
    pem = b"".join(
        [
            b"-----BEGIN CERTIFICATE-----\n",
            base64.encodebytes(bad),
            b"-----END CERTIFICATE-----\n",
        ]
    )
    with pytest.raises(x509.InvalidVersion):
        x509.load_pem_x509_certificate(pem)
    for parse in (certificate_fingerprint, certificate_org_id):
        with pytest.raises(IdentityError, match="not a PEM certificate"):
            parse(pem)


def test_fresh_identities_differ() -> None:
    a, b = OrgIdentity.generate("x"), OrgIdentity.generate("x")
    assert a.public_key != b.public_key
    assert a.fingerprint != b.fingerprint


def test_sign_and_verify() -> None:
    ident = OrgIdentity.generate("bank-b")
    sig = ident.sign(b"message")
    assert len(sig) == 64
    assert verify_signature(ident.public_key, b"message", sig)
    assert not verify_signature(ident.public_key, b"messagf", sig)
    assert not verify_signature(OrgIdentity.generate("bank-c").public_key, b"message", sig)


@pytest.mark.parametrize(
    ("key", "sig"),
    [
        (b"", b"\x00" * 64),
        (b"\x00" * 31, b"\x00" * 64),
        (b"\x01" * 32, b""),
        (b"\x01" * 32, b"\x00" * 65),
    ],
)
def test_verify_signature_never_raises(key: bytes, sig: bytes) -> None:
    assert verify_signature(key, b"data", sig) is False


def test_generate_rejects_bad_inputs() -> None:
    with pytest.raises(IdentityError):
        OrgIdentity.generate("")
    with pytest.raises(IdentityError):
        OrgIdentity.generate("org", b"short")


@pytest.mark.parametrize("passphrase", [None, b"correct horse"])
def test_save_and_load_round_trip_with_0600_files(tmp_path: Path, passphrase: bytes | None) -> None:
    ident = OrgIdentity.generate("lab-c")
    directory = tmp_path / "node" / "identity"
    ident.save(directory, passphrase)
    for name in (KEY_FILE, CERT_FILE):
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) & 0o077 == 0
    key_pem = (directory / KEY_FILE).read_bytes()
    assert (b"ENCRYPTED" in key_pem) is (passphrase is not None)
    loaded = OrgIdentity.load(directory, passphrase)
    assert loaded.org_id == "lab-c"
    assert loaded.public_key == ident.public_key
    assert loaded.fingerprint == ident.fingerprint
    assert verify_signature(ident.public_key, b"m", loaded.sign(b"m"))


def test_load_with_wrong_or_missing_passphrase_fails(tmp_path: Path) -> None:
    OrgIdentity.generate("lab-d").save(tmp_path, b"secret")
    with pytest.raises(IdentityError):
        OrgIdentity.load(tmp_path, b"wrong")
    with pytest.raises(IdentityError):
        OrgIdentity.load(tmp_path)


def test_load_refuses_a_key_readable_by_others(tmp_path: Path) -> None:
    OrgIdentity.generate("lab-e").save(tmp_path)
    (tmp_path / KEY_FILE).chmod(0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        OrgIdentity.load(tmp_path)


def test_load_from_an_empty_directory_fails(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="cannot read"):
        OrgIdentity.load(tmp_path)


def test_save_tightens_existing_files(tmp_path: Path) -> None:
    (tmp_path / KEY_FILE).write_bytes(b"old")
    (tmp_path / KEY_FILE).chmod(0o666)
    OrgIdentity.generate("lab-f").save(tmp_path)
    assert stat.S_IMODE((tmp_path / KEY_FILE).stat().st_mode) == 0o600


def test_ca_issued_certificate_is_accepted(tmp_path: Path) -> None:
    ca_key = Ed25519PrivateKey.generate()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Hospital CA")])
    org_key = Ed25519PrivateKey.generate()
    start = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hospital-z")]))
        .issuer_name(ca_name)
        .public_key(org_key.public_key())
        .serial_number(7)
        .not_valid_before(start)
        .not_valid_after(start + dt.timedelta(days=365))
        .sign(ca_key, algorithm=None)
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = org_key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    ident = OrgIdentity.from_pem(key_pem, cert_pem)
    assert ident.org_id == "hospital-z"
    assert ident.fingerprint == certificate_fingerprint(cert_pem)
    other = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    with pytest.raises(IdentityError, match="does not belong"):
        OrgIdentity.from_pem(other, cert_pem)


def test_repr_does_not_leak_the_key() -> None:
    ident = OrgIdentity.generate("org-r", bytes(32))
    assert "Ed25519PrivateKey" not in repr(ident)
    assert ident.private_key_pem().hex() not in repr(ident)


def test_certificate_helpers_reject_garbage() -> None:
    with pytest.raises(IdentityError):
        certificate_fingerprint(b"not a certificate")
    with pytest.raises(IdentityError):
        certificate_org_id(b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
