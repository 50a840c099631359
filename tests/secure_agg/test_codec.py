"""Fixed-point codec: vectors, headroom refusal, error bound, unbiased rounding."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_agg import codec as codec_module
from secure_agg.codec import FixedPointCodec
from secure_agg.errors import ConfigError, RingError
from secure_agg.ring import ring_sum

VECTORS = json.loads((Path(__file__).resolve().parents[1] / "vectors" / "codec.json").read_text())
CASES = VECTORS["cases"]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_codec_vectors(case: dict[str, Any]) -> None:
    codec = FixedPointCodec(**case["codec"])
    assert codec.frac_bits == case["frac_bits"]
    x = np.asarray(case["x"], dtype=case["dtype"])
    encoded = codec.encode(x, np.random.default_rng(case["seed"]))
    assert [f"{int(w):0{codec.bits // 4}x}" for w in encoded] == case["encoded"]
    assert codec.decode(encoded).tolist() == case["decoded"]


def test_default_resolves_largest_frac_bits() -> None:
    codec = FixedPointCodec()
    assert codec.frac_bits == 30  # ceil(1 * 2**30) <= 2**31 - 1 < 2**31
    assert codec.scale == 2.0**30
    assert FixedPointCodec(bits=32, clip=1.0, max_summands=8).frac_bits == 27
    assert FixedPointCodec(bits=64, clip=1.0, max_summands=1000).frac_bits == 53
    assert FixedPointCodec(bits=32, clip=1.0, max_summands=2, noise_bound=1.0).frac_bits == 28


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"bits": 8}, ["bits"]),
        ({"clip": 0.0}, ["clip"]),
        ({"clip": math.nan}, ["clip"]),
        ({"clip": math.inf}, ["clip"]),
        ({"max_summands": 0}, ["max_summands"]),
        ({"noise_bound": -1.0}, ["noise_bound"]),
        ({"frac_bits": -1}, ["frac_bits"]),
        ({"frac_bits": 31}, ["frac_bits"]),
        ({"max_summands": 8, "frac_bits": 28}, ["frac_bits", "clip", "max_summands", "bits=64"]),
        ({"clip": 1e12}, ["clip", "max_summands", "bits=64"]),
        ({"clip": 1e300, "bits": 64}, ["clip", "bits=64"]),
        ({"max_summands": 2**40}, ["max_summands", "bits=64"]),
        ({"noise_bound": 1e10, "max_summands": 4}, ["noise_bound", "bits=64"]),
    ],
    ids=[
        "bits-8",
        "clip-zero",
        "clip-nan",
        "clip-inf",
        "no-summands",
        "negative-noise",
        "negative-frac",
        "frac-too-wide",
        "frac-overflows",
        "clip-too-large",
        "clip-overflows-float",
        "too-many-summands",
        "noise-too-large",
    ],
)
def test_overflowing_or_invalid_config_is_refused(kwargs: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        FixedPointCodec(**kwargs)
    assert isinstance(info.value, ValueError)
    for name in names:
        assert name in str(info.value)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([32, 64]),
    clip=st.floats(1e-3, 1e3),
    n=st.integers(1, 300),
    noise_bound=st.sampled_from([0.0, 0.1, 3.0]),
)
def test_worst_case_sum_never_wraps(bits: int, clip: float, n: int, noise_bound: float) -> None:
    try:
        codec = FixedPointCodec(bits=bits, clip=clip, max_summands=n, noise_bound=noise_bound)
    except ConfigError:
        return  # refused up front: nothing can wrap
    rng = np.random.default_rng(0)
    extreme = np.array([clip, -clip, clip * 10, -clip * 10], dtype=np.float64)
    encoded = [codec.encode(extreme, rng) for _ in range(n)]
    noise = math.ceil(noise_bound * codec.scale)
    signed = codec.decode(ring_sum(encoded)) * codec.scale
    signed_dtype = np.int64 if bits == 64 else np.int32
    exact = [sum(int(e.view(signed_dtype)[i]) for e in encoded) for i in range(4)]
    limit = 2 ** (bits - 1) - 1
    for i, total in enumerate(exact):
        with_noise = abs(total) + n * noise
        assert with_noise <= limit
        assert signed[i] == pytest.approx(total, rel=2**-50)
        assert (signed[i] > 0) == (extreme[i] > 0)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([32, 64]),
    clip=st.floats(0.01, 100.0),
    max_summands=st.integers(1, 50),
    frac_drop=st.integers(0, 20),
    dtype=st.sampled_from(["float32", "float64"]),
    data=st.data(),
)
def test_sum_error_is_within_documented_bound(
    bits: int, clip: float, max_summands: int, frac_drop: int, dtype: str, data: st.DataObject
) -> None:
    largest = FixedPointCodec(bits=bits, clip=clip, max_summands=max_summands).frac_bits
    assert largest is not None
    codec = FixedPointCodec(
        bits=bits, clip=clip, max_summands=max_summands, frac_bits=max(0, largest - frac_drop)
    )
    n = data.draw(st.integers(1, max_summands))
    width = data.draw(st.integers(1, 8))
    element = st.floats(-3 * clip, 3 * clip)  # cast to `dtype` below
    xs = [
        np.array(data.draw(st.lists(element, min_size=width, max_size=width)), dtype=dtype)
        for _ in range(n)
    ]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32)))
    decoded = codec.decode(ring_sum(codec.encode(x, rng) for x in xs))
    bound = codec.sum_error_bound(n)
    for i in range(width):
        exact = math.fsum(min(max(float(x[i]), -clip), clip) for x in xs)
        assert abs(decoded[i] - exact) <= bound


@pytest.mark.parametrize("bits", [32, 64], ids=["b32", "b64"])
def test_stochastic_rounding_is_unbiased(bits: int) -> None:
    codec = FixedPointCodec(bits=bits, clip=1.0, frac_bits=2)  # ring unit 0.25
    count = 200_000
    for value in (0.3, -0.3, 0.0625, 0.9):
        decoded = codec.decode(codec.encode(np.full(count, value), np.random.default_rng(7)))
        assert set(np.unique(decoded)) <= {math.floor(value * 4) / 4, math.ceil(value * 4) / 4}
        # The rounding error has |e| < 0.25, so its standard deviation is below 0.125.
        assert abs(decoded.mean() - value) < 5 * 0.125 / math.sqrt(count)


def test_exact_values_are_not_perturbed() -> None:
    codec = FixedPointCodec(bits=64, clip=1.0)
    x = np.array([0.5, -0.25, 1.0, -1.0, 2.0**-60, 0.0])
    np.testing.assert_array_equal(codec.decode(codec.encode(x, np.random.default_rng(0))), x)


@pytest.mark.parametrize("bits", [32, 64], ids=["b32", "b64"])
def test_encoding_is_reproducible_and_independent_of_chunking(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    codec = FixedPointCodec(bits=bits, clip=2.0, max_summands=4)
    x = np.random.default_rng(1).normal(size=100_003)  # float64: random low bits even at b64
    first = codec.encode(x, np.random.default_rng(99))
    np.testing.assert_array_equal(first, codec.encode(x, np.random.default_rng(99)))
    monkeypatch.setattr(codec_module, "_CHUNK", 1000)
    np.testing.assert_array_equal(first, codec.encode(x, np.random.default_rng(99)))
    assert not np.array_equal(first, codec.encode(x, np.random.default_rng(100)))
    rng, reference = np.random.default_rng(99), np.random.default_rng(99)
    codec.encode(x, rng)
    reference.bytes(32)  # encode draws exactly one 32-byte key, whatever the length
    assert rng.random() == reference.random()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_non_finite_input_is_refused(bad: float, dtype: str) -> None:
    codec = FixedPointCodec()
    x = np.zeros(70_000, dtype=dtype)
    x[65_000] = bad
    rng = np.random.default_rng(0)
    with pytest.raises(RingError, match="NaN or Inf") as info:
        codec.encode(x, rng)
    assert isinstance(info.value, ValueError)
    assert rng.random() == np.random.default_rng(0).random()  # nothing was drawn


def test_bad_inputs_are_refused() -> None:
    codec = FixedPointCodec()
    rng = np.random.default_rng(0)
    with pytest.raises(RingError, match="float32 or float64"):
        codec.encode(np.zeros(3, np.int64), rng)
    with pytest.raises(RingError, match="one-dimensional"):
        codec.encode(np.zeros((2, 2)), rng)
    with pytest.raises(ConfigError, match="rng"):
        codec.encode(np.zeros(3), 0)  # type: ignore[arg-type]
    with pytest.raises(RingError):
        codec.decode(np.zeros(3, np.uint64))
    with pytest.raises(ConfigError, match="n_summands"):
        codec.sum_error_bound(2)
    assert codec.encode(np.zeros(0), rng).shape == (0,)


def test_codec_is_frozen_and_compares_by_resolved_value() -> None:
    assert FixedPointCodec() == FixedPointCodec(frac_bits=30)
    with pytest.raises(AttributeError):
        FixedPointCodec().clip = 2.0  # type: ignore[misc]


def test_error_bound_is_nearly_attained() -> None:
    codec = FixedPointCodec(bits=32, clip=1.0, frac_bits=10)
    x = np.full(100_000, 0.999 / 1024)  # rounds down (error 0.999 units) once in a thousand
    error = np.abs(codec.decode(codec.encode(x, np.random.default_rng(3))) - x).max()
    bound = codec.sum_error_bound(1)
    assert 0.99 * bound < error <= bound


def test_the_16_bit_ring_holds_a_fixed_point_sum_too() -> None:
    codec = FixedPointCodec(bits=16, clip=1.0, max_summands=4)
    assert codec.frac_bits == 12  # 4 * 2^12 <= 2^15 - 1
    rng = np.random.default_rng(0)
    xs = [rng.uniform(-1, 1, size=100) for _ in range(4)]
    total = codec.decode(ring_sum(codec.encode(x, rng) for x in xs))
    assert np.abs(total - np.sum(xs, axis=0)).max() <= codec.sum_error_bound(4)
