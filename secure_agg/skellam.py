"""Skellam samples at any mean: numpy's Poisson sampler where it is exact, a rejection
sampler with an exactly evaluated Poisson ratio above.

``Skellam(mu)`` is ``N1 - N2`` for independent ``N1, N2 ~ Poisson(mu)``. numpy's
Poisson sampler (PTRS) computes its candidate in float64 and drifts once the mean is
large: at 1e15 its spread is 1.02x the nominal one, at 1e16 1.19x with every sample even,
at 1e17 every sample a multiple of 16. Distributed DP noise reaches such means at any
noise multiplier times L2 clip of about one with 24 fraction bits, so above
:data:`DIRECT_MAX` (2^40, four orders of magnitude inside numpy's exact range) this
module draws ``N - floor(lambda)`` directly, by rejection:

- proposal: the discrete Laplace law ``P(y) ~ exp(-|y| / b)`` with ``b = sqrt(lambda)``,
  drawn as ``floor(b E1) - floor(b E2)`` for standard exponentials ``E1, E2`` (each
  ``floor(b E)`` is geometric, exactly, since ``E`` is memoryless);
- target: ``log P(N = m + y) - log P(N = m)`` for ``m = floor(lambda)``, evaluated as
  ``y log1p(f/m) - m phi(y/m) - log1p(y/m)/2 + y / (12 m (m + y))`` (Stirling's series
  to its ``1/(12 n)`` term, whose next term is below 1e-36 here; ``phi(t) = (1 + t)
  log1p(t) - t`` by its power series for small ``t``), so no quantity of the size of
  ``lambda`` is ever rounded: the offsets, their parity and their low bits are exact
  integers;
- acceptance: ``log U < target(y) + |y| / b - C`` with ``C = 1/2 + 8 / b``, which bounds
  ``target + |y|/b`` from above (its maximum is ``1/2 + O(1/b)``, at ``|y| ~ b``; the
  bound is checked on a grid in the tests), so the accepted offsets follow the Poisson
  law; about three of four candidates are kept.

The two ``floor(lambda)`` cancel in the difference, so a Skellam sample is the
difference of two offsets. Means up to :data:`MU_MAX` are sampled (offsets stay far
inside float64's exact integers).
"""

from __future__ import annotations

import math

import numpy as np

from .errors import ConfigError

__all__ = ["DIRECT_MAX", "MU_MAX", "acceptance_bound", "log_poisson_ratio", "skellam"]

DIRECT_MAX = 2.0**40
"""Up to this mean numpy's Poisson sampler is used (its spread, kurtosis and low bits
match the theory up to about 1e14)."""

MU_MAX = 1.0e24
"""The largest mean sampled: offsets of 60 standard deviations stay below 2^53."""

_SERIES_T = 1.0e-3


def _phi(t: np.ndarray) -> np.ndarray:
    """``(1 + t) log1p(t) - t``, accurate near 0 (a power series below ``_SERIES_T``)."""
    small = np.abs(t) < _SERIES_T
    ts = np.where(small, t, 0.0)
    series = np.zeros_like(ts)
    power = ts * ts
    for k in range(2, 10):
        series += (-1.0) ** k * power / (k * (k - 1))
        power = power * ts
    with np.errstate(invalid="ignore", divide="ignore"):
        direct = (1.0 + t) * np.log1p(t) - t
    return np.where(small, series, direct)


def log_poisson_ratio(y: np.ndarray, lam: float) -> np.ndarray:
    """``log P(N = m + y) - log P(N = m)`` for ``N ~ Poisson(lam)``, ``m = floor(lam)``
    (``-inf`` where ``m + y < 0``); ``lam >= DIRECT_MAX``."""
    m = math.floor(lam)
    frac = lam - m
    mf = float(m)
    y = np.asarray(y, dtype=np.float64)
    t = y / mf
    valid = t > -1.0
    tv = np.where(valid, t, 0.0)
    out = (
        y * math.log1p(frac / mf)
        - mf * _phi(tv)
        - 0.5 * np.log1p(tv)
        + y / (12.0 * mf * (mf + np.where(valid, y, 0.0)))
    )
    return np.where(valid, out, -np.inf)


def acceptance_bound(lam: float) -> float:
    """``C`` with ``log_poisson_ratio(y) + |y| / sqrt(lam) <= C`` for every ``y``."""
    return 0.5 + 8.0 / math.sqrt(lam) + 1.0e-9


def _poisson_offsets(lam: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` samples of ``N - floor(lam)``, ``N ~ Poisson(lam)``, as int64."""
    b = math.sqrt(lam)
    bound = acceptance_bound(lam)
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        want = size - filled
        k = want + want // 2 + 64
        y = np.floor(b * rng.standard_exponential(k)) - np.floor(b * rng.standard_exponential(k))
        log_u = -rng.standard_exponential(k)
        keep = y[log_u < log_poisson_ratio(y, lam) + np.abs(y) / b - bound][:want]
        out[filled : filled + keep.size] = keep.astype(np.int64)
        filled += keep.size
    return out


def skellam(mu: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` int64 samples of ``Skellam(mu)`` (``Poisson(mu) - Poisson(mu)``)."""
    if isinstance(mu, bool) or not isinstance(mu, int | float) or not math.isfinite(mu):
        raise ConfigError(f"mu must be a finite number, got {mu!r}")
    if mu < 0 or mu > MU_MAX:
        raise ConfigError(f"mu must be in [0, {MU_MAX:g}], got {mu!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ConfigError(f"size must be a non-negative int, got {size!r}")
    if not isinstance(rng, np.random.Generator):
        raise ConfigError("rng must be a numpy.random.Generator")
    if mu <= DIRECT_MAX:
        noise = rng.poisson(mu, size).astype(np.int64, copy=False)
        noise -= rng.poisson(mu, size).astype(np.int64, copy=False)
        return noise
    first = _poisson_offsets(float(mu), size, rng)
    first -= _poisson_offsets(float(mu), size, rng)
    return first
