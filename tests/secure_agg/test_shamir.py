"""Shamir t-of-n over GF(2^521 - 1): vectors, reconstruction, detection of bad shares."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_agg.errors import ConfigError, DecryptionError, ShareError
from secure_agg.keys import (
    RoundContext,
    agree,
    decrypt,
    encrypt,
    generate_keypair,
    share_encryption_key,
)
from secure_agg.shamir import PRIME, SHARE_BYTES, Share, combine, commitment, split

VECTORS = json.loads((Path(__file__).resolve().parents[1] / "vectors" / "shamir.json").read_text())
CASES = VECTORS["cases"]


def byte_stream(data: bytes) -> Callable[[int], bytes]:
    chunks = iter(data[i : i + 66] for i in range(0, len(data), 66))
    return lambda k: next(chunks)[:k]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_shamir_vectors(case: dict[str, Any]) -> None:
    secret = bytes.fromhex(case["secret"])
    shares = split(secret, case["t"], case["n"], rng=byte_stream(bytes.fromhex(case["rng_bytes"])))
    assert [s.to_bytes().hex() for s in shares] == case["shares"]
    assert commitment(secret).hex() == case["commitment"]
    parsed = [Share.from_bytes(bytes.fromhex(h)) for h in case["shares"]]
    for subset in itertools.combinations(parsed, case["t"]):
        assert combine(subset, case["t"], len(secret), bytes.fromhex(case["commitment"])) == secret


def test_constant_term_is_the_secret_and_coefficients_come_from_rng() -> None:
    # t = 2, coefficient 5: f(x) = s + 5x.
    secret = b"\x2a"
    shares = split(secret, 2, 3, rng=lambda k: (5).to_bytes(k, "big"))
    assert [(s.x, s.y) for s in shares] == [(1, 47), (2, 52), (3, 57)]


def test_rejection_sampling_skips_the_prime() -> None:
    draws = iter([b"\xff" * 66, (7).to_bytes(66, "big")])  # first masks to PRIME itself
    shares = split(b"\x00\x01", 2, 2, rng=lambda k: next(draws))
    assert shares[0].y == 1 + 7


@settings(max_examples=25, deadline=None)
@given(
    secret=st.binary(min_size=1, max_size=64),
    t_n=st.integers(1, 7).flatmap(lambda t: st.tuples(st.just(t), st.integers(t, 8))),
    data=st.data(),
)
def test_any_t_shares_reconstruct(secret: bytes, t_n: tuple[int, int], data: st.DataObject) -> None:
    t, n = t_n
    shares = split(secret, t, n)
    count = data.draw(st.integers(t, n))
    chosen = data.draw(st.permutations(shares))[:count]
    assert combine(chosen, t, len(secret)) == secret
    assert combine(chosen, t, len(secret), commitment(secret)) == secret


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(1, 5),
    extra=st.integers(1, 3),
    victim=st.integers(0, 100),
    delta=st.integers(1, 2**64),
)
def test_wrong_share_beyond_t_is_detected(t: int, extra: int, victim: int, delta: int) -> None:
    secret = os.urandom(32)
    shares = split(secret, t, t + extra)
    index = victim % len(shares)
    bad = Share(x=shares[index].x, y=(shares[index].y + delta) % PRIME)
    shares[index] = bad
    with pytest.raises(ShareError, match="inconsistent"):
        combine(shares, t, 32)


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 5), victim=st.integers(0, 100), delta=st.integers(1, 2**64))
def test_wrong_share_is_caught_by_commitment(t: int, victim: int, delta: int) -> None:
    secret = os.urandom(32)
    shares = split(secret, t, t)
    index = victim % t
    shares[index] = Share(x=shares[index].x, y=(shares[index].y + delta) % PRIME)
    with pytest.raises(ShareError):
        combine(shares, t, 32, commitment(secret))


@settings(max_examples=25, deadline=None)
@given(
    secrets=st.lists(st.binary(min_size=32, max_size=32), min_size=2, max_size=5),
    victim=st.integers(0, 9),
    delta=st.integers(1, PRIME - 1),
)
def test_secrets_released_by_the_same_holders_reconstruct_each_its_own(
    secrets: list[bytes], victim: int, delta: int
) -> None:
    """The interpolation basis is cached per set of holders (x): many secrets shared to
    the same holders (every org's self-mask seed in an unmasking) each reconstruct to
    themselves, and a wrong share is still caught once the cache is warm."""
    t, n = 4, 10
    sets = [split(secret, t, n) for secret in secrets]
    order = [7, 2, 9, 0, 5, 3, 1, 8, 6, 4]  # the same x, in the same order, for each
    for secret, shares in zip(secrets, sets, strict=True):
        assert combine([shares[i] for i in order], t, 32) == secret
    bad = list(sets[-1])
    bad[victim] = Share(bad[victim].x, (bad[victim].y + delta) % PRIME)
    with pytest.raises(ShareError):
        combine([bad[i] for i in order], t, 32, commitment(secrets[-1]))


@given(t=st.integers(2, 6))
def test_fewer_than_t_is_refused(t: int) -> None:
    shares = split(b"k" * 32, t, t + 1)
    with pytest.raises(ShareError, match=f"at least {t}"):
        combine(shares[: t - 1], t, 32)


def test_duplicated_x_is_refused() -> None:
    shares = split(b"k" * 32, 3, 5)
    with pytest.raises(ShareError, match="duplicated"):
        combine([shares[0], shares[1], shares[1]], 3, 32)
    with pytest.raises(ShareError, match="duplicated"):
        combine([shares[0], shares[1], Share(x=shares[1].x, y=shares[2].y)], 2, 32)


def test_commitment_mismatch_and_wrong_length() -> None:
    shares = split(b"k" * 32, 2, 3)
    with pytest.raises(ShareError, match="commitment"):
        combine(shares, 2, 32, commitment(b"j" * 32))
    with pytest.raises(ShareError, match="length"):
        combine(shares, 2, 4)


def test_share_serialization() -> None:
    share = Share(x=3, y=PRIME - 1)
    data = share.to_bytes()
    assert len(data) == SHARE_BYTES == 68
    assert Share.from_bytes(data) == share
    with pytest.raises(ShareError, match="68"):
        Share.from_bytes(data[:-1])
    with pytest.raises(ShareError):
        Share.from_bytes(b"\x00\x00" + data[2:])  # x = 0 would be the secret itself
    with pytest.raises(ShareError):
        Share.from_bytes(b"\x00\x01" + PRIME.to_bytes(66, "big"))
    with pytest.raises(ShareError):
        Share(x=1, y=-1)


@pytest.mark.parametrize(
    ("secret", "t", "n"),
    [(b"", 1, 1), (b"x" * 65, 1, 1), (b"x", 0, 1), (b"x", 3, 2), (b"x", 1, 70000)],
    ids=["empty", "too-long", "t-zero", "t-above-n", "n-too-large"],
)
def test_split_validation(secret: bytes, t: int, n: int) -> None:
    with pytest.raises(ConfigError):
        split(secret, t, n)


def test_commitment_is_domain_separated() -> None:
    assert commitment(b"s") != hashlib.sha256(b"s").digest()
    assert len(commitment(b"s")) == 32


def test_shares_travel_encrypted_to_their_holder() -> None:
    ctx = RoundContext(federation="fed", run="run", round=1)
    dealer, holder = generate_keypair(bytes(range(32))), generate_keypair(bytes(range(1, 33)))
    key = share_encryption_key(agree(dealer.private, holder.public), ctx, "dealer", "holder")
    share = split(b"s" * 32, 2, 3)[1]
    aad = ctx.to_bytes() + b"dealer->holder"
    blob = encrypt(key, share.to_bytes(), aad)
    holder_key = share_encryption_key(agree(holder.private, dealer.public), ctx, "holder", "dealer")
    assert Share.from_bytes(decrypt(holder_key, blob, aad)) == share
    for position in (0, 12, len(blob) - 1):
        tampered = bytearray(blob)
        tampered[position] ^= 0x01
        with pytest.raises(DecryptionError):
            decrypt(holder_key, bytes(tampered), aad)
    with pytest.raises(DecryptionError):
        decrypt(holder_key, blob, ctx.to_bytes() + b"dealer->other")
