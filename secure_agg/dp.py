"""Org-level L2 clipping and distributed Skellam noise.

Agarwal, Kairouz and Liu, "The Skellam Mechanism for Differentially Private Federated
Learning", NeurIPS 2021 (the distributed Skellam mechanism, DSkellam). Each of
``n_orgs`` orgs adds integer noise ``Skellam(mu_org)`` (the difference of two
independent ``Poisson(mu_org)``) to its quantized update in the ring. Skellam is closed
under summation, so the sum carries ``Skellam(n_orgs * mu_org)`` noise of variance
``2 * n_orgs * mu_org``; choosing ``mu_org = (sigma * scale)^2 / (2 n_orgs)`` makes the
sum's noise standard deviation ``sigma * scale`` ring units, i.e. ``sigma`` float units,
with ``sigma = noise_multiplier * l2_clip``. No single org, and no coalition short of
all, knows the total noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import ConfigError, RingError
from .ring import check_ring
from .skellam import MU_MAX, skellam

__all__ = ["DistributedSkellam", "add_signed", "clip_l2"]


def clip_l2(x: np.ndarray, bound: float) -> tuple[np.ndarray, float]:
    """Scale ``x`` down so that its L2 norm is at most ``bound``.

    Returns a clipped copy (same dtype) and the factor applied, ``min(1, bound/||x||)``.

    Raises:
        ConfigError: ``bound`` is not finite and positive.
        RingError: ``x`` is not a float array or holds NaN/Inf.
    """
    if isinstance(bound, bool) or not isinstance(bound, int | float):
        raise ConfigError(f"bound must be a number, got {bound!r}")
    if not math.isfinite(bound) or bound <= 0:
        raise ConfigError(f"bound must be finite and > 0, got {bound!r}")
    if not isinstance(x, np.ndarray) or x.dtype not in (np.float32, np.float64):
        raise RingError("clip_l2 expects a float32 or float64 numpy array")
    norm = float(np.linalg.norm(x.astype(np.float64, copy=False).ravel()))
    if not math.isfinite(norm):
        raise RingError("cannot clip a vector holding NaN or Inf")
    if norm <= bound:
        return x.copy(), 1.0
    factor = bound / norm
    clipped = x * x.dtype.type(factor)
    # Rounding in the product may overshoot by a few ulps; shrink until the bound holds,
    # since the DP guarantee is stated for the bound itself.
    shrink = 1.0 - 4.0 * float(np.finfo(x.dtype).eps)
    while float(np.linalg.norm(clipped.astype(np.float64, copy=False).ravel())) > bound:
        factor *= shrink
        clipped = x * x.dtype.type(factor)
    return clipped, factor


@dataclass(frozen=True)
class DistributedSkellam:
    """Per-org share of the distributed Skellam noise (Agarwal et al., NeurIPS'21, Sec. 4)."""

    l2_clip: float
    """Per-org L2 bound of the update, in float units."""
    noise_multiplier: float
    """Standard deviation of the SUM's noise divided by ``l2_clip``."""
    n_orgs: int
    """How many orgs each add a share of the noise."""
    scale: float
    """The codec's scale (float units to ring units)."""

    def __post_init__(self) -> None:
        for name, allow_zero in (("l2_clip", False), ("noise_multiplier", True), ("scale", False)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
                raise ConfigError(f"{name} must be finite and {'>=' if allow_zero else '>'} 0")
        n = self.n_orgs
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"n_orgs must be an int >= 1, got {n!r}")
        if self.mu_org > MU_MAX:
            raise ConfigError(
                "per-org Skellam mean is too large to sample; lower scale (frac_bits) "
                "or noise_multiplier"
            )

    @property
    def sigma_sum(self) -> float:
        """Standard deviation of the summed noise, float units."""
        return self.noise_multiplier * self.l2_clip

    @property
    def mu_org(self) -> float:
        """Poisson mean of each org's Skellam share: ``(sigma*scale)^2 / (2 n_orgs)``."""
        return (self.sigma_sum * self.scale) ** 2 / (2 * self.n_orgs)

    def org_noise(self, size: int, rng: np.random.Generator) -> np.ndarray:
        """``size`` int64 samples of ``Skellam(mu_org)`` = Poisson - Poisson, exact at any
        mean (:mod:`secure_agg.skellam`)."""
        return skellam(self.mu_org, size, rng)

    def accountant_params(self, dim: int | None = None) -> dict[str, float]:
        """What an RDP accountant needs for the summed Skellam mechanism.

        Sensitivities are in ring units for one org's quantized update. Without
        ``dim`` the L2 sensitivity is the scaled clip ``l2_clip * scale`` (rounding
        ignored); with ``dim`` it is ``l2_clip*scale + sqrt(dim)``, a sure bound after
        stochastic rounding (each coordinate moves by less than 1). The L1
        sensitivity of an integer vector is at most its squared L2 norm, and at most
        ``sqrt(dim)`` times it (Agarwal et al., NeurIPS'21, Theorem 3.5 uses both).
        """
        l2 = self.l2_clip * self.scale
        l1 = l2 * l2
        if dim is not None:
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
                raise ConfigError(f"dim must be an int >= 1, got {dim!r}")
            l2 += math.sqrt(dim)
            l1 = min(l2 * l2, math.sqrt(dim) * l2)
        mu_sum = self.mu_org * self.n_orgs
        return {
            "sigma_sum": self.sigma_sum,
            "sigma_sum_ring": self.sigma_sum * self.scale,
            "variance_sum_ring": 2.0 * mu_sum,
            "mu_org": self.mu_org,
            "mu_sum": mu_sum,
            "n_orgs": float(self.n_orgs),
            "scale": self.scale,
            "noise_multiplier": self.noise_multiplier,
            "l2_clip": self.l2_clip,
            "l2_sensitivity": l2,
            "l1_sensitivity": l1,
        }


def add_signed(y: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """Return ``y + noise mod 2^b`` for a ring array ``y`` and int64 ``noise`` of equal length.

    Negative noise wraps to its two's complement, so it cancels like any ring element.
    """
    if not isinstance(y, np.ndarray) or y.dtype not in (np.uint32, np.uint64):
        raise RingError("y must be a uint32 or uint64 ring array")
    bits = 8 * y.dtype.itemsize
    check_ring(y, bits)
    if not isinstance(noise, np.ndarray) or noise.dtype != np.int64 or noise.shape != y.shape:
        raise RingError(f"noise must be an int64 array of shape {y.shape}")
    result: np.ndarray = np.add(y, noise.astype(y.dtype, casting="unsafe"))
    return result
