"""A round in bounded memory: the ring sums in the masked input, the session makes it
again for a later attempt, and the unmasked sum is decoded chunk by chunk; every
result is the one of the unchunked path, bit for bit."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Collection

import numpy as np
import pytest
from coordinator_free.endpoint import Endpoint
from coordinator_free.identity import OrgIdentity
from coordinator_free.memory import InMemoryNetwork
from coordinator_free.rounds import (
    MaskedSecureSum,
    RoundConfig,
    RoundEngine,
    RoundResult,
    SecAggSession,
    SessionContext,
    endpoint_signer,
    secagg_sessions,
)

from secure_agg.codec import FixedPointCodec
from secure_agg.protocol.simulate import _ed25519_identities

CONFIG = RoundConfig(
    ready_timeout=30.0, stage_timeout=120.0, step_timeout=120.0, send_timeout=120.0
)
SEED = 11


def encode_rng(run: str, round: int, org: str) -> np.random.Generator:
    """The generator ``secagg_sessions(seed=SEED)`` encodes ``org``'s input with."""
    material = hashlib.sha256(f"{SEED}\x00{run}\x00{round}\x00{org}".encode()).digest()
    return np.random.default_rng(list(material[::-1]))


def unchunked_reference(
    codec: FixedPointCodec, inputs: dict[str, np.ndarray], run: str, round: int
) -> np.ndarray:
    """The sum as the unchunked path computes it, independently of the round engine:
    each input encoded whole, the ring sum, and one vector-wide decode."""
    total: np.ndarray | None = None
    for org, x in sorted(inputs.items()):
        ring = codec.encode(x, encode_rng(run, round, org))
        total = ring if total is None else total + ring  # wraps mod 2^64
    assert total is not None
    return total.view(np.int64).astype(np.float64) / codec.scale


async def run_engines(
    inputs: dict[str, np.ndarray], codec: FixedPointCodec, config: RoundConfig
) -> list[RoundResult]:
    orgs = sorted(inputs)
    network = InMemoryNetwork()
    ids = {o: OrgIdentity.generate(o, hashlib.sha256(o.encode()).digest()) for o in orgs}
    keys = {o: i.public_key for o, i in ids.items()}
    endpoints = [Endpoint(ids[o], "fed", network.transport(o), lambda: keys) for o in orgs]
    engines = [
        RoundEngine(
            e, lambda: orgs, secagg_sessions(*endpoint_signer(e), codec=codec, seed=SEED), config
        )
        for e in endpoints
    ]
    for e in endpoints:
        await e.start()
    try:
        results = await asyncio.gather(
            *(eng.run_round("run", 1, inputs[o]) for eng, o in zip(engines, orgs, strict=True))
        )
    finally:
        for e in endpoints:
            await e.close()
    return list(results)


@pytest.mark.slow
@pytest.mark.parametrize("owners", [None, 4], ids=["all-reduce", "owner-unmasking"])
def test_a_10m_parameter_round_equals_the_unchunked_sum_bit_for_bit(owners: int | None) -> None:
    params = 10_000_000
    orgs = [f"org-{i}" for i in range(4)]
    codec = FixedPointCodec(bits=64, clip=1.0, max_summands=4)
    rng = np.random.default_rng(5)
    inputs = {o: rng.uniform(-1, 1, params).astype(np.float32) for o in orgs}
    config = dataclasses.replace(CONFIG, owner_unmask_from=owners)
    results = asyncio.run(run_engines(inputs, codec, config))
    reference = unchunked_reference(codec, inputs, "run", 1)
    for res in results:
        assert len(res.survivors) == 4
        assert res.sum.dtype == np.float64
        assert res.sum.tobytes() == reference.tobytes()


def sessions(
    x: dict[str, np.ndarray],
    codec: FixedPointCodec | None,
    lost: Collection[tuple[str, str]] = (),
) -> dict[str, SecAggSession]:
    """Sessions of ``x``'s orgs that advertised and shared their keys, but for the
    ``(sender, receiver)`` pairs of ``lost``, whose shares never came."""
    orgs = tuple(sorted(x))
    signers, verify = _ed25519_identities(orgs, seed=3)
    out: dict[str, SecAggSession] = {}
    for o in orgs:
        ctx = SessionContext("f", "r", 1, o, orgs, 2, x[o])
        out[o] = SecAggSession(
            ctx, signers[o], verify, codec=codec, encode_rng=np.random.default_rng(len(out))
        )
    adverts = {o: s.advertise() for o, s in out.items()}
    for o, s in out.items():
        for p, data in adverts.items():
            if p != o:
                s.receive_advert(p, data)
    shares = {o: s.share_keys(frozenset(orgs)) for o, s in out.items()}
    for sender, msgs in shares.items():
        for o, data in msgs.items():
            if (sender, o) not in lost:
                out[o].receive_share(sender, data)
    return out


