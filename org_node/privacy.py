"""Org-level differential privacy: protection of the update, RDP accounting, a hard budget.

Unit of privacy. One org's whole contribution to a round (its packed vector
``[w * delta, w]``, see :func:`org_node.strategies.pack_weighted`) is clipped to L2 norm
``l2_clip`` and the *sum* carries noise of standard deviation
``noise_multiplier * l2_clip``, shared out among the orgs by
:class:`secure_agg.dp.DistributedSkellam` (Agarwal, Kairouz and Liu, NeurIPS 2021) so
that no org, nor any coalition short of all, knows the total noise. Clipping the packed
vector as a whole scales an org's weight together with its delta, so a clipped org
counts for less but its update keeps its direction and size. Every org takes part in
every round (sampling rate 1), so a round is one Gaussian (or Skellam) mechanism.

Accounting. :class:`RdpAccountant` composes Rényi DP (Mironov, "Rényi Differential
Privacy", CSF 2017) over rounds on a grid of orders, using dp-accounting's analysis of
the sampled Gaussian mechanism (Mironov, Talwar and Zhang 2019) for Gaussian rounds and
Agarwal et al. 2021, Theorem 3.5, for Skellam rounds, and converts to ``(epsilon,
delta)`` by Balle et al. 2020 ("Hypothesis Testing Interpretations and Rényi
Differential Privacy", Theorem 21). :class:`PrivacyBudget` refuses a round *before*
it would take the org past its ``epsilon_max`` (:class:`BudgetExceeded`).

Example-level DP-SGD inside the local job is optional: :func:`make_example_private`
wraps a model, optimizer and data loader with Opacus.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from org_node.dp_spec import dp_disagreement
from org_node.run_config import EngineConfig, EngineError, RunPlan
from secure_agg.codec import FixedPointCodec
from secure_agg.dp import DistributedSkellam, add_signed, clip_l2

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader

    from org_node.dp_spec import DpMechanism

__all__ = [
    "DEFAULT_ORDERS",
    "BudgetExceeded",
    "ExampleDpConfig",
    "GaussianRound",
    "PrivacyBudget",
    "PrivacyConfigError",
    "PrivacyError",
    "RdpAccountant",
    "SkellamRound",
    "agreed_noise",
    "eps_from_rdp",
    "gaussian_rdp",
    "make_example_private",
    "protect_update",
    "run_privacy",
    "skellam_codec",
    "skellam_rdp",
    "skellam_round_for",
]

DEFAULT_ORDERS: tuple[float, ...] = tuple(
    [1.0 + x / 20.0 for x in range(1, 100)]
    + [6.0 + x / 4.0 for x in range(0, 24)]
    + [float(a) for a in range(12, 64)]
    + [float(a) for a in range(64, 257, 8)]
    + [384.0, 512.0, 1024.0]
)
"""RDP orders: dense near 1 (large epsilon) up to 1024 (large noise, small epsilon)."""


FloatSeq = Sequence[float] | np.ndarray
"""A list of floats or a float array (RDP orders, RDP values)."""


class PrivacyError(Exception):
    """Root of the errors of :mod:`org_node.privacy`."""


class PrivacyConfigError(PrivacyError, ValueError):
    """A privacy parameter is missing, out of range or of the wrong type."""


class BudgetExceeded(PrivacyError):
    """The next round would take the org past its epsilon budget; nothing was spent."""

    def __init__(
        self,
        *,
        round_index: int,
        epsilon_after: float,
        epsilon_max: float,
        spent: float,
        delta: float,
    ) -> None:
        self.round_index = round_index
        self.epsilon_after = epsilon_after
        self.epsilon_max = epsilon_max
        self.spent = spent
        self.delta = delta
        super().__init__(
            f"round {round_index} refused: it would bring epsilon to {epsilon_after:.4f} "
            f"at delta={delta:g}, over the org's budget epsilon_max={epsilon_max:g} "
            f"(spent so far {spent:.4f} over {round_index - 1} rounds)"
        )


def _number(name: str, value: Any, *, low: float, low_open: bool, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PrivacyConfigError(f"{name} must be a number, got {value!r}")
    v = float(value)
    too_low = v <= low if low_open else v < low
    if math.isnan(v) or too_low or v > high or (math.isinf(v) and high != math.inf):
        bracket = "(" if low_open else "["
        raise PrivacyConfigError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value!r}")
    return v


def _orders(orders: FloatSeq) -> np.ndarray:
    arr = np.asarray(orders, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0 or not np.all(np.isfinite(arr)) or np.any(arr <= 1.0):
        raise PrivacyConfigError("orders must be a non-empty list of finite numbers > 1")
    return arr


# --------------------------------------------------------------------------- mechanisms


def gaussian_rdp(
    orders: FloatSeq, noise_multiplier: float, sample_rate: float = 1.0, steps: int = 1
) -> np.ndarray:
    """RDP of ``steps`` compositions of the (Poisson-sampled) Gaussian mechanism.

    With ``sample_rate = 1`` this is the closed form ``steps * alpha / (2 sigma^2)``
    (Mironov 2017, Proposition 7); below 1, dp-accounting's analysis of the sampled
    Gaussian mechanism (Mironov, Talwar and Zhang 2019, Section 3.3), whose log-moment
    sums are checked there against multi-precision integration.
    """
    sigma = _number("noise_multiplier", noise_multiplier, low=0.0, low_open=False)
    q = _number("sample_rate", sample_rate, low=0.0, low_open=False, high=1.0)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise PrivacyConfigError(f"steps must be an int >= 0, got {steps!r}")
    arr = _orders(orders)
    if steps == 0 or q == 0.0:
        return np.zeros_like(arr)
    if sigma == 0.0:
        return np.full_like(arr, np.inf)
    if q == 1.0:
        return steps * arr / (2.0 * sigma * sigma)
    from dp_accounting import dp_event  # scipy underneath: imported when a run accounts
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant(orders=arr.tolist())
    accountant.compose(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), count=steps
    )
    # The accountant keeps its composed RDP per order in `_rdp` (dp-accounting's own
    # tests read it the same way); there is no public getter for the vector.
    rdp = getattr(accountant, "_rdp", None)
    if rdp is None:
        raise PrivacyError("this dp-accounting version does not expose RDP vectors")
    return np.asarray(rdp, dtype=np.float64)


def skellam_rdp(
    orders: FloatSeq, l2_sensitivity: float, l1_sensitivity: float, variance: float
) -> np.ndarray:
    """RDP of the Skellam mechanism (Agarwal, Kairouz and Liu 2021, Theorem 3.5).

    For integer-valued queries with L1/L2 sensitivities ``D1``/``D2`` and symmetric
    Skellam noise of total ``variance`` ``v`` (the difference of two Poisson(v/2))::

        eps(alpha) = alpha D2^2 / (2 v) + min(((2 alpha - 1) D2^2 + 6 D1) / (4 v^2),
                                              3 D1 / (2 v))

    The first term is the Gaussian mechanism's with ``sigma^2 = v``; the second
    vanishes as ``v`` grows. Units: the ring units the noise is added in.
    """
    d2 = _number("l2_sensitivity", l2_sensitivity, low=0.0, low_open=False)
    d1 = _number("l1_sensitivity", l1_sensitivity, low=0.0, low_open=False)
    v = _number("variance", variance, low=0.0, low_open=True)
    a = _orders(orders)
    second = np.minimum(
        ((2.0 * a - 1.0) * d2 * d2 + 6.0 * d1) / (4.0 * v * v), 3.0 * d1 / (2.0 * v)
    )
    return np.asarray(a * d2 * d2 / (2.0 * v) + second, dtype=np.float64)


def eps_from_rdp(orders: FloatSeq, rdp: FloatSeq, delta: float) -> tuple[float, float]:
    """``(epsilon, best order)`` at ``delta`` from RDP values: Balle et al. 2020,
    Theorem 21 (= Canonne, Kamath and Steinke 2020, Proposition 12), by dp-accounting."""
    d = _number("delta", delta, low=0.0, low_open=True, high=1.0)
    arr = _orders(orders)
    values = np.asarray(rdp, dtype=np.float64)
    if values.shape != arr.shape:
        raise PrivacyConfigError(f"{values.size} RDP values for {arr.size} orders")
    from dp_accounting.rdp import rdp_privacy_accountant

    eps, order = rdp_privacy_accountant.compute_epsilon(arr.tolist(), values.tolist(), d)
    return max(0.0, float(eps)), float(order)


@dataclass(frozen=True)
class GaussianRound:
    """One round protected by Gaussian noise of ``noise_multiplier * l2_clip`` on the sum.

    noise_multiplier: noise standard deviation over the L2 sensitivity.
    sample_rate: probability that the org takes part (1.0: every round).
    steps: mechanisms in the round (1 for one noised sum per round).
    """

    noise_multiplier: float
    sample_rate: float = 1.0
    steps: int = 1

    def __post_init__(self) -> None:
        _number("noise_multiplier", self.noise_multiplier, low=0.0, low_open=True)
        _number("sample_rate", self.sample_rate, low=0.0, low_open=True, high=1.0)
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise PrivacyConfigError(f"steps must be an int >= 1, got {self.steps!r}")

    def rdp(self, orders: FloatSeq) -> np.ndarray:
        return gaussian_rdp(orders, self.noise_multiplier, self.sample_rate, self.steps)


@dataclass(frozen=True)
class SkellamRound:
    """One round protected by distributed Skellam noise in the ring.

    l2_sensitivity, l1_sensitivity: of one org's quantized contribution, ring units.
    variance: of the summed noise, ring units.
    """

    l2_sensitivity: float
    l1_sensitivity: float
    variance: float

    def __post_init__(self) -> None:
        _number("l2_sensitivity", self.l2_sensitivity, low=0.0, low_open=True)
        _number("l1_sensitivity", self.l1_sensitivity, low=0.0, low_open=True)
        _number("variance", self.variance, low=0.0, low_open=True)

    def rdp(self, orders: FloatSeq) -> np.ndarray:
        return skellam_rdp(orders, self.l2_sensitivity, self.l1_sensitivity, self.variance)


Mechanism = GaussianRound | SkellamRound


def skellam_round_for(
    dp: DistributedSkellam, dim: int | None = None, survivors: int | None = None
) -> SkellamRound:
    """The :class:`SkellamRound` of a :class:`secure_agg.dp.DistributedSkellam` setting
    (``dim``: vector length, to bound the stochastic-rounding growth of the norm).

    ``survivors``: how many orgs' noise shares the released sum holds; the variance
    charged is theirs, ``2 * mu_org * survivors`` (default: the ``n_orgs`` the shares
    were sized for), so a round that lost orgs is charged for the noise it carried.
    """
    p = dp.accountant_params(dim)
    variance = p["variance_sum_ring"]
    if survivors is not None:
        if isinstance(survivors, bool) or not isinstance(survivors, int) or survivors < 1:
            raise PrivacyConfigError(f"survivors must be an int >= 1, got {survivors!r}")
        variance = 2.0 * dp.mu_org * survivors
    return SkellamRound(
        l2_sensitivity=p["l2_sensitivity"], l1_sensitivity=p["l1_sensitivity"], variance=variance
    )


def skellam_codec(
    mechanism: DpMechanism, *, ring_bits: int, clip: float, participants: int, threshold: int
) -> tuple[FixedPointCodec, DistributedSkellam]:
    """The fixed-point codec of a run with the DP ``mechanism`` among ``participants``
    orgs (reconstruction ``threshold``), with room in the ring for the noise
    (``20 sigma / sqrt(shares)`` per share), and the distributed Skellam noise on its
    scale, each org's share sized for ``mechanism.noise_shares(...)`` orgs."""
    noise = agreed_noise(mechanism, participants, threshold)
    codec = FixedPointCodec(
        bits=ring_bits,
        clip=max(clip, mechanism.l2_clip),
        max_summands=participants,
        frac_bits=mechanism.frac_bits,
        noise_bound=20.0 * noise.sigma_sum / math.sqrt(noise.n_orgs),
    )
    return codec, noise


