"""Org-level L2 clipping and distributed Skellam noise."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_agg.codec import FixedPointCodec
from secure_agg.dp import DistributedSkellam, add_signed, clip_l2
from secure_agg.errors import ConfigError, RingError
from secure_agg.ring import ring_sum


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50),
    bound=st.floats(1e-3, 1e3),
    dtype=st.sampled_from(["float32", "float64"]),
)
def test_clip_l2_bounds_the_norm(values: list[float], bound: float, dtype: str) -> None:
    x = np.array(values, dtype=dtype)
    clipped, factor = clip_l2(x, bound)
    norm = float(np.linalg.norm(x.astype(np.float64)))
    assert clipped.dtype == x.dtype
    assert clipped is not x
    assert 0 < factor <= 1
    assert float(np.linalg.norm(clipped.astype(np.float64))) <= bound
    if norm <= bound:
        assert factor == 1.0
        np.testing.assert_array_equal(clipped, x)
    else:
        assert factor == pytest.approx(bound / norm, rel=1e-5)


def test_clip_l2_zero_vector_and_errors() -> None:
    clipped, factor = clip_l2(np.zeros(4), 1.0)
    assert factor == 1.0
    np.testing.assert_array_equal(clipped, np.zeros(4))
    with pytest.raises(ConfigError, match="bound"):
        clip_l2(np.ones(2), 0.0)
    with pytest.raises(ConfigError, match="bound"):
        clip_l2(np.ones(2), math.nan)
    with pytest.raises(RingError, match="NaN or Inf"):
        clip_l2(np.array([1.0, math.nan]), 1.0)
    with pytest.raises(RingError):
        clip_l2(np.ones(2, np.int64), 1.0)


def test_sum_of_org_shares_has_the_target_variance() -> None:
    mech = DistributedSkellam(l2_clip=1.0, noise_multiplier=0.8, n_orgs=5, scale=2.0**6)
    rng = np.random.default_rng(20240611)
    size = 200_000
    total = sum((mech.org_noise(size, rng) for _ in range(mech.n_orgs)), np.zeros(size, np.int64))
    target = (0.8 * 2.0**6) ** 2
    assert mech.accountant_params()["variance_sum_ring"] == pytest.approx(target)
    # Sample variance of 2e5 draws: relative standard error about sqrt(2 / 2e5) = 0.3 %.
    assert total.var() == pytest.approx(target, rel=0.02)
    assert abs(total.mean()) < 5 * math.sqrt(target / size)
    one = mech.org_noise(size, rng)
    assert one.dtype == np.int64
    assert one.var() == pytest.approx(2 * mech.mu_org, rel=0.02)


def test_org_noise_is_reproducible() -> None:
    mech = DistributedSkellam(l2_clip=2.0, noise_multiplier=1.0, n_orgs=3, scale=1024.0)
    a = mech.org_noise(100, np.random.default_rng(5))
    np.testing.assert_array_equal(a, mech.org_noise(100, np.random.default_rng(5)))
    assert mech.org_noise(0, np.random.default_rng(5)).shape == (0,)


def test_zero_noise_multiplier_adds_nothing() -> None:
    mech = DistributedSkellam(l2_clip=1.0, noise_multiplier=0.0, n_orgs=2, scale=8.0)
    assert not mech.org_noise(50, np.random.default_rng(0)).any()


def test_accountant_params() -> None:
    mech = DistributedSkellam(l2_clip=0.5, noise_multiplier=2.0, n_orgs=4, scale=256.0)
    params = mech.accountant_params()
    assert params["sigma_sum"] == 1.0
    assert params["sigma_sum_ring"] == 256.0
    assert params["mu_org"] == 256.0**2 / 8
    assert params["mu_sum"] == 256.0**2 / 2
    assert params["l2_sensitivity"] == 128.0
    assert params["l1_sensitivity"] == 128.0**2
    with_dim = mech.accountant_params(dim=100)
    assert with_dim["l2_sensitivity"] == 138.0
    assert with_dim["l1_sensitivity"] == min(138.0**2, 10 * 138.0)
    assert all(isinstance(v, float) for v in with_dim.values())
    with pytest.raises(ConfigError, match="dim"):
        mech.accountant_params(dim=0)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"l2_clip": 0.0}, "l2_clip"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"n_orgs": 0}, "n_orgs"),
        ({"scale": math.inf}, "scale"),
        ({"scale": 2.0**40, "noise_multiplier": 100.0}, "scale"),
    ],
    ids=["clip-zero", "negative-multiplier", "no-orgs", "infinite-scale", "mean-too-large"],
)
def test_skellam_validation(kwargs: dict[str, Any], name: str) -> None:
    base: dict[str, Any] = {"l2_clip": 1.0, "noise_multiplier": 1.0, "n_orgs": 2, "scale": 16.0}
    with pytest.raises(ConfigError, match=name):
        DistributedSkellam(**{**base, **kwargs})


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([32, 64]),
    values=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=20),
    data=st.data(),
)
def test_add_signed_is_ring_addition(bits: int, values: list[int], data: st.DataObject) -> None:
    modulus = 2**bits
    dtype = np.uint32 if bits == 32 else np.uint64
    y = np.array([v % modulus for v in values], dtype=dtype)
    noise_values = data.draw(
        st.lists(st.integers(-(2**62), 2**62), min_size=len(values), max_size=len(values))
    )
    noise = np.array(noise_values, dtype=np.int64)
    noised = add_signed(y, noise)
    assert noised.dtype == y.dtype
    assert [int(v) for v in noised] == [
        (int(a) + b) % modulus for a, b in zip(y, noise_values, strict=True)
    ]
    np.testing.assert_array_equal(add_signed(noised, -noise), y)


def test_add_signed_rejects_bad_noise() -> None:
    with pytest.raises(RingError, match="int64"):
        add_signed(np.zeros(3, np.uint32), np.zeros(3, np.int32))
    with pytest.raises(RingError, match="shape"):
        add_signed(np.zeros(3, np.uint32), np.zeros(4, np.int64))
    with pytest.raises(RingError):
        add_signed(np.zeros(3, np.int64), np.zeros(3, np.int64))


def test_noised_sum_decodes_near_the_true_sum() -> None:
    n_orgs, dim = 4, 1000
    codec = FixedPointCodec(bits=32, clip=1.0, max_summands=n_orgs, noise_bound=0.5)
    mech = DistributedSkellam(
        l2_clip=10.0, noise_multiplier=0.001, n_orgs=n_orgs, scale=codec.scale
    )
    rng = np.random.default_rng(11)
    updates = [clip_l2(rng.normal(size=dim), 10.0)[0] for _ in range(n_orgs)]
    ring = [add_signed(codec.encode(u, rng), mech.org_noise(dim, rng)) for u in updates]
    decoded = codec.decode(ring_sum(ring))
    exact = np.clip(np.stack(updates), -1.0, 1.0).sum(axis=0)
    # Noise std 0.01 float units: 6 sigma plus the rounding bound.
    assert np.abs(decoded - exact).max() < 6 * mech.sigma_sum + codec.sum_error_bound(n_orgs)
    assert (decoded - exact).std() == pytest.approx(mech.sigma_sum, rel=0.2)
