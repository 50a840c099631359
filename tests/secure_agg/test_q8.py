"""8-bit stochastic quantization into the 16-bit ring, and 64-bit values as byte limbs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_agg.errors import ConfigError, RingError
from secure_agg.q8 import (
    LEVELS,
    MAX_LIMB_SUMMANDS,
    MAX_SUMMANDS,
    Q8Codec,
    from_limbs,
    ring_bits_for,
    to_limbs,
)
from secure_agg.ring import ring_sum


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 40),
    length=st.integers(1, 64),
    spread=st.floats(1e-6, 1e3),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_sum_of_encodings_meets_the_error_bound(
    n: int, length: int, spread: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    ranges = spread * rng.uniform(0.1, 1.0, size=length)
    inputs = [rng.uniform(-1.0, 1.0, size=length) * ranges for _ in range(n)]
    codec = Q8Codec(max_summands=n)
    total = codec.decode(ring_sum(codec.encode(x, ranges, rng) for x in inputs), ranges)
    exact = np.sum(inputs, axis=0)
    assert (np.abs(total - exact) <= codec.sum_error_bound(n, ranges)).all()


def test_one_encoding_is_within_one_level_and_8_bits() -> None:
    rng = np.random.default_rng(1)
    ranges = np.full(10_000, 0.5)
    x = rng.uniform(-0.5, 0.5, size=10_000)
    levels = Q8Codec().encode(x, ranges, rng).view(np.int16)
    assert np.abs(levels).max() <= LEVELS
    assert np.abs(levels - x * LEVELS / 0.5).max() < 1.0


def test_values_beyond_their_range_are_clipped_to_it() -> None:
    rng = np.random.default_rng(2)
    ranges = np.array([1.0, 1.0, 2.0])
    decoded = Q8Codec().decode(Q8Codec().encode(np.array([5.0, -7.0, 2.0]), ranges, rng), ranges)
    np.testing.assert_array_equal(decoded, [1.0, -1.0, 2.0])


def test_stochastic_rounding_is_unbiased() -> None:
    rng = np.random.default_rng(3)
    codec = Q8Codec()
    x = np.full(200_000, 0.3 / LEVELS)  # 0.3 of a level: rounds to 0 or 1
    ranges = np.ones_like(x)
    mean = codec.decode(codec.encode(x, ranges, rng), ranges).mean()
    # 200k Bernoulli(0.3) draws: the standard error of the mean is about 0.001 levels
    assert abs(mean * LEVELS - 0.3) < 0.006


def test_the_largest_sum_fits_the_16_bit_ring() -> None:
    codec = Q8Codec(max_summands=MAX_SUMMANDS)
    rng = np.random.default_rng(4)
    ranges = np.ones(2)
    extreme = np.array([1.0, -1.0])
    total = codec.decode(
        ring_sum(codec.encode(extreme, ranges, rng) for _ in range(MAX_SUMMANDS)), ranges
    )
    np.testing.assert_array_equal(total, [MAX_SUMMANDS, -MAX_SUMMANDS])


@pytest.mark.parametrize("n", [0, MAX_SUMMANDS + 1, True, 2.0])
def test_too_many_summands_are_refused(n: object) -> None:
    with pytest.raises(ConfigError, match="max_summands"):
        Q8Codec(max_summands=n)  # type: ignore[arg-type]


def test_bad_inputs_and_ranges_are_refused() -> None:
    rng = np.random.default_rng(5)
    codec = Q8Codec()
    with pytest.raises(RingError, match="NaN"):
        codec.encode(np.array([np.nan]), np.ones(1), rng)
    with pytest.raises(RingError, match="shape"):
        codec.encode(np.zeros(3), np.ones(2), rng)
    with pytest.raises(ConfigError, match="range"):
        codec.encode(np.zeros(2), np.array([1.0, 0.0]), rng)
    with pytest.raises(RingError):
        codec.decode(np.zeros(2, dtype=np.uint32), np.ones(2))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, MAX_LIMB_SUMMANDS), seed=st.integers(0, 2**32 - 1))
def test_limb_sums_give_the_64_bit_ring_sum_exactly(n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = [rng.integers(0, 2**64, size=5, dtype=np.uint64) for _ in range(n)]
    limbs = ring_sum(to_limbs(v) for v in values)
    np.testing.assert_array_equal(from_limbs(limbs, n), ring_sum(values))


def test_limbs_refuse_a_ragged_vector_and_too_many_summands() -> None:
    with pytest.raises(RingError, match="multiple"):
        from_limbs(np.zeros(7, dtype=np.uint16))
    with pytest.raises(ConfigError, match="summands"):
        from_limbs(np.zeros(8, dtype=np.uint16), MAX_LIMB_SUMMANDS + 1)


def test_the_narrow_ring_is_the_fewest_even_bits_n_summands_need() -> None:
    assert [ring_bits_for(n) for n in (1, 2, 4, 5, 16, 17, 64, 65, MAX_SUMMANDS)] == [
        8,
        10,
        10,
        12,
        12,
        14,
        14,
        16,
        16,
    ]
    for n in range(1, MAX_SUMMANDS + 1):
        bits = ring_bits_for(n)
        # the signed levels' sum reads back, and (up to 257 summands) the limbs' sum
        assert 2 * LEVELS * n + 1 <= 1 << bits
        assert n > MAX_LIMB_SUMMANDS or 255 * n < 1 << bits
        assert bits == 8 or 255 * n >= 1 << (bits - 2)  # no narrower even width would do


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 80), seed=st.integers(0, 2**32 - 1))
def test_a_sum_reads_the_same_from_its_narrow_ring_bits_alone(n: int, seed: int) -> None:
    """What a narrow ring carries (each element modulo ``2^ring_bits``), whatever the
    bits above: the decoded sum and the 64-bit limb sum are those of the whole ring."""
    rng = np.random.default_rng(seed)
    codec = Q8Codec(max_summands=n)
    ranges = rng.uniform(0.5, 2.0, size=16)
    extremes = [rng.choice([-1.0, 1.0], size=16) * ranges for _ in range(n)]
    levels = ring_sum(codec.encode(x, ranges, rng) for x in extremes)
    bits = codec.ring_bits
    noise = rng.integers(0, 2**16, size=16, dtype=np.uint16) & ~np.uint16((1 << bits) - 1)
    narrow = (levels & np.uint16((1 << bits) - 1)) | noise
    np.testing.assert_array_equal(codec.decode(narrow, ranges), codec.decode(levels, ranges))
    np.testing.assert_array_equal(
        np.round(codec.decode(levels, ranges) / ranges * LEVELS),
        np.round(np.sum(extremes, 0) / ranges * LEVELS),  # the extremes: exact levels
    )
    if n <= MAX_LIMB_SUMMANDS:
        values = [rng.integers(0, 2**64, size=3, dtype=np.uint64) for _ in range(n)]
        limbs = ring_sum(to_limbs(v) for v in values)
        garbled = (limbs & np.uint16((1 << bits) - 1)) | (
            rng.integers(0, 2**16, size=limbs.shape[0], dtype=np.uint16)
            & ~np.uint16((1 << bits) - 1)
        )
        np.testing.assert_array_equal(from_limbs(garbled, n), ring_sum(values))