def agreed_noise(mechanism: DpMechanism, participants: int, threshold: int) -> DistributedSkellam:
    """Each org's share of the noise of the agreed ``mechanism`` in a run of
    ``participants`` orgs with reconstruction ``threshold`` (on the codec's scale,
    ``2**frac_bits``)."""
    shares = mechanism.noise_shares(participants, threshold)
    return DistributedSkellam(
        mechanism.l2_clip, mechanism.noise_multiplier, shares, 2.0**mechanism.frac_bits
    )


def run_privacy(
    plan: RunPlan, config: EngineConfig
) -> tuple[FixedPointCodec, DistributedSkellam | None, PrivacyBudget | None]:
    """The fixed-point codec of the run's secure sum and, for a run with an epsilon, its
    distributed DP noise on the mechanism of the run spec (which must be this org's own:
    :class:`EngineError` otherwise) and budget (the codec then leaves room for the noise).
    """
    n = len(plan.participants)
    if plan.epsilon is None:
        codec = FixedPointCodec(
            bits=config.ring_bits, clip=config.clip, max_summands=n, frac_bits=config.frac_bits
        )
        return codec, None, None
    if config.weighting != "uniform":
        raise EngineError(
            "engine.weighting",
            "a run with DP needs 'uniform' weighting: the noisy sum of the weights "
            "cannot divide the update, the count of survivors does",
        )
    disagreement = dp_disagreement(plan.spec, config)
    if disagreement is not None or plan.dp is None:
        raise EngineError("dp", disagreement or "the run names no DP mechanism")
    codec, dp = skellam_codec(
        plan.dp,
        ring_bits=config.ring_bits,
        clip=config.clip,
        participants=n,
        threshold=plan.threshold,
    )
    return codec, dp, PrivacyBudget(plan.epsilon, plan.dp.delta)


