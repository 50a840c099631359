"""The DP accountant against published values and closed forms; the budget's hard stop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq
from scipy.stats import norm

from org_node.privacy import (
    DEFAULT_ORDERS,
    BudgetExceeded,
    ExampleDpConfig,
    GaussianRound,
    PrivacyBudget,
    PrivacyConfigError,
    RdpAccountant,
    SkellamRound,
    eps_from_rdp,
    gaussian_rdp,
    make_example_private,
    protect_update,
    skellam_rdp,
    skellam_round_for,
)
from secure_agg.codec import FixedPointCodec
from secure_agg.dp import DistributedSkellam

FINE_ORDERS = [0.001 * i for i in range(1001, 100000)]


# --------------------------------------------------------------------------- published values


def test_sampled_gaussian_rdp_published_values() -> None:
    """q=0.01, sigma=2.5, 50 steps: values of the sampled Gaussian mechanism
    (Mironov, Talwar and Zhang 2019) as published with the TensorFlow Privacy /
    dp-accounting RDP accountant's test suite."""
    orders = [1.5, 2.5, 5, 50, 100]
    expected = [6.70579741e-04, 1.08548710e-03, 2.18075656e-03, 2.38460375e-02, 1.67416308e02]
    np.testing.assert_allclose(gaussian_rdp(orders, 2.5, 0.01, 50), expected, rtol=1e-4)


def test_gaussian_calibrated_to_one_epsilon_at_delta_1e6() -> None:
    """sigma = 4.530877117 is the published noise for exactly (1, 1e-6)-DP of one
    Gaussian release (Balle and Wang 2018's analytic calibration), which the RDP
    conversion of Balle et al. 2020 reproduces on a fine grid of orders."""
    eps, _ = eps_from_rdp(FINE_ORDERS, gaussian_rdp(FINE_ORDERS, 4.530877117), 1e-6)
    assert eps == pytest.approx(1.0, abs=1e-6)


def test_conversion_of_pure_dp_rdp_curve() -> None:
    """A constant RDP curve of 1.1 on orders 2..32 at delta=1e-5 gives the hand-computed
    1.32783806176 at order 32 (Balle et al. 2020, Theorem 21)."""
    orders = list(range(2, 33))
    eps, order = eps_from_rdp(orders, [1.1] * len(orders), 1e-5)
    assert eps == pytest.approx(1.32783806176, abs=1e-9)
    assert order == 32


@settings(max_examples=30, deadline=None)
@given(
    st.floats(0.3, 20.0),
    st.integers(1, 500),
    st.sampled_from([1.5, 2.0, 7.25, 32.0, 256.0]),
)
def test_full_participation_is_closed_form(sigma: float, rounds: int, alpha: float) -> None:
    """q = 1 (every org, every round): RDP is rounds * alpha / (2 sigma^2) (Mironov 2017,
    Proposition 7 with composition)."""
    rdp = gaussian_rdp([alpha], sigma, 1.0, rounds)
    assert rdp[0] == pytest.approx(rounds * alpha / (2 * sigma**2), rel=1e-12)


def _analytic_gaussian_delta(eps: float, sigma: float) -> float:
    """Exact delta(eps) of the Gaussian mechanism, sensitivity 1 (Balle and Wang 2018, Thm 8)."""
    return float(
        norm.cdf(-eps * sigma + 0.5 / sigma) - math.exp(eps) * norm.cdf(-eps * sigma - 0.5 / sigma)
    )


@pytest.mark.parametrize(("sigma", "rounds"), [(1.0, 1), (2.0, 10), (5.0, 50), (0.8, 3)])
def test_rdp_epsilon_is_a_valid_and_tight_upper_bound(sigma: float, rounds: int) -> None:
    """R rounds of sigma compose to one Gaussian of sigma / sqrt(R); the accountant's epsilon
    must satisfy the exact privacy curve and be within 25% of the optimal epsilon."""
    delta = 1e-5
    acct = RdpAccountant()
    for _ in range(rounds):
        acct.charge(GaussianRound(noise_multiplier=sigma))
    eps = acct.epsilon(delta)
    effective = sigma / math.sqrt(rounds)
    assert _analytic_gaussian_delta(eps, effective) <= delta
    exact = brentq(lambda e: _analytic_gaussian_delta(e, effective) - delta, 1e-9, 500.0)
    assert exact <= eps <= 1.25 * exact


