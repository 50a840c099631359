"""The DP mechanism a run's participants agree on (the run spec's ``dp``).

A run with an ``epsilon`` protects each org's contribution with distributed Skellam
noise (:mod:`org_node.privacy`). How much noise, on which clip, at which ``delta`` and
how the noise is shared out are properties of the *run*, not of one org: every
participant must add its share on the same terms, or the sum carries a noise no
accountant assumed. So the mechanism is part of the run spec, which every participant
signs at consent (its run key covers it), and a node refuses a run whose mechanism
differs from its own (the ``[engine]`` table of its config): at consent, and again
when the run starts or resumes.

``noise_for`` says for how many orgs each org's share of the noise is sized:

* ``participants`` — all planned participants: a round where every participant
  survives carries exactly the nominal noise ``noise_multiplier * l2_clip``, and a round
  with ``s`` survivors carries ``s / n`` of its variance; the accountant charges each
  round for the survivors it had.
* ``threshold`` — the threshold ``t``: any round that completes (it needs ``t``
  survivors) carries at least the nominal noise; with all ``n`` it carries ``n / t``
  times its variance (more noise than asked for, the price of never less).

This module imports nothing heavy: the CLI and the API read it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = [
    "FRAC_BITS_DEFAULT",
    "NOISE_FOR",
    "DpMechanism",
    "DpMechanismError",
    "dp_disagreement",
    "with_own_dp",
]

NOISE_FOR = ("participants", "threshold")
"""For whom each org's share of the noise is sized (see the module docstring)."""

FRAC_BITS_DEFAULT = 24
"""Fraction bits of the fixed-point codec under DP when the config sets none."""


class DpMechanismError(ValueError):
    """A DP mechanism with an unknown key or a value out of range."""


def _positive(name: str, value: Any, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DpMechanismError(f"dp.{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v <= 0 or v > high:
        raise DpMechanismError(f"dp.{name} must be > 0 and at most {high:g}, got {value!r}")
    return v


@dataclass(frozen=True)
class DpMechanism:
    """The distributed Skellam mechanism of a run.

    noise_multiplier: standard deviation of the sum's noise over ``l2_clip`` (at the
        sizing ``noise_for`` names).
    l2_clip: L2 bound of each org's packed update, in float units.
    delta: the delta at which epsilon is accounted.
    frac_bits: fraction bits of the fixed-point codec (the noise is added in its units).
    noise_for: ``participants`` or ``threshold`` (see the module docstring).
    """

    noise_multiplier: float
    l2_clip: float
    delta: float
    frac_bits: int = FRAC_BITS_DEFAULT
    noise_for: str = "participants"

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "noise_multiplier", _positive("noise_multiplier", self.noise_multiplier, 1e6)
        )
        object.__setattr__(self, "l2_clip", _positive("l2_clip", self.l2_clip, 1e12))
        delta = _positive("delta", self.delta, 1.0)
        if delta >= 1.0:
            raise DpMechanismError(f"dp.delta must be < 1, got {self.delta!r}")
        object.__setattr__(self, "delta", delta)
        bits = self.frac_bits
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 48:
            raise DpMechanismError(f"dp.frac_bits must be an integer in [1, 48], got {bits!r}")
        if self.noise_for not in NOISE_FOR:
            raise DpMechanismError(f"dp.noise_for must be one of {', '.join(NOISE_FOR)}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DpMechanism:
        """Build from a JSON object; unknown or missing keys are an error."""
        if not isinstance(values, Mapping):
            raise DpMechanismError("dp must be an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in set(values) - known)
        if unknown:
            raise DpMechanismError(f"unknown dp keys: {', '.join(unknown)}")
        try:
            return cls(**values)
        except TypeError as exc:
            raise DpMechanismError(f"incomplete dp mechanism: {exc}") from None

    @classmethod
    def of_engine(cls, engine: Any) -> DpMechanism:
        """This org's own mechanism: the DP settings of its ``[engine]`` table."""
        return cls(
            noise_multiplier=engine.noise_multiplier,
            l2_clip=engine.l2_clip,
            delta=engine.delta,
            frac_bits=engine.frac_bits if engine.frac_bits is not None else FRAC_BITS_DEFAULT,
            noise_for=engine.noise_for,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def key_body(self) -> dict[str, Any]:
        """The form the run key hashes: floats as their ``repr`` (canonical JSON holds
        no floats), so one mechanism always gives one key."""
        return {k: repr(v) if isinstance(v, float) else v for k, v in self.to_dict().items()}

    def differences(self, own: DpMechanism) -> list[str]:
        """Each field where this (the run's) mechanism differs from ``own`` (this org's),
        as ``"name: the run's X, this org's Y"``; empty when they agree."""
        mine, theirs = own.to_dict(), self.to_dict()
        return [
            f"{name}: the run's {theirs[name]!r}, this org's {mine[name]!r}"
            for name in theirs
            if theirs[name] != mine[name]
        ]

    def noise_shares(self, participants: int, threshold: int) -> int:
        """For how many orgs each org's share of the noise is sized."""
        return threshold if self.noise_for == "threshold" else participants


def with_own_dp(spec: Mapping[str, Any], engine: Any) -> dict[str, Any]:
    """``spec`` with this org's mechanism (from its ``[engine]`` table) filled in, for a
    run with an epsilon whose proposal names none; otherwise ``spec`` unchanged."""
    out = dict(spec)
    if out.get("epsilon") is not None and out.get("dp") is None:
        out["dp"] = DpMechanism.of_engine(engine).to_dict()
    return out


def dp_disagreement(spec: Mapping[str, Any], engine: Any) -> str | None:
    """Why this org (its ``[engine]`` table) cannot add noise to the run ``spec`` asks
    for; None when the run has no epsilon or its mechanism is this org's own."""
    if spec.get("epsilon") is None:
        return None
    if engine.weighting != "uniform":
        return (
            'a run with DP needs [engine] weighting = "uniform" here: the noisy sum of '
            "the weights cannot divide the update, the count of survivors does"
        )
    if spec.get("dp") is None:
        return (
            "the run has an epsilon but names no DP mechanism (dp), so its participants "
            "have not agreed on the noise: propose it again"
        )
    try:
        run = DpMechanism.from_dict(spec["dp"])
    except DpMechanismError as exc:
        return str(exc)
    diffs = run.differences(DpMechanism.of_engine(engine))
    if not diffs:
        return None
    return "its DP mechanism differs from this org's ([engine] table): " + "; ".join(diffs)
