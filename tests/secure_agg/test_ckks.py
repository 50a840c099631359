"""CKKS backend: sums, packing, framing, the key holder's refusals and the trust model.

Decryption tolerance: with the default parameters (N = 4096, chain (50, 20), scale
2^30) one fresh ciphertext decrypts within about 4e-6 of its input (measured); a sum
of n ciphertexts adds the noises, so ``TOL = 1e-4`` for n <= 5 leaves a margin of
about 5x over the worst coordinate seen while keeping the check meaningful (a wrong
chunk, wrong key or lost summand is off by O(1)).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_agg.ckks import (
    CkksBundle,
    CkksKeyHolder,
    CkksParams,
    CkksPublicContext,
    KeyHolderRefusal,
    choose_key_holder,
    ckks_add,
    ckks_encrypt,
    ckks_sum,
    ring_order,
    simulate_round,
)
from secure_agg.errors import ConfigError, ProtocolError, RingError, SecAggError
from secure_agg.keys import RoundContext

TOL = 1e-4
PARAMS = CkksParams()
SLOTS = PARAMS.slots
VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parents[1] / "vectors" / "ckks.json").read_text()
)
CTX = RoundContext("fed-test", "run-1", 7)


def _holder(n: int, threshold: int = 2) -> tuple[CkksKeyHolder, list[str]]:
    ids = [f"org-{i}" for i in range(n)]
    return CkksKeyHolder(PARAMS, threshold=threshold, participants=ids), ids


def _vectors(n: int, length: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1.0, 1.0, length) for _ in range(n)]


# --- sums ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [3, 5])
def test_sum_of_n_decrypts_within_tolerance(n: int) -> None:
    holder, ids = _holder(n, threshold=n)
    public = CkksPublicContext.from_bytes(holder.public_context_bytes())
    xs = _vectors(n, 3000, seed=n)
    bundles = [ckks_encrypt(public, x, contributor=i) for x, i in zip(xs, ids, strict=True)]
    total = bundles[0]
    for b in bundles[1:]:
        total = ckks_add(public, total, b)
    got = holder.decrypt_sum(total)
    assert got.dtype == np.float64
    assert got.shape == (3000,)
    np.testing.assert_allclose(got, np.sum(xs, axis=0), rtol=0, atol=TOL)


def test_ckks_sum_equals_pairwise_adds() -> None:
    holder, ids = _holder(4, threshold=4)
    xs = _vectors(4, 100, seed=11)
    bundles = [ckks_encrypt(holder.public, x, contributor=i) for x, i in zip(xs, ids, strict=True)]
    summed = CkksBundle.from_bytes(ckks_sum(holder.public, bundles))
    assert summed.contributors == tuple(ids)
    np.testing.assert_allclose(
        holder.decrypt_sum(summed.to_bytes()), np.sum(xs, axis=0), rtol=0, atol=TOL
    )


@pytest.mark.parametrize("length", [1, SLOTS, SLOTS + 1, 10_000])
def test_any_length_packs_into_enough_ciphertexts(length: int) -> None:
    holder, ids = _holder(2)
    xs = _vectors(2, length, seed=length)
    a = ckks_encrypt(holder.public_context_bytes(), xs[0], contributor=ids[0])
    b = ckks_encrypt(holder.public, xs[1].astype(np.float32), contributor=ids[1])
    bundle = CkksBundle.from_bytes(a)
    assert bundle.length == length
    assert len(bundle.chunks) == -(-length // SLOTS)
    got = holder.decrypt_sum(ckks_add(holder.public, a, b))
    expected = xs[0] + xs[1].astype(np.float32).astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=0, atol=TOL)


def test_wire_bytes_per_parameter_at_most_32() -> None:
    holder, ids = _holder(2)
    blob = ckks_encrypt(holder.public, _vectors(1, 4 * SLOTS)[0], contributor=ids[0])
    assert len(blob) / (4 * SLOTS) <= 32.0


def test_values_at_the_stated_bound_still_decode() -> None:
    holder, ids = _holder(2)
    peak = PARAMS.max_abs_sum / 2
    x = np.array([peak, -peak, 0.5, -0.25])
    total = ckks_add(
        holder.public,
        ckks_encrypt(holder.public, x, contributor=ids[0]),
        ckks_encrypt(holder.public, x, contributor=ids[1]),
    )
    np.testing.assert_allclose(holder.decrypt_sum(total), 2 * x, rtol=0, atol=1e-3)


# --- the key holder -----------------------------------------------------------------


def test_key_holder_refuses_a_single_contribution() -> None:
    holder, ids = _holder(3)
    single = ckks_encrypt(holder.public, np.ones(5), contributor=ids[0])
    with pytest.raises(KeyHolderRefusal, match="at least 2"):
        holder.decrypt_sum(single)
    # the refusal did not use up the round's one decryption
    pair = ckks_add(
        holder.public, single, ckks_encrypt(holder.public, np.ones(5), contributor=ids[1])
    )
    np.testing.assert_allclose(holder.decrypt_sum(pair), np.full(5, 2.0), atol=TOL)


def test_key_holder_refuses_below_threshold_and_outsiders() -> None:
    holder, ids = _holder(4, threshold=3)
    a, b = (ckks_encrypt(holder.public, np.ones(3), contributor=i) for i in ids[:2])
    with pytest.raises(KeyHolderRefusal, match="at least 3"):
        holder.decrypt_sum(ckks_add(holder.public, a, b))
    c = ckks_encrypt(holder.public, np.ones(3), contributor="mallory")
    with pytest.raises(KeyHolderRefusal, match="non-participants"):
        holder.decrypt_sum(ckks_sum(holder.public, [a, b, c]))


def test_key_holder_opens_one_aggregate_per_round() -> None:
    holder, ids = _holder(3)
    xs = _vectors(3, 8, seed=3)
    bundles = [ckks_encrypt(holder.public, x, contributor=i) for x, i in zip(xs, ids, strict=True)]
    holder.decrypt_sum(ckks_sum(holder.public, bundles))
    # a second sum over a subset would reveal the missing participant's vector
    with pytest.raises(KeyHolderRefusal, match="one aggregate per round"):
        holder.decrypt_sum(ckks_sum(holder.public, bundles[:2]))


def test_released_sum_is_not_the_plain_decryption_of_the_aggregate() -> None:
    """The result carries fresh noise, so (aggregate, result) does not pin the key."""
    import tenseal as ts

    holder, ids = _holder(2)
    xs = _vectors(2, 64, seed=5)
    total = ckks_sum(
        holder.public,
        [ckks_encrypt(holder.public, x, contributor=i) for x, i in zip(xs, ids, strict=True)],
    )
    chunk = CkksBundle.from_bytes(total).chunks[0]
    plain = np.asarray(ts.ckks_vector_from(holder._secret, chunk).decrypt())
    released = holder.decrypt_sum(total)
    np.testing.assert_allclose(released, plain, atol=TOL)
    assert not np.array_equal(released, plain)


def test_malformed_chunks_are_refused_without_using_up_the_round() -> None:
    holder, ids = _holder(3)
    a, b = (ckks_encrypt(holder.public, np.ones(5), contributor=i) for i in ids[:2])
    good = CkksBundle.from_bytes(ckks_add(holder.public, a, b))
    garbage = CkksBundle(good.fingerprint, 5, good.contributors, (b"not a ciphertext",))
    with pytest.raises(ConfigError, match="chunk 0 is not"):
        holder.decrypt_sum(garbage.to_bytes())
    short = CkksBundle.from_bytes(ckks_encrypt(holder.public, np.ones(3), contributor=ids[2]))
    resized = CkksBundle(good.fingerprint, 5, good.contributors, short.chunks)
    with pytest.raises(ConfigError, match="holds 3 values, expected 5"):
        holder.decrypt_sum(resized.to_bytes())
    with pytest.raises(ConfigError, match="holds 3 values, expected 5"):
        ckks_add(
            holder.public,
            resized.to_bytes(),
            ckks_encrypt(holder.public, np.ones(5), contributor=ids[2]),
        )
    np.testing.assert_allclose(holder.decrypt_sum(good.to_bytes()), np.full(5, 2.0), atol=TOL)


def test_key_holder_rejects_bundles_under_another_key() -> None:
    holder, ids = _holder(2)
    other, _ = _holder(2)
    a, b = (ckks_encrypt(other.public, np.ones(3), contributor=i) for i in ids)
    with pytest.raises(ConfigError, match="fingerprint"):
        holder.decrypt_sum(ckks_add(other.public, a, b))
    with pytest.raises(ConfigError, match="fingerprint"):
        ckks_add(holder.public, a, b)


@pytest.mark.parametrize("threshold", [1, 0, True, 5])
def test_key_holder_threshold_is_validated(threshold: int) -> None:
    with pytest.raises(ConfigError, match="threshold"):
        CkksKeyHolder(PARAMS, threshold=threshold, participants=["a", "b", "c", "d"])


def test_public_context_holds_no_secret_key() -> None:
    holder, ids = _holder(2)
    public = CkksPublicContext.from_bytes(holder.public_context_bytes())
    assert not public.context.is_private()
    assert public.fingerprint == holder.public.fingerprint
    bundle = CkksBundle.from_bytes(ckks_encrypt(public, np.ones(3), contributor=ids[0]))
    import tenseal as ts

    vec = ts.ckks_vector_from(public.context, bundle.chunks[0])
    with pytest.raises(ValueError, match="secret"):
        vec.decrypt()
    with pytest.raises(ConfigError, match="secret key"):
        CkksPublicContext(PARAMS, holder._secret, b"x")


def test_public_context_rejects_garbage() -> None:
    holder, _ = _holder(2)
    wire = holder.public_context_bytes()
    with pytest.raises(ConfigError, match="magic"):
        CkksPublicContext.from_bytes(b"XXXX" + wire[4:])
    with pytest.raises(ConfigError, match="TenSEAL"):
        CkksPublicContext.from_bytes(wire[:40])


# --- errors on inputs ---------------------------------------------------------------


def test_add_refuses_mismatched_lengths_and_double_counting() -> None:
    holder, ids = _holder(3)
    a = ckks_encrypt(holder.public, np.ones(4), contributor=ids[0])
    b = ckks_encrypt(holder.public, np.ones(5), contributor=ids[1])
    with pytest.raises(RingError, match="lengths 4 and 5"):
        ckks_add(holder.public, a, b)
    with pytest.raises(ConfigError, match="counted twice"):
        ckks_add(holder.public, a, a)
    with pytest.raises(RingError, match="at least one"):
        ckks_sum(holder.public, [])


@pytest.mark.parametrize(
    ("vector", "error", "match"),
    [
        (np.ones((2, 2)), RingError, "one-dimensional"),
        (np.array([]), RingError, "one-dimensional"),
        (np.array([1.0, np.nan]), RingError, "NaN"),
        (np.array(["a"]), RingError, "real-valued"),
        (np.array([PARAMS.max_abs_sum * 2]), ConfigError, "global_scale_bits"),
    ],
    ids=["2d", "empty", "nan", "strings", "too-large"],
)
def test_encrypt_rejects_bad_vectors(
    vector: np.ndarray, error: type[Exception], match: str
) -> None:
    holder, _ = _holder(2)
    with pytest.raises(error, match=match):
        ckks_encrypt(holder.public, vector, contributor="org-0")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"poly_modulus_degree": 3000}, "poly_modulus_degree"),
        ({"coeff_mod_bit_sizes": (50,)}, "coeff_mod_bit_sizes"),
        ({"coeff_mod_bit_sizes": [50, 20]}, "coeff_mod_bit_sizes"),
        ({"coeff_mod_bit_sizes": (61, 20)}, "coeff_mod_bit_sizes"),
        ({"poly_modulus_degree": 2048, "coeff_mod_bit_sizes": (50, 20)}, "128-bit"),
        ({"global_scale_bits": 49}, "global_scale_bits"),
        ({"global_scale_bits": 5}, "global_scale_bits"),
    ],
)
def test_params_reject_invalid_values(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CkksParams(**kwargs)


def test_errors_are_secure_agg_errors() -> None:
    assert issubclass(KeyHolderRefusal, ProtocolError)
    assert issubclass(KeyHolderRefusal, SecAggError)


# --- framing: vectors and properties ------------------------------------------------


@pytest.mark.parametrize("vec", VECTORS["params"], ids=lambda v: v["wire"])
def test_params_vectors(vec: dict[str, Any]) -> None:
    params = CkksParams(
        vec["poly_modulus_degree"], tuple(vec["coeff_mod_bit_sizes"]), vec["global_scale_bits"]
    )
    assert params.to_bytes().hex() == vec["wire"]
    assert CkksParams.from_bytes(bytes.fromhex(vec["wire"])) == (params, len(vec["wire"]) // 2)


@pytest.mark.parametrize("vec", VECTORS["bundle"], ids=lambda v: v["id"])
def test_bundle_vectors(vec: dict[str, Any]) -> None:
    bundle = CkksBundle(
        bytes.fromhex(vec["fingerprint"]),
        vec["length"],
        tuple(vec["contributors"]),
        tuple(bytes.fromhex(c) for c in vec["chunks"]),
    )
    assert bundle.to_bytes().hex() == vec["wire"]
    assert CkksBundle.from_bytes(bytes.fromhex(vec["wire"])) == bundle


@pytest.mark.parametrize("vec", VECTORS["bundle_invalid"], ids=lambda v: v["id"])
def test_bundle_invalid_vectors(vec: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        CkksBundle.from_bytes(bytes.fromhex(vec["wire"]))


@pytest.mark.parametrize("vec", VECTORS["key_holder"], ids=lambda v: v["id"])
def test_key_holder_vectors(vec: dict[str, Any]) -> None:
    ctx = RoundContext(vec["federation"], vec["run"], vec["round"])
    assert choose_key_holder(ctx, vec["participants"]) == vec["key_holder"]
    assert ring_order(ctx, vec["participants"]) == vec["ring_order"]


_ids = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(
    fingerprint=st.binary(min_size=32, max_size=32),
    length=st.integers(1, 2**40),
    contributors=st.sets(_ids, min_size=1, max_size=6),
    chunks=st.lists(st.binary(max_size=40), max_size=4),
)
def test_bundle_round_trip_and_truncation(
    fingerprint: bytes, length: int, contributors: set[str], chunks: list[bytes]
) -> None:
    bundle = CkksBundle(fingerprint, length, tuple(sorted(contributors)), tuple(chunks))
    wire = bundle.to_bytes()
    assert CkksBundle.from_bytes(wire) == bundle
    for cut in {0, 5, 40, len(wire) // 2, len(wire) - 1}:
        with pytest.raises(ConfigError):
            CkksBundle.from_bytes(wire[:cut])


@settings(max_examples=60, deadline=None)
@given(
    members=st.sets(st.text(min_size=1, max_size=8), min_size=1, max_size=12),
    start=st.integers(0, 2**40),
)
def test_key_holder_rotates_through_everyone(members: set[str], start: int) -> None:
    holders = [
        choose_key_holder(RoundContext("fed", "run", start + k), members)
        for k in range(len(members))
    ]
    assert sorted(holders) == sorted(members)
    shuffled = list(reversed(sorted(members)))
    ctx = RoundContext("fed", "run", start)
    assert choose_key_holder(ctx, shuffled) == holders[0]
    order = ring_order(ctx, shuffled)
    assert order[0] == holders[0]
    assert sorted(order) == sorted(members)


def test_key_holder_choice_rejects_bad_participant_sets() -> None:
    with pytest.raises(ConfigError, match="distinct"):
        choose_key_holder(CTX, ["a", "a"])
    with pytest.raises(ConfigError, match="distinct"):
        choose_key_holder(CTX, [])


# --- the trust model in a simulated round -------------------------------------------


@pytest.mark.parametrize("n", [3, 5])
def test_key_holder_receives_only_the_aggregate(n: int) -> None:
    inputs = {f"org-{i}": x for i, x in enumerate(_vectors(n, SLOTS + 7, seed=40 + n))}
    result = simulate_round(CTX, inputs, threshold=n)
    holder = result.key_holder
    assert holder == choose_key_holder(CTX, inputs)
    np.testing.assert_allclose(result.total, np.sum(list(inputs.values()), axis=0), atol=TOL)

    to_holder = [m for m in result.transcript if m.recipient == holder]
    assert [m.kind for m in to_holder] == ["aggregate"]
    aggregate = CkksBundle.from_bytes(to_holder[0].payload)
    assert aggregate.contributors == tuple(sorted(inputs))

    # every ciphertext anyone else handles is under the round key, and the chain passes
    # strictly growing partial sums; none of them reaches the key holder
    partials = [m for m in result.transcript if m.kind == "partial"]
    sizes = [len(CkksBundle.from_bytes(m.payload).contributors) for m in partials]
    assert sizes == list(range(1, n))
    assert all(m.recipient != holder for m in partials)
    # the holder sends only the public context and the decrypted result
    assert {m.kind for m in result.transcript if m.sender == holder} <= {
        "public_context",
        "partial",
        "result",
    }
    sent_ciphertexts = [m for m in result.transcript if m.sender == holder and m.kind == "partial"]
    assert [len(CkksBundle.from_bytes(m.payload).contributors) for m in sent_ciphertexts] == [1]
    results = [m for m in result.transcript if m.kind == "result"]
    assert sorted(m.recipient for m in results) == sorted(set(inputs) - {holder})
    assert np.frombuffer(results[0].payload, dtype="<f8").shape == (SLOTS + 7,)


def test_round_with_dropouts_sums_survivors_only() -> None:
    inputs = {f"org-{i}": x for i, x in enumerate(_vectors(5, 50, seed=9))}
    holder = choose_key_holder(CTX, inputs)
    dropped = [p for p in ring_order(CTX, inputs) if p != holder][:2]
    result = simulate_round(CTX, inputs, threshold=3, drop=dropped)
    survivors = sorted(set(inputs) - set(dropped))
    assert result.contributors == tuple(survivors)
    np.testing.assert_allclose(
        result.total, np.sum([inputs[p] for p in survivors], axis=0), atol=TOL
    )
    assert all(m.recipient not in dropped for m in result.transcript if m.kind != "public_context")


def test_round_fails_cleanly_without_key_holder_or_quorum() -> None:
    inputs = {f"org-{i}": x for i, x in enumerate(_vectors(4, 10, seed=2))}
    holder = choose_key_holder(CTX, inputs)
    with pytest.raises(ProtocolError, match="key holder"):
        simulate_round(CTX, inputs, threshold=2, drop=[holder])
    others = [p for p in inputs if p != holder]
    with pytest.raises(KeyHolderRefusal, match="at least 4"):
        simulate_round(CTX, inputs, threshold=4, drop=others[:1])


def test_fingerprint_is_sha256_of_public_wire() -> None:
    holder, _ = _holder(2)
    assert holder.public.fingerprint == hashlib.sha256(holder.public_context_bytes()).digest()


# --- vector generation ----------------------------------------------------------------


def build_vectors() -> dict[str, Any]:
    """The content of ``tests/vectors/ckks.json`` as the code gives it today."""
    holder_cases = [
        ("fed-a", "run-1", 0, ["org-a", "org-b", "org-c"]),
        ("fed-a", "run-1", 1, ["org-a", "org-b", "org-c"]),
        ("fed-a", "run-1", 2, ["org-c", "org-a", "org-b"]),
        ("hospitals", "2026-q4", 17, ["h1", "h2", "h3", "h4", "h5"]),
        ("hospitals", "2026-q4", 18, ["h1", "h2", "h3", "h5"]),
        ("banks", "fraud", 123456789, [f"bank-{i}" for i in range(10)]),
    ]
    holders: list[dict[str, Any]] = []
    for fed, run, rnd, parts in holder_cases:
        ctx = RoundContext(fed, run, rnd)
        holders.append(
            {
                "id": f"{fed}/{run}/{rnd}/n={len(parts)}",
                "federation": fed,
                "run": run,
                "round": rnd,
                "participants": parts,
                "key_holder": choose_key_holder(ctx, parts),
                "ring_order": ring_order(ctx, parts),
            }
        )
    bundles: list[dict[str, Any]] = []
    for name, seed, length, contributors, chunks in [
        ("single", b"a", 1, ["org-a"], [b"\x01\x02\x03"]),
        ("two-chunks", b"b", 2049, ["org-a", "org-b", "org-c"], [b"chunk-0", b"chunk-1"]),
        ("unicode-id", b"c", 10, ["h\u00f4pital-1", "org-z"], [b""]),
    ]:
        b = CkksBundle(hashlib.sha256(seed).digest(), length, tuple(contributors), tuple(chunks))
        bundles.append(
            {
                "id": name,
                "fingerprint": b.fingerprint.hex(),
                "length": length,
                "contributors": contributors,
                "chunks": [c.hex() for c in chunks],
                "wire": b.to_bytes().hex(),
            }
        )
    single, two = bundles[0]["wire"], bundles[1]["wire"]
    swapped = (
        bytes.fromhex(two)
        .replace(b"org-a", b"org-X")
        .replace(b"org-b", b"org-a")
        .replace(b"org-X", b"org-b")
    )
    invalid = [
        {"id": "bad-magic", "wire": "46574358" + single[8:]},
        {"id": "bad-version", "wire": single[:8] + "02" + single[10:]},
        {"id": "truncated", "wire": two[:-4]},
        {"id": "trailing-byte", "wire": single + "00"},
        {"id": "unsorted-contributors", "wire": swapped.hex()},
        {"id": "zero-length", "wire": single[:74] + "00" * 8 + single[90:]},
        {"id": "empty", "wire": ""},
    ]
    params = [
        {
            "poly_modulus_degree": p.poly_modulus_degree,
            "coeff_mod_bit_sizes": list(p.coeff_mod_bit_sizes),
            "global_scale_bits": p.global_scale_bits,
            "wire": p.to_bytes().hex(),
        }
        for p in [CkksParams(), CkksParams(8192, (60, 40, 60), 40), CkksParams(2048, (40, 14), 25)]
    ]
    return {
        "description": (
            "CKKS framing (secure_agg.ckks): key-holder choice and ring order, bundle wire "
            "form, parameter encoding. Ciphertexts themselves are randomized by SEAL and "
            "have no byte-exact vectors. Regenerate: python -m tests.secure_agg.test_ckks"
        ),
        "key_holder": holders,
        "bundle": bundles,
        "bundle_invalid": invalid,
        "params": params,
    }


def test_vector_file_matches_the_code() -> None:
    assert build_vectors() == VECTORS


if __name__ == "__main__":
    path = Path(__file__).resolve().parents[1] / "vectors" / "ckks.json"
    path.write_text(json.dumps(build_vectors(), indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {path.name}")