# --------------------------------------------------------------------------- accountant


def test_per_round_and_total_epsilon() -> None:
    acct = RdpAccountant()
    rnd = GaussianRound(noise_multiplier=3.0)
    for _ in range(20):
        acct.charge(rnd)
    one = acct.round_epsilon(1e-5)
    total = acct.epsilon(1e-5)
    direct = eps_from_rdp(DEFAULT_ORDERS, gaussian_rdp(DEFAULT_ORDERS, 3.0, 1.0, 20), 1e-5)[0]
    assert total == pytest.approx(direct, rel=1e-12)
    assert one == pytest.approx(
        eps_from_rdp(DEFAULT_ORDERS, gaussian_rdp(DEFAULT_ORDERS, 3.0), 1e-5)[0], rel=1e-12
    )
    assert one < total < 20 * one  # RDP composes sub-linearly in epsilon
    restored = RdpAccountant()
    restored.load_state_dict(acct.state_dict())
    assert restored.epsilon(1e-5) == total
    with pytest.raises(PrivacyConfigError, match="orders"):
        RdpAccountant(orders=[2.0, 3.0]).load_state_dict(acct.state_dict())


def test_skellam_rdp_formula_and_gaussian_limit() -> None:
    """Agarwal, Kairouz and Liu 2021, Theorem 3.5, by hand at alpha = 2, and its limit."""
    d2, d1, var = 3.0, 7.0, 40.0
    expected = 2 * 9 / (2 * 40) + min((3 * 9 + 6 * 7) / (4 * 1600), 3 * 7 / (2 * 40))
    assert skellam_rdp([2.0], d2, d1, var)[0] == pytest.approx(expected, rel=1e-12)
    big = 1e8
    ratio = skellam_rdp([2.0, 16.0], 100.0, 1e4, big) / gaussian_rdp(
        [2.0, 16.0], math.sqrt(big) / 100.0
    )
    np.testing.assert_allclose(ratio, 1.0, rtol=1e-4)
    # Skellam always costs at least the matching Gaussian
    assert np.all(
        skellam_rdp(DEFAULT_ORDERS, d2, d1, var)
        >= gaussian_rdp(DEFAULT_ORDERS, math.sqrt(var) / d2)
    )


def test_skellam_round_from_secure_agg_noise_settings() -> None:
    dp = DistributedSkellam(l2_clip=1.0, noise_multiplier=1.2, n_orgs=4, scale=2.0**10)
    rnd = skellam_round_for(dp, dim=100)
    params = dp.accountant_params(100)
    assert rnd.variance == pytest.approx(params["variance_sum_ring"])
    # the summed noise's std is noise_multiplier * clip in float units
    assert math.sqrt(rnd.variance) / dp.scale == pytest.approx(1.2, rel=1e-12)
    acct = RdpAccountant()
    acct.charge(rnd)
    gauss = RdpAccountant()
    gauss.charge(GaussianRound(noise_multiplier=math.sqrt(rnd.variance) / rnd.l2_sensitivity))
    assert acct.epsilon(1e-5) >= gauss.epsilon(1e-5)
    assert acct.epsilon(1e-5) == pytest.approx(gauss.epsilon(1e-5), rel=0.05)


# --------------------------------------------------------------------------- budget


def test_budget_stops_before_the_round_that_would_exceed_it() -> None:
    budget = PrivacyBudget(epsilon_max=2.0, delta=1e-5)
    rnd = GaussianRound(noise_multiplier=4.0)
    allowed = budget.rounds_left(rnd)
    assert allowed > 1
    for _ in range(allowed):
        after = budget.check(rnd)
        assert budget.spend(rnd) == pytest.approx(after)
        assert budget.spent <= 2.0
    spent = budget.spent
    with pytest.raises(BudgetExceeded) as info:
        budget.check(rnd)
    err = info.value
    assert err.round_index == allowed + 1
    assert err.epsilon_after > 2.0 >= err.spent
    assert f"round {allowed + 1}" in str(err) and "epsilon_max=2" in str(err)
    assert "delta=1e-05" in str(err)
    with pytest.raises(BudgetExceeded):
        budget.spend(rnd)
    assert budget.spent == spent and budget.rounds == allowed  # nothing was spent
    assert budget.rounds_left(rnd) == 0