def _inputs(
    orgs: tuple[str, ...], length: int, float_input: bool, *, seed: int
) -> tuple[dict[str, np.ndarray], FixedPointCodec | None]:
    """Each org's input of ``length``: floats in [-1, 1) with a 32-bit codec for them,
    or ring elements with no codec."""
    rng = np.random.default_rng(seed)
    if not float_input:
        return {o: rng.integers(0, 2**32, length, dtype=np.uint32) for o in orgs}, None
    codec = FixedPointCodec(bits=32, clip=1.0, max_summands=len(orgs))
    return {o: rng.uniform(-1, 1, length) for o in orgs}, codec


@pytest.mark.parametrize("float_input", [False, True], ids=["ring-input", "float-input"])
@pytest.mark.parametrize("lost", [False, True], ids=["usual", "a-neighbour-outside-u2"])
def test_a_premasked_input_is_settled_without_a_thread_only_when_no_mask_is_left(
    float_input: bool, lost: bool
) -> None:
    """The mask stage takes :meth:`premasked_input` on its loop: the masked input
    itself when the premask's masks are exactly U2's (the same vector as masking from
    scratch), ``None`` when a premasked neighbour is outside U2 (its mask must come off
    again, which :meth:`masked_input` does off the loop) or when nothing was premasked."""
    orgs = ("a", "b", "c", "d")
    x, codec = _inputs(orgs, 3000, float_input, seed=6)
    a = sessions(x, codec, lost={("d", "a")} if lost else ())["a"]
    assert a.premasked_input() is None  # nothing premasked
    a.premask()()
    a.settle_participants(frozenset(orgs) - ({"d"} if lost else set()))
    settled = a.premasked_input()
    if lost:
        assert settled is None
        settled = a.masked_input()
    assert settled is not None
    kept = settled.copy()
    assert a.premasked_input() is None  # settled once
    # masking from scratch (what a later ring attempt does) gives the same vector
    again = a.masked_input()
    assert again.tobytes() == kept.tobytes()


@pytest.mark.parametrize("float_input", [False, True], ids=["ring-input", "float-input"])
def test_a_later_attempt_gets_the_same_masked_input_in_the_same_array(float_input: bool) -> None:
    orgs = ("a", "b", "c")
    x, codec = _inputs(orgs, 5000, float_input, seed=2)
    originals = {o: v.copy() for o, v in x.items()}
    session = sessions(x, codec)["a"]
    first = session.masked_input()
    kept = first.copy()
    first[:] = 12345  # the ring summed into it
    again = session.masked_input()
    assert again is first
    assert again.tobytes() == kept.tobytes()
    assert not np.array_equal(kept.view(np.uint8), np.asarray(originals["a"]).view(np.uint8))
    for o in orgs:  # the caller's input is never touched
        assert x[o].tobytes() == originals[o].tobytes()


def test_the_streamed_unmasked_sum_of_a_float_input_is_the_whole_vector_decode() -> None:
    rng = np.random.default_rng(4)
    orgs = ("a", "b", "c")
    codec = FixedPointCodec(bits=64, clip=1.0, max_summands=3)
    length = 3 * (1 << 20) + 17  # several stream chunks and a short last one
    x = {o: rng.uniform(-1, 1, length) for o in orgs}
    by_org = sessions(x, codec)
    total = sum((s.masked_input().copy() for s in by_org.values()), np.zeros(length, np.uint64))
    survivors = frozenset(orgs)
    releases = {o: s.unmask(survivors) for o, s in by_org.items()}
    seeds = {o: s.self_seed() for o, s in by_org.items()}
    a = by_org["a"]
    for o in ("b", "c"):
        a.receive_release(o, releases[o])
        a.receive_seed(o, seeds[o])
    kept = total.copy()
    streamed = a.unmasked_sum(total)
    assert total.tobytes() == kept.tobytes()  # the masked sum is left as it is
    plain = sum(
        (codec.encode(x[o], np.random.default_rng(i)) for i, o in enumerate(orgs)),
        np.zeros(length, np.uint64),
    )
    assert streamed.tobytes() == (plain.view(np.int64).astype(np.float64) / codec.scale).tobytes()


def test_a_64_bit_masked_sum_is_decoded_in_its_own_memory_with_the_same_values() -> None:
    codec = FixedPointCodec(bits=64, clip=1.0, max_summands=4)
    summed = np.random.default_rng(9).integers(0, 2**64, 70_000, dtype=np.uint64)
    expected = summed.view(np.int64).astype(np.float64) / codec.scale

    class Rounds:
        org_id = "a"

        async def run_round(self, *args: object, **kwargs: object) -> RoundResult:
            return RoundResult(
                run="r",
                round=1,
                sum=summed,
                participants=("a",),
                survivors=("a",),
                dropped=(),
                threshold=1,
                bytes_sent=0,
                messages_sent=0,
                ring_bytes_sent=0,
                ring_attempts=1,
                stage_times={},
                neighbours=None,
            )

    secure = MaskedSecureSum(
        Rounds(),  # type: ignore[arg-type]
        clip=1.0,
        encode=lambda v: codec.encode(v, np.random.default_rng(0)),
        decode=codec.decode,
    )
    got = asyncio.run(
        secure.run_round("r", 1, summed, participants=("a",), threshold=1, deadline=None)
    )
    assert got.total.dtype == np.float64
    assert np.shares_memory(got.total, summed)
    assert got.total.tobytes() == expected.tobytes()
