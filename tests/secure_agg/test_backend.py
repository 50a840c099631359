"""Both backends satisfy one aggregation interface and give the same sums."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_agg.backend import (
    AggregationBackend,
    CkksBackend,
    MaskedBackend,
    ring_from_bytes,
    ring_to_bytes,
)
from secure_agg.ckks import CkksKeyHolder, CkksParams, KeyHolderRefusal
from secure_agg.codec import FixedPointCodec
from secure_agg.errors import ConfigError, RingError
from secure_agg.keys import RoundContext
from secure_agg.protocol import ProtocolConfig, SecAggPeer

CTX = RoundContext("fed-test", "run-b", 3)
ORGS = ["org-a", "org-b", "org-c", "org-d"]


def _identities() -> tuple[
    dict[str, Callable[[bytes], bytes]], Callable[[str, bytes, bytes], bool]
]:
    keys = {
        o: Ed25519PrivateKey.from_private_bytes(hashlib.sha256(o.encode()).digest()) for o in ORGS
    }

    def verify(sender: str, data: bytes, signature: bytes) -> bool:
        try:
            keys[sender].public_key().verify(signature, data)
        except (KeyError, InvalidSignature):
            return False
        return True

    return {o: k.sign for o, k in keys.items()}, verify


def _peers_at_masked_input(config: ProtocolConfig) -> dict[str, SecAggPeer]:
    """Drive every peer through key advertisement and share exchange."""
    signers, verify = _identities()
    peers = {
        o: SecAggPeer(config, o, signers[o], verify, rng=np.random.default_rng([7, i]).bytes)
        for i, o in enumerate(config.participants)
    }
    adverts = {o: p.advertise_keys().to_bytes() for o, p in peers.items()}
    for o, p in peers.items():
        for sender, wire in adverts.items():
            if sender != o:
                p.receive(wire)
        p.close_advertise()
    shares = {o: p.share_keys() for o, p in peers.items()}
    for msgs in shares.values():
        for recipient, msg in msgs.items():
            peers[recipient].receive(msg.to_bytes())
    for p in peers.values():
        p.close_shares()
    return peers


def test_masked_backend_sums_through_the_protocol() -> None:
    length = 1000
    config = ProtocolConfig(CTX, tuple(ORGS), threshold=3, vector_length=length)
    codec = FixedPointCodec(bits=32, clip=1.0, max_summands=len(ORGS))
    peers = _peers_at_masked_input(config)
    backends = {
        o: MaskedBackend(p, codec, np.random.default_rng(i))
        for i, (o, p) in enumerate(peers.items())
    }
    assert all(isinstance(b, AggregationBackend) for b in backends.values())
    rng = np.random.default_rng(1)
    xs = {o: rng.uniform(-1.0, 1.0, length) for o in ORGS}
    payloads = {o: backends[o].protect(xs[o]) for o in ORGS}
    # a masked payload alone is far from its encoded input
    encoded = codec.encode(xs["org-a"], np.random.default_rng(0))
    masked_a = ring_from_bytes(payloads["org-a"], 32, length)
    assert np.mean(masked_a == encoded) < 0.01
    total = backends["org-a"].add(
        backends["org-b"].add(payloads["org-a"], payloads["org-b"]),
        backends["org-c"].add(payloads["org-c"], payloads["org-d"]),
    )
    unmasks = {o: peers[o].unmask(ORGS).to_bytes() for o in ORGS}
    for o, p in peers.items():
        for sender, wire in unmasks.items():
            if sender != o:
                p.receive(wire)
    expected = np.sum(list(xs.values()), axis=0)
    bound = codec.sum_error_bound(len(ORGS))
    for o in ORGS:
        got = backends[o].open(total)
        assert got.dtype == np.float64
        assert np.max(np.abs(got - expected)) <= bound


def test_masked_backend_refuses_mismatched_ring_width() -> None:
    config = ProtocolConfig(CTX, tuple(ORGS), threshold=3, vector_length=4, bits=64)
    peers = _peers_at_masked_input(config)
    with pytest.raises(ConfigError, match="bits"):
        MaskedBackend(peers["org-a"], FixedPointCodec(bits=32), np.random.default_rng(0))


def test_ckks_backend_sums_and_only_the_key_holder_opens() -> None:
    holder = CkksKeyHolder(CkksParams(), threshold=3, participants=ORGS[:3])
    backends = {o: CkksBackend(holder.public, o) for o in ORGS[1:3]}
    backends["org-a"] = CkksBackend(holder.public, "org-a", key_holder=holder)
    assert all(isinstance(b, AggregationBackend) for b in backends.values())
    xs = {o: np.linspace(-1.0, 1.0, 50) * (i + 1) for i, o in enumerate(ORGS[:3])}
    total = backends["org-b"].protect(xs["org-b"])
    total = backends["org-c"].add(total, backends["org-c"].protect(xs["org-c"]))
    total = backends["org-b"].add(total, backends["org-a"].protect(xs["org-a"]))
    with pytest.raises(KeyHolderRefusal, match="not the round's key holder"):
        backends["org-b"].open(total)
    np.testing.assert_allclose(
        backends["org-a"].open(total), np.sum(list(xs.values()), axis=0), atol=1e-4
    )


def test_ckks_backend_refuses_a_foreign_key_holder() -> None:
    a = CkksKeyHolder(CkksParams(), threshold=2, participants=ORGS)
    b = CkksKeyHolder(CkksParams(), threshold=2, participants=ORGS)
    with pytest.raises(ConfigError, match="another public context"):
        CkksBackend(a.public, "org-a", key_holder=b)


@settings(max_examples=50, deadline=None)
@given(
    bits=st.sampled_from([32, 64]),
    values=st.lists(st.integers(0, 2**64 - 1), min_size=0, max_size=40),
)
def test_ring_payload_round_trip(bits: int, values: list[int]) -> None:
    y = np.array([v % 2**bits for v in values], dtype=np.uint32 if bits == 32 else np.uint64)
    wire = ring_to_bytes(y)
    assert len(wire) == 13 + y.nbytes
    back = ring_from_bytes(wire, bits, len(values))
    assert back.flags.writeable
    np.testing.assert_array_equal(back, y)


@pytest.mark.parametrize(
    ("mutate", "bits", "length", "match"),
    [
        (lambda w: b"XXXX" + w[4:], 32, None, "magic"),
        (lambda w: w, 64, None, "32-bit"),
        (lambda w: w, 32, 4, "expected 4"),
        (lambda w: w[:-1], 32, None, "does not match"),
        (lambda w: w[:5], 32, None, "truncated"),
    ],
    ids=["magic", "width", "length", "body", "header"],
)
def test_ring_payload_rejects_bad_frames(
    mutate: Callable[[bytes], bytes], bits: int, length: int | None, match: str
) -> None:
    wire = ring_to_bytes(np.arange(3, dtype=np.uint32))
    with pytest.raises(RingError, match=match):
        ring_from_bytes(mutate(wire), bits, length)
