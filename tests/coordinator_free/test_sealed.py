"""Encrypt-then-code: sealing under the recovery secret, packed parts, the backup file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
from coordinator_free.sealed import (
    BackupError,
    RecoveryBackup,
    RecoverySecret,
    SealedCorrupt,
    WrongRecoverySecret,
    atomic_write,
    open_sealed,
    pack_parts,
    seal,
    unpack_parts,
)
from coordinator_free.tls import PeerAddress
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.coordinator_free.transport_support import identity

VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "checkpoint_shards.json"
SECRET = RecoverySecret(bytes(range(32)))
NONCE = bytes.fromhex("000102030405060708090a0b")


def test_seal_roundtrip_and_peers_cannot_read() -> None:
    plaintext = b"optimizer state " * 100
    sealed = seal(SECRET, "org-a", "state", 4, plaintext)
    assert plaintext not in sealed and b"optimizer" not in sealed
    assert open_sealed(SECRET, "org-a", "state", 4, sealed) == plaintext


def test_random_nonces_differ() -> None:
    assert seal(SECRET, "a", "state", 1, b"x") != seal(SECRET, "a", "state", 1, b"x")


def test_wrong_secret_is_a_clear_error() -> None:
    sealed = seal(SECRET, "org-a", "state", 4, b"secret state")
    other = RecoverySecret.generate(lambda n: b"\x42" * n)
    with pytest.raises(WrongRecoverySecret, match="recovery secret does not match"):
        open_sealed(other, "org-a", "state", 4, sealed)


@pytest.mark.parametrize(
    ("owner", "set_id", "version"),
    [("org-b", "state", 4), ("org-a", "other", 4), ("org-a", "state", 5)],
)
def test_sealed_blob_is_bound_to_owner_set_and_version(
    owner: str, set_id: str, version: int
) -> None:
    sealed = seal(SECRET, "org-a", "state", 4, b"secret state")
    with pytest.raises((SealedCorrupt, WrongRecoverySecret)):
        open_sealed(SECRET, owner, set_id, version, sealed)


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=0, max_size=200), where=st.integers(0, 10**6), bit=st.integers(0, 7))
def test_any_bit_flip_in_a_sealed_blob_is_refused(data: bytes, where: int, bit: int) -> None:
    sealed = bytearray(seal(SECRET, "a", "state", 1, data, nonce=NONCE))
    sealed[where % len(sealed)] ^= 1 << bit
    with pytest.raises((SealedCorrupt, WrongRecoverySecret)):
        open_sealed(SECRET, "a", "state", 1, bytes(sealed))


@pytest.mark.parametrize("junk", [b"", b"FWSL", b"FWSL\x01" + b"\0" * 40, b"x" * 100])
def test_junk_is_refused(junk: bytes) -> None:
    with pytest.raises(SealedCorrupt):
        open_sealed(SECRET, "a", "state", 1, junk)


def test_bad_nonce_and_secret_sizes() -> None:
    with pytest.raises(ValueError):
        seal(SECRET, "a", "s", 1, b"x", nonce=b"short")
    with pytest.raises(ValueError):
        RecoverySecret(b"short")
    with pytest.raises(ValueError):
        RecoverySecret.from_hex("zz")


@settings(max_examples=50, deadline=None)
@given(parts=st.dictionaries(st.text(min_size=1, max_size=20), st.binary(max_size=100), max_size=6))
def test_pack_parts_roundtrip(parts: dict[str, bytes]) -> None:
    assert unpack_parts(pack_parts(parts)) == parts


def test_unpack_parts_refuses_truncation() -> None:
    packed = pack_parts({"optimizer": b"o" * 10, "accountant": b"a" * 5, "progress": b"7"})
    for cut in range(len(packed)):
        with pytest.raises(SealedCorrupt):
            unpack_parts(packed[:cut])
    with pytest.raises(SealedCorrupt):
        unpack_parts(packed + b"\0")


def test_atomic_write_replaces_whole_file_with_0600(tmp_path: Path) -> None:
    target = tmp_path / "state.bin"
    atomic_write(target, b"old")
    atomic_write(target, memoryview(b"new contents"))
    assert target.read_bytes() == b"new contents"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.bin"]


def test_atomic_write_leaves_nothing_on_failure(tmp_path: Path) -> None:
    class Boom:
        def __len__(self) -> int:
            return 1

        def __buffer__(self, flags: int) -> memoryview:
            raise OSError("disk full")

    atomic_write(tmp_path / "f", b"kept")
    with pytest.raises((OSError, TypeError)):
        atomic_write(tmp_path / "f", Boom())  # type: ignore[arg-type]
    assert (tmp_path / "f").read_bytes() == b"kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def _backup(passphrase: bytes | None = None) -> RecoveryBackup:
    peer = identity("org-b")
    return RecoveryBackup.create(
        identity("org-a"),
        "fed-test",
        SECRET,
        peers={"org-b": PeerAddress("https://127.0.0.1:9443", peer.fingerprint)},
        manifest_digest="ab" * 32,
        passphrase=passphrase,
    )


def test_backup_roundtrip_plain(tmp_path: Path) -> None:
    path = tmp_path / "org-a.backup.json"
    _backup().save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = RecoveryBackup.load(path)
    assert loaded == _backup()
    assert loaded.identity().public_key == identity("org-a").public_key
    assert loaded.secret == SECRET
    assert loaded.peers["org-b"].url == "https://127.0.0.1:9443"


def test_backup_with_passphrase_hides_key_and_secret(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    _backup(b"correct horse").save(path, b"correct horse", scrypt_n=1 << 10)
    text = path.read_text()
    assert SECRET.hex() not in text and "ENCRYPTED PRIVATE KEY" in text
    loaded = RecoveryBackup.load(path, b"correct horse")
    assert loaded.secret == SECRET
    assert loaded.identity(b"correct horse").org_id == "org-a"
    with pytest.raises(BackupError, match="wrong passphrase"):
        RecoveryBackup.load(path, b"wrong")
    with pytest.raises(BackupError, match="passphrase"):
        RecoveryBackup.load(path)
    with pytest.raises(BackupError):
        loaded.identity(b"wrong")


def test_backup_refuses_loose_permissions_and_junk(tmp_path: Path) -> None:
    path = tmp_path / "b.json"
    _backup().save(path)
    os.chmod(path, 0o644)
    with pytest.raises(BackupError, match="chmod 600"):
        RecoveryBackup.load(path)
    os.chmod(path, 0o600)
    obj: dict[str, Any] = json.loads(path.read_text())
    for change in ({"format": "v0"}, {"extra": 1}, {"secret": {"plain": "00"}}):
        atomic_write(path, json.dumps({**obj, **change}).encode())
        with pytest.raises(BackupError):
            RecoveryBackup.load(path)
    atomic_write(path, b"not json")
    with pytest.raises(BackupError):
        RecoveryBackup.load(path)
    with pytest.raises(BackupError):
        RecoveryBackup.load(tmp_path / "missing.json")


def vectors() -> dict[str, Any]:
    owner = identity("org-a").org_id
    plaintext = pack_parts({"optimizer": b"\x01\x02", "progress": b'{"round": 12}'})
    return {
        "secret": SECRET.hex(),
        "owner": owner,
        "set_id": "state",
        "version": 12,
        "nonce": NONCE.hex(),
        "key": SECRET.key(owner).hex(),
        "key_check": SECRET.key_check(owner).hex(),
        "plaintext": plaintext.hex(),
        "sealed": seal(SECRET, owner, "state", 12, plaintext, nonce=NONCE).hex(),
    }


def test_fixed_sealing_vector() -> None:
    expected = vectors()
    if os.environ.get("FEDWEAVE_WRITE_VECTORS"):
        current = json.loads(VECTORS.read_text()) if VECTORS.exists() else {}
        current["sealed"] = expected
        VECTORS.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
    stored = json.loads(VECTORS.read_text())["sealed"]
    assert stored == expected
    opened = open_sealed(
        RecoverySecret.from_hex(stored["secret"]),
        stored["owner"],
        stored["set_id"],
        stored["version"],
        bytes.fromhex(stored["sealed"]),
    )
    assert opened == bytes.fromhex(stored["plaintext"])
