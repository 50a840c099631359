"""The Skellam sampler against the theory, from a mean of 1 to 1e18 and beyond.

``Skellam(mu)`` has mean 0, variance ``2 mu`` and excess kurtosis ``1 / (2 mu)``; it is
even with probability ``(1 + exp(-4 mu)) / 2`` (the parity of ``Poisson(2 mu)``), and
once its spread is far above 256 its low eight bits are uniform. Each check's tolerance
is five standard errors of its estimator at the sample size used (seeds fixed).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_agg.dp import DistributedSkellam
from secure_agg.errors import ConfigError
from secure_agg.skellam import (
    DIRECT_MAX,
    MU_MAX,
    acceptance_bound,
    log_poisson_ratio,
    skellam,
)

N = 200_000
MEANS = (1.0, 30.0, 1e3, 1e6, 1e9, 1e12, DIRECT_MAX * 1.5, 4e13, 1e15, 1e16, 1e17, 1e18)


def _moments(x: np.ndarray) -> tuple[float, float, float]:
    d = x.astype(np.float64)
    mean = float(d.mean())
    var = float(d.var())
    kurt = float(((d - mean) ** 4).mean() / var**2 - 3.0)
    return mean, var, kurt


@pytest.mark.parametrize("mu", MEANS)
def test_finding_1_skellam_noise_matches_the_theory_at_every_mean(mu: float) -> None:
    x = skellam(mu, N, np.random.default_rng(int(math.log10(mu) * 10)))
    assert x.dtype == np.int64
    mean, var, kurt = _moments(x)
    sd = math.sqrt(2 * mu)
    assert abs(mean) < 5 * sd / math.sqrt(N)
    excess = 1.0 / (2 * mu)
    # the variance estimator's relative standard error is sqrt((2 + excess) / N)
    assert var / (2 * mu) == pytest.approx(1.0, abs=5 * math.sqrt((2 + excess) / N))
    assert kurt == pytest.approx(excess, abs=5 * math.sqrt(24 / N) + 3 * excess)
    even = float(np.mean(x % 2 == 0))
    assert even == pytest.approx((1 + math.exp(-4 * mu)) / 2, abs=5 * math.sqrt(0.25 / N))


@pytest.mark.parametrize("mu", [1e6, 1e12, 1e15, 1e16, 1e17, 1e18])
def test_finding_1_low_bits_are_uniform_at_large_means(mu: float) -> None:
    x = skellam(mu, N, np.random.default_rng(7))
    counts = np.bincount((x % 256).astype(np.int64), minlength=256)
    expected = N / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 255 degrees of freedom: mean 255, sd 22.6; 370 is beyond five sd
    assert chi2 < 370
    assert np.count_nonzero(x % 4) > 0.7 * N  # numpy's sampler: every sample a multiple of 4


def test_finding_1_distributed_noise_at_large_multipliers_has_its_nominal_spread() -> None:
    """The issue's case: l2 clip 1, 24 fraction bits, three orgs; the summed noise in
    float units has the spread ``noise_multiplier * l2_clip`` at 5, 20 and 200."""
    for multiplier in (5.0, 20.0, 200.0):
        mech = DistributedSkellam(1.0, multiplier, 3, 2.0**24)
        rng = np.random.default_rng(int(multiplier))
        total = sum((mech.org_noise(N, rng) for _ in range(3)), np.zeros(N, np.int64))
        realised = float(total.astype(np.float64).std()) / mech.scale
        assert realised / multiplier == pytest.approx(1.0, abs=5 * math.sqrt(0.5 / N))
        assert np.count_nonzero(total % 256) > 0.99 * N


def test_the_acceptance_bound_covers_the_target_everywhere() -> None:
    """Rejection sampling is exact only if ``target + |y|/b <= C`` for every ``y``: on a
    dense grid out to 80 standard deviations, both sides, at several means."""
    for lam in (DIRECT_MAX, 3.3e13, 1e16, 1e18, MU_MAX):
        b = math.sqrt(lam)
        y = np.round(np.linspace(-80 * b, 80 * b, 400_001))
        f = log_poisson_ratio(y, lam) + np.abs(y) / b
        assert float(f.max()) <= acceptance_bound(lam)
        assert float(f.max()) > acceptance_bound(lam) - 1e-4  # and it is not loose


def _reference_log_ratio(y: int, lam: float) -> float:
    """``log P(m + y) - log P(m)`` summed term by term: ``-sum log1p((i - f) / lam)`` for
    ``i = 1..y`` (and the mirror sum below ``m``), each term small and exact to 1e-16."""
    f = lam - math.floor(lam)
    if y >= 0:
        terms = -np.log1p((np.arange(1, y + 1, dtype=np.float64) - f) / lam)
    else:
        terms = np.log1p((-np.arange(0, -y, dtype=np.float64) - f) / lam)
    return math.fsum(terms.tolist())


def test_the_log_ratio_is_the_poisson_pmf_ratio() -> None:
    """Against the ratio of pmfs summed factor by factor, out to 3 standard deviations."""
    for lam in (DIRECT_MAX + 0.37, 3.0e12 + 0.81):
        m = math.floor(lam)
        for y in (-3_000_000, -1, 1, 17, 1_000_000, 3_000_000):
            got = float(log_poisson_ratio(np.array([float(y)]), lam)[0])
            assert got == pytest.approx(_reference_log_ratio(y, lam), abs=1e-6)
        assert float(log_poisson_ratio(np.array([-m - 1.0]), lam)[0]) == -math.inf


@settings(max_examples=12, deadline=None, derandomize=True)
@given(exponent=st.floats(0.0, 18.0), seed=st.integers(0, 2**32 - 1))
def test_spread_and_centre_hold_for_any_mean(exponent: float, seed: int) -> None:
    mu = 10.0**exponent
    n = 50_000
    x = skellam(mu, n, np.random.default_rng(seed))
    mean, var, _ = _moments(x)
    assert abs(mean) < 5 * math.sqrt(2 * mu / n)
    assert var / (2 * mu) == pytest.approx(1.0, abs=5 * math.sqrt((2 + 1 / (2 * mu)) / n))


def test_samples_are_reproducible_and_arguments_checked() -> None:
    a = skellam(1e17, 1000, np.random.default_rng(1))
    b = skellam(1e17, 1000, np.random.default_rng(1))
    np.testing.assert_array_equal(a, b)
    assert skellam(0.0, 5, np.random.default_rng(0)).tolist() == [0] * 5
    assert skellam(1e18, 0, np.random.default_rng(0)).size == 0
    for bad in (-1.0, math.inf, math.nan, MU_MAX * 2, True):
        with pytest.raises(ConfigError, match="mu"):
            skellam(bad, 3, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="size"):
        skellam(1.0, -1, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="rng"):
        skellam(1.0, 1, np.random.RandomState(0))  # type: ignore[arg-type]
