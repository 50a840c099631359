"""X25519 agreement, HKDF derivations and AES-GCM share encryption."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_agg.errors import ConfigError, DecryptionError
from secure_agg.keys import (
    KeyPair,
    RoundContext,
    agree,
    decrypt,
    encrypt,
    generate_keypair,
    pairwise_mask_seed,
    share_encryption_key,
)

VECTORS = json.loads((Path(__file__).resolve().parents[1] / "vectors" / "keys.json").read_text())
CASES = VECTORS["cases"]
CTX = RoundContext(federation="fed", run="run", round=3)


def test_rfc7748_vector() -> None:
    rfc = VECTORS["rfc7748"]
    alice = generate_keypair(bytes.fromhex(rfc["alice_private"]))
    bob = generate_keypair(bytes.fromhex(rfc["bob_private"]))
    assert alice.public.hex() == rfc["alice_public"]
    assert bob.public.hex() == rfc["bob_public"]
    assert agree(alice.private, bob.public).hex() == rfc["shared"]
    assert agree(bob.private, alice.public).hex() == rfc["shared"]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_key_vectors(case: dict[str, Any]) -> None:
    kp_a = generate_keypair(bytes.fromhex(case["private_a"]))
    kp_b = generate_keypair(bytes.fromhex(case["private_b"]))
    assert kp_a.public.hex() == case["public_a"]
    assert kp_b.public.hex() == case["public_b"]
    shared = agree(kp_a.private, kp_b.public)
    assert shared.hex() == case["shared"] == agree(kp_b.private, kp_a.public).hex()
    ctx = RoundContext(**case["context"])
    assert ctx.to_bytes().hex() == case["context_bytes"]
    assert pairwise_mask_seed(shared, ctx, case["a"], case["b"]).hex() == case["mask_seed"]
    key = share_encryption_key(shared, ctx, case["a"], case["b"])
    assert key.hex() == case["share_key"]
    blob = encrypt(
        key,
        bytes.fromhex(case["plaintext"]),
        bytes.fromhex(case["aad"]),
        nonce=bytes.fromhex(case["nonce"]),
    )
    assert blob.hex() == case["ciphertext"]
    assert decrypt(key, blob, bytes.fromhex(case["aad"])).hex() == case["plaintext"]


def test_derivations_are_symmetric_and_separated() -> None:
    shared = bytes(range(32))
    seed = pairwise_mask_seed(shared, CTX, "a", "b")
    assert seed == pairwise_mask_seed(shared, CTX, "b", "a")
    assert len(seed) == 32
    others = {
        share_encryption_key(shared, CTX, "a", "b"),
        pairwise_mask_seed(shared, RoundContext("fed", "run", 4), "a", "b"),
        pairwise_mask_seed(shared, RoundContext("fed", "run2", 3), "a", "b"),
        pairwise_mask_seed(shared, RoundContext("fed2", "run", 3), "a", "b"),
        pairwise_mask_seed(shared, CTX, "a", "c"),
        pairwise_mask_seed(bytes(31) + b"\x01", CTX, "a", "b"),
    }
    assert seed not in others
    assert len(others) == 6


def test_context_encoding_is_unambiguous() -> None:
    assert RoundContext("ab", "c", 1).to_bytes() != RoundContext("a", "bc", 1).to_bytes()
    assert pairwise_mask_seed(bytes(32), CTX, "ab", "c") != pairwise_mask_seed(
        bytes(32), CTX, "a", "bc"
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"federation": "", "run": "r", "round": 0},
        {"federation": "f", "run": "", "round": 0},
        {"federation": "f", "run": "r", "round": -1},
        {"federation": "f", "run": "r", "round": 2**64},
        {"federation": "f", "run": "r", "round": True},
    ],
    ids=["empty-federation", "empty-run", "negative-round", "huge-round", "bool-round"],
)
def test_round_context_validation(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        RoundContext(**kwargs)


def test_bad_keys_and_ids_are_refused() -> None:
    kp = generate_keypair()
    with pytest.raises(ConfigError):
        agree(kp.private, b"short")
    with pytest.raises(ConfigError):
        agree(kp.private, bytes(32))  # low-order point: all-zero shared secret
    with pytest.raises(ConfigError):
        generate_keypair(b"short")
    with pytest.raises(ConfigError, match="different"):
        pairwise_mask_seed(bytes(32), CTX, "a", "a")
    with pytest.raises(ConfigError):
        share_encryption_key(bytes(16), CTX, "a", "b")
    with pytest.raises(ConfigError, match="match"):
        KeyPair(private=kp.private, public=generate_keypair().public)


def test_generated_keypairs_agree() -> None:
    a, b = generate_keypair(), generate_keypair()
    assert a.public != b.public
    assert agree(a.private, b.public) == agree(b.private, a.public)


def test_encrypt_uses_fresh_nonces() -> None:
    key = bytes(32)
    assert encrypt(key, b"m", b"") != encrypt(key, b"m", b"")
    with pytest.raises(ConfigError):
        encrypt(key, b"m", b"", nonce=bytes(8))
    with pytest.raises(ConfigError):
        encrypt(bytes(16), b"m", b"")


@settings(max_examples=40, deadline=None)
@given(
    plaintext=st.binary(max_size=200),
    aad=st.binary(max_size=40),
    position=st.integers(min_value=0),
    flip=st.integers(min_value=1, max_value=255),
)
def test_tampering_is_detected(plaintext: bytes, aad: bytes, position: int, flip: int) -> None:
    key = bytes(range(32))
    blob = encrypt(key, plaintext, aad)
    assert decrypt(key, blob, aad) == plaintext
    tampered = bytearray(blob)
    tampered[position % len(blob)] ^= flip
    with pytest.raises(DecryptionError, match=r"^decryption failed$"):
        decrypt(key, bytes(tampered), aad)
    with pytest.raises(DecryptionError):
        decrypt(key, blob, aad + b"x")
    with pytest.raises(DecryptionError):
        decrypt(bytes(31) + b"\x01", blob, aad)
    with pytest.raises(DecryptionError):
        decrypt(key, blob[: len(blob) - 1], aad)


def test_decrypt_of_garbage_is_opaque() -> None:
    for blob in (b"", b"x" * 27, b"x" * 28):
        with pytest.raises(DecryptionError, match=r"^decryption failed$"):
            decrypt(bytes(32), blob, b"")
    with pytest.raises(DecryptionError):
        decrypt(b"short", b"x" * 40, b"")