# --------------------------------------------------------------------------- accountant


class RdpAccountant:
    """Rényi DP accountant: composes rounds, answers epsilon at delta per round and in total."""

    def __init__(self, orders: FloatSeq = DEFAULT_ORDERS) -> None:
        self.orders = _orders(orders)
        self.total = np.zeros_like(self.orders)
        self.rounds: list[np.ndarray] = []

    def cost(self, mechanism: Mechanism) -> np.ndarray:
        """The RDP vector of one round of ``mechanism`` on this accountant's orders."""
        return mechanism.rdp(self.orders.tolist())

    def charge(self, mechanism: Mechanism) -> np.ndarray:
        """Record one round of ``mechanism``; returns that round's RDP vector."""
        vec = self.cost(mechanism)
        self.rounds.append(vec)
        self.total = self.total + vec
        return vec

    def epsilon(self, delta: float) -> float:
        """Epsilon of all rounds so far, composed, at ``delta``."""
        return eps_from_rdp(self.orders.tolist(), self.total.tolist(), delta)[0]

    def round_epsilon(self, delta: float, index: int = -1) -> float:
        """Epsilon of one round alone (default: the last) at ``delta``."""
        if not self.rounds:
            raise PrivacyError("no round has been charged yet")
        return eps_from_rdp(self.orders.tolist(), self.rounds[index].tolist(), delta)[0]

    def epsilon_if(self, mechanism: Mechanism, delta: float) -> float:
        """Epsilon after one more round of ``mechanism``, without recording it."""
        return eps_from_rdp(
            self.orders.tolist(), (self.total + self.cost(mechanism)).tolist(), delta
        )[0]

    def state_dict(self) -> dict[str, Any]:
        """Orders and per-round RDP vectors as plain lists (JSON-serializable)."""
        return {"orders": self.orders.tolist(), "rounds": [r.tolist() for r in self.rounds]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; the orders must match."""
        orders = _orders(state["orders"])
        if orders.shape != self.orders.shape or not np.array_equal(orders, self.orders):
            raise PrivacyConfigError("state was accounted on other RDP orders")
        rounds = [np.asarray(r, dtype=np.float64) for r in state["rounds"]]
        if any(r.shape != self.orders.shape for r in rounds):
            raise PrivacyConfigError("a round's RDP vector does not match the orders")
        self.rounds = rounds
        self.total = np.sum(rounds, axis=0) if rounds else np.zeros_like(self.orders)


@dataclass
class PrivacyBudget:
    """An org's ``(epsilon_max, delta)`` budget with a hard stop.

    Call :meth:`check` before a round (it raises :class:`BudgetExceeded` when the
    round would take the composed epsilon past ``epsilon_max``), and :meth:`spend`
    once the org has released its protected update.
    """

    epsilon_max: float
    delta: float
    accountant: RdpAccountant | None = None

    def __post_init__(self) -> None:
        self.epsilon_max = _number("epsilon_max", self.epsilon_max, low=0.0, low_open=True)
        self.delta = _number("delta", self.delta, low=0.0, low_open=True, high=1.0)
        if self.delta >= 1.0:
            raise PrivacyConfigError(f"delta must be < 1, got {self.delta!r}")
        if self.accountant is None:
            self.accountant = RdpAccountant()

    @property
    def _acct(self) -> RdpAccountant:
        assert self.accountant is not None
        return self.accountant

    @property
    def spent(self) -> float:
        """Epsilon spent so far, at this budget's delta."""
        return self._acct.epsilon(self.delta)

    @property
    def rounds(self) -> int:
        return len(self._acct.rounds)

    def check(self, next_round: Mechanism) -> float:
        """Epsilon after ``next_round``; raises :class:`BudgetExceeded` if over budget."""
        after = self._acct.epsilon_if(next_round, self.delta)
        if after > self.epsilon_max:
            raise BudgetExceeded(
                round_index=self.rounds + 1,
                epsilon_after=after,
                epsilon_max=self.epsilon_max,
                spent=self.spent,
                delta=self.delta,
            )
        return after

    def spend(self, next_round: Mechanism) -> float:
        """Check, then record the round; returns the epsilon spent after it."""
        self.check(next_round)
        self._acct.charge(next_round)
        return self.spent

    def record(self, released: Mechanism) -> float:
        """Record a round whose protected update is already out, whatever it costs (a
        release cannot be refused afterwards); returns the epsilon spent after it."""
        self._acct.charge(released)
        return self.spent

    def rounds_left(self, mechanism: Mechanism, limit: int = 100_000) -> int:
        """How many more rounds of ``mechanism`` fit in the budget (at most ``limit``)."""
        per_round = self._acct.cost(mechanism)
        orders = self._acct.orders.tolist()
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            eps = eps_from_rdp(orders, (self._acct.total + mid * per_round).tolist(), self.delta)[0]
            if eps <= self.epsilon_max:
                lo = mid
            else:
                hi = mid - 1
        return lo


# --------------------------------------------------------------------------- protection


def protect_update(
    packed: np.ndarray,
    *,
    codec: FixedPointCodec,
    dp: DistributedSkellam,
    rng: np.random.Generator,
) -> tuple[np.ndarray, float]:
    """Clip one org's packed vector, quantize it and add its Skellam noise share.

    Returns the ring vector to mask (``secure_agg.protocol.SecAggPeer.masked_input``)
    and the clip factor applied. ``codec.scale`` must equal ``dp.scale``; ``rng``
    drives both the stochastic rounding and the noise, so a fixed seed gives the same
    bytes. Per-coordinate clipping of the codec must not bind below the L2 clip
    (choose ``codec.clip >= dp.l2_clip``), or the sensitivity would differ from the
    accounted one.
    """
    if codec.scale != dp.scale:
        raise PrivacyConfigError(f"codec scale {codec.scale} differs from the noise's {dp.scale}")
    if codec.clip < dp.l2_clip:
        raise PrivacyConfigError(
            f"codec clip {codec.clip} is below the L2 clip {dp.l2_clip}: choose clip >= l2_clip"
        )
    clipped, factor = clip_l2(np.asarray(packed, dtype=np.float64).ravel(), dp.l2_clip)
    ring = codec.encode(clipped, rng)
    noised = add_signed(ring, dp.org_noise(ring.size, rng))
    return noised, factor


# --------------------------------------------------------------------------- example-level DP


@dataclass(frozen=True)
class ExampleDpConfig:
    """Example-level DP-SGD inside the local job (Abadi et al. 2016), via Opacus.

    noise_multiplier: Gaussian noise std over ``max_grad_norm``.
    max_grad_norm: per-example gradient clip.
    delta: delta at which the local epsilon is reported.
    seed: seeds Opacus's noise and Poisson sampling, for reproducible runs.
    """

    noise_multiplier: float
    max_grad_norm: float
    delta: float = 1e-5
    seed: int | None = None

    def __post_init__(self) -> None:
        _number("noise_multiplier", self.noise_multiplier, low=0.0, low_open=False)
        _number("max_grad_norm", self.max_grad_norm, low=0.0, low_open=True)
        _number("delta", self.delta, low=0.0, low_open=True, high=1.0)


def make_example_private(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data_loader: DataLoader[Any],
    config: ExampleDpConfig,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader[Any], Any]:
    """Wrap the local job's model, optimizer and loader for DP-SGD with Opacus.

    Returns ``(model, optimizer, loader, engine)``; ``engine.get_epsilon(delta)`` gives
    the local example-level epsilon (opacus's RDP accountant; compare
    :func:`gaussian_rdp` with ``sample_rate = batch_size / len(dataset)``).
    """
    import torch
    from opacus import PrivacyEngine

    generator = None
    if config.seed is not None:
        generator = torch.Generator().manual_seed(config.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # opacus warns that secure_mode is off
        engine = PrivacyEngine(accountant="rdp")
        priv_model, priv_opt, priv_loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=data_loader,
            noise_multiplier=config.noise_multiplier,
            max_grad_norm=config.max_grad_norm,
            noise_generator=generator,
        )
    return priv_model, priv_opt, priv_loader, engine