def test_config_validation() -> None:
    with pytest.raises(PrivacyConfigError, match="epsilon_max"):
        PrivacyBudget(epsilon_max=0.0, delta=1e-5)
    with pytest.raises(PrivacyConfigError, match="delta"):
        PrivacyBudget(epsilon_max=1.0, delta=1.0)
    with pytest.raises(PrivacyConfigError, match="noise_multiplier"):
        GaussianRound(noise_multiplier=-1.0)
    with pytest.raises(PrivacyConfigError, match="sample_rate"):
        GaussianRound(noise_multiplier=1.0, sample_rate=1.5)
    with pytest.raises(PrivacyConfigError, match="variance"):
        SkellamRound(l2_sensitivity=1.0, l1_sensitivity=1.0, variance=0.0)
    with pytest.raises(PrivacyConfigError, match="orders"):
        RdpAccountant(orders=[0.5, 2.0])
    with pytest.raises(PrivacyConfigError, match="RDP values"):
        eps_from_rdp([2.0, 3.0], [1.0], 1e-5)
    assert gaussian_rdp([2.0], 0.0)[0] == math.inf


# --------------------------------------------------------------------------- protection


def test_protect_update_clips_quantizes_and_noises_reproducibly() -> None:
    n_orgs, dim = 5, 2000
    dp = DistributedSkellam(l2_clip=1.0, noise_multiplier=0.5, n_orgs=n_orgs, scale=2.0**16)
    codec = FixedPointCodec(bits=64, clip=1.0, max_summands=n_orgs, frac_bits=16, noise_bound=64.0)
    rng = np.random.default_rng(0)
    updates = [rng.normal(size=dim) * 0.1 for _ in range(n_orgs)]
    protected = []
    factors = []
    for i, u in enumerate(updates):
        y, f = protect_update(u, codec=codec, dp=dp, rng=np.random.default_rng([7, i]))
        y2, _ = protect_update(u, codec=codec, dp=dp, rng=np.random.default_rng([7, i]))
        assert y.tobytes() == y2.tobytes()
        protected.append(y)
        factors.append(f)
    assert all(
        f == pytest.approx(1.0 / np.linalg.norm(u)) for f, u in zip(factors, updates, strict=True)
    )
    total = np.zeros(dim, dtype=np.uint64)
    for y in protected:
        total += y
    decoded = codec.decode(total)
    clipped_sum = sum(u / np.linalg.norm(u) for u in updates)
    noise = decoded - clipped_sum
    assert abs(float(noise.mean())) < 0.05
    assert float(noise.std()) == pytest.approx(0.5, rel=0.05)  # sigma = noise_multiplier * clip
    with pytest.raises(PrivacyConfigError, match="scale"):
        protect_update(
            updates[0], codec=FixedPointCodec(bits=64, clip=1.0, frac_bits=8), dp=dp, rng=rng
        )


# --------------------------------------------------------------------------- example-level DP-SGD


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_example_level_dp_sgd_with_opacus() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = ExampleDpConfig(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, seed=3)
    pmodel, popt, ploader, engine = make_example_private(model, opt, loader, cfg)
    steps = 0
    for _ in range(2):
        for xb, yb in ploader:
            if len(xb) == 0:
                continue
            popt.zero_grad()
            loss = torch.nn.functional.cross_entropy(pmodel(xb), yb)
            loss.backward()  # type: ignore[no-untyped-call]
            popt.step()
            steps += 1
    eps_opacus = engine.get_epsilon(cfg.delta)
    ours = eps_from_rdp(
        DEFAULT_ORDERS, gaussian_rdp(DEFAULT_ORDERS, 1.1, 16 / 64, steps), cfg.delta
    )[0]
    assert eps_opacus > 0
    assert ours == pytest.approx(eps_opacus, rel=0.1)
    with pytest.raises(PrivacyConfigError, match="max_grad_norm"):
        ExampleDpConfig(noise_multiplier=1.0, max_grad_norm=0.0)
