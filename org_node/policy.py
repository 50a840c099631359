"""This org's policies, and the pure check of a run spec against them.

A :class:`RunSpec` is what a run asks of the federation: the trainer (a name each org has
installed, optionally pinned by its code hash), the number of rounds, the participating
orgs, the secure-aggregation backend and its reconstruction threshold, the total
differential-privacy budget ``epsilon`` (None: no DP), what data it needs (never a
path) and its config values. A
:class:`Policy` is what this org requires of any run it joins. The node checks every
enabled policy before it consents to a run and again before it starts it
(:func:`check_run_against_policy`); each unmet requirement is one :class:`Violation`.

Both dataclasses reject unknown keys and invalid values with :class:`PolicyError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from org_node.compression import COMPRESSION_NONE, Compression, CompressionError
from org_node.datasets import DataSpec, DataSpecError
from org_node.dp_spec import DpMechanism, DpMechanismError
from org_node.run_config import QUORUM_WAIT_DEFAULT_S, QUORUM_WAIT_MAX_S

__all__ = [
    "BACKENDS",
    "Policy",
    "PolicyError",
    "RunSpec",
    "Violation",
    "check_run_against_policy",
]

BACKENDS = ("masked", "ckks")
"""Secure-aggregation backends: pairwise-masked sums (SecAgg+) and CKKS sums."""


class PolicyError(ValueError):
    """A run spec or a policy with an unknown key or an invalid value."""


def _names(values: Any, what: str, *, allow_empty: bool) -> tuple[str, ...]:
    if isinstance(values, str) or not isinstance(values, Sequence):
        raise PolicyError(f"{what} must be a list of names")
    out = tuple(values)
    if not all(isinstance(v, str) and v for v in out):
        raise PolicyError(f"{what} must hold non-empty strings")
    if len(set(out)) != len(out):
        raise PolicyError(f"{what} holds duplicates")
    if not allow_empty and not out:
        raise PolicyError(f"{what} must not be empty")
    return out


def _pos_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PolicyError(f"{what} must be a positive integer")
    return value


def _pos_float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PolicyError(f"{what} must be a number")
    if not math.isfinite(value) or value <= 0:
        raise PolicyError(f"{what} must be finite and positive")
    return float(value)


def _from_mapping(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(values, Mapping):
        raise PolicyError(f"{cls.__name__} must be an object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise PolicyError(f"unknown {cls.__name__} keys: {', '.join(map(str, unknown))}")
    return dict(values)


def _trainer_name(value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 100:
        raise PolicyError("trainer must be a name of 1-100 characters")
    if not (value[0].isalnum() and all(c.isalnum() or c in "._-" for c in value)):
        raise PolicyError(
            f"trainer {value!r} is not a trainer name (letters, digits, '.', '_', '-'): a "
            "run names a trainer each org installed, never code"
        )
    return value


@dataclass(frozen=True)
class RunSpec:
    """What a run asks of every participant.

    trainer: the name of a trainer each participant installed (``tabular``,
        ``breast_cancer``, ``digits``, ``gpt`` are always installed); never code.
    rounds: number of federated rounds.
    participants: org ids taking part, this org included.
    backend: secure-aggregation backend, one of :data:`BACKENDS`.
    threshold: Shamir reconstruction threshold ``t`` (masked backend), at most the number
        of participants.
    epsilon: the run's total (epsilon, delta)-DP budget; None for a run without DP.
    trainer_hash: pins the trainer's code (SHA-256 hex); None to accept each org's.
    data: what each org's bound dataset must hold; None for a run that needs none.
    config: the run's config values (Flower's ``run_config``; the tabular trainer's
        ``target``, ``features``, ``model``, ...).
    quorum: how many participants must consent for the run to start (None: all of
        them); at least ``threshold``. With fewer than all, the run starts at the
        consent deadline with those that consented.
    quorum_wait_s: how long one round may wait for a quorum (``threshold`` participants
        ready) before the run fails; the round tries again with a bounded backoff
        meanwhile. 1 s to one day, default one hour.
    dp: the DP mechanism every participant adds its noise with
        (:class:`org_node.dp_spec.DpMechanism`); a run with an ``epsilon`` needs one
        (the proposing node fills in its own when the proposal names none), a run
        without takes none.
    compression: how each org compresses its update before masking
        (:mod:`org_node.compression`): ``none`` (default), ``q8``, ``random-k=F`` or
        ``random-k=F,q8``; stored in its canonical form. Masked backend only, never
        with an epsilon.
    """

    trainer: str
    rounds: int
    participants: tuple[str, ...]
    backend: str = "masked"
    threshold: int = 2
    epsilon: float | None = None
    trainer_hash: str | None = None
    data: DataSpec | None = None
    config: Mapping[str, bool | int | float | str] = field(default_factory=dict)
    quorum: int | None = None
    quorum_wait_s: float = QUORUM_WAIT_DEFAULT_S
    dp: DpMechanism | None = None
    compression: str = COMPRESSION_NONE

    def __post_init__(self) -> None:
        _trainer_name(self.trainer)
        wait = _pos_float(self.quorum_wait_s, "quorum_wait_s")
        if not 1.0 <= wait <= QUORUM_WAIT_MAX_S:
            raise PolicyError(
                f"quorum_wait_s must be between 1 and {QUORUM_WAIT_MAX_S:g} seconds (one day)"
            )
        object.__setattr__(self, "quorum_wait_s", wait)
        if self.trainer_hash is not None and not (
            isinstance(self.trainer_hash, str)
            and len(self.trainer_hash) == 64
            and all(c in "0123456789abcdef" for c in self.trainer_hash)
        ):
            raise PolicyError("trainer_hash must be 64 lowercase hex digits (a SHA-256)")
        if self.data is not None and not isinstance(self.data, DataSpec):
            try:
                object.__setattr__(self, "data", DataSpec.from_dict(self.data))
            except (DataSpecError, TypeError) as exc:
                raise PolicyError(str(exc)) from None
        if not isinstance(self.config, Mapping):
            raise PolicyError("config must be an object of names to values")
        for key, value in self.config.items():
            if not isinstance(key, str) or not key:
                raise PolicyError("config keys must be non-empty strings")
            if not isinstance(value, bool | int | float | str):
                raise PolicyError(f"config[{key!r}] must be a boolean, number or string")
        object.__setattr__(self, "config", dict(self.config))
        _pos_int(self.rounds, "rounds")
        object.__setattr__(
            self, "participants", _names(self.participants, "participants", allow_empty=False)
        )
        if self.backend not in BACKENDS:
            raise PolicyError(f"backend must be one of {', '.join(BACKENDS)}")
        _pos_int(self.threshold, "threshold")
        if self.threshold > len(self.participants):
            raise PolicyError("threshold exceeds the number of participants")
        if self.epsilon is not None:
            object.__setattr__(self, "epsilon", _pos_float(self.epsilon, "epsilon"))
        self._check_dp()
        if self.quorum is not None:
            _pos_int(self.quorum, "quorum")
            if not self.threshold <= self.quorum <= len(self.participants):
                raise PolicyError(
                    f"quorum must be between the threshold ({self.threshold}) and the "
                    f"number of participants ({len(self.participants)})"
                )
        self._check_compression()

    def _check_compression(self) -> None:
        try:
            compression = Compression.parse(self.compression)
            compression.check_run(
                participants=len(self.participants), backend=self.backend, epsilon=self.epsilon
            )
        except CompressionError as exc:
            raise PolicyError(str(exc)) from None
        object.__setattr__(self, "compression", str(compression))

    def _check_dp(self) -> None:
        if self.dp is None:
            return
        if not isinstance(self.dp, DpMechanism):
            try:
                object.__setattr__(self, "dp", DpMechanism.from_dict(self.dp))
            except DpMechanismError as exc:
                raise PolicyError(str(exc)) from None
        if self.epsilon is None:
            raise PolicyError("dp: a DP mechanism needs an epsilon (a run without DP takes none)")

    @property
    def consents_needed(self) -> int:
        """Consents the run needs to start: its quorum, or every participant."""
        return len(self.participants) if self.quorum is None else self.quorum

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RunSpec:
        """Build from a JSON object; unknown keys are an error."""
        kwargs = _from_mapping(cls, values)
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise PolicyError(f"incomplete run spec: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "trainer": self.trainer,
            "trainer_hash": self.trainer_hash,
            "rounds": self.rounds,
            "participants": list(self.participants),
            "backend": self.backend,
            "threshold": self.threshold,
            "epsilon": self.epsilon,
            "data": None if self.data is None else self.data.to_dict(),
            "config": dict(self.config),
            "quorum": self.quorum,
            "quorum_wait_s": self.quorum_wait_s,
            "dp": None if self.dp is None else self.dp.to_dict(),
            "compression": self.compression,
        }


@dataclass(frozen=True)
class Policy:
    """What this org requires of every run it joins (None: no requirement).

    min_participants: the fewest orgs a run may have.
    required_backend: the only secure-aggregation backend accepted.
    min_threshold: the smallest reconstruction threshold accepted.
    max_epsilon: the largest total DP budget accepted; a run without DP is refused when set.
    allowed_trainers: the trainers (by name) this org trains with.
    allowed_peers: the orgs this org trains with (this org itself must be listed too).
    """

    min_participants: int = 2
    required_backend: str | None = None
    min_threshold: int | None = None
    max_epsilon: float | None = None
    allowed_trainers: tuple[str, ...] | None = None
    allowed_peers: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _pos_int(self.min_participants, "min_participants")
        if self.required_backend is not None and self.required_backend not in BACKENDS:
            raise PolicyError(f"required_backend must be one of {', '.join(BACKENDS)}")
        if self.min_threshold is not None:
            _pos_int(self.min_threshold, "min_threshold")
        if self.max_epsilon is not None:
            object.__setattr__(self, "max_epsilon", _pos_float(self.max_epsilon, "max_epsilon"))
        for name in ("allowed_trainers", "allowed_peers"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _names(value, name, allow_empty=True))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Policy:
        """Build from a JSON object; unknown keys are an error."""
        return cls(**_from_mapping(cls, values))


@dataclass(frozen=True)
class Violation:
    """One requirement of a policy that a run spec does not meet."""

    requirement: str
    message: str


def check_run_against_policy(spec: RunSpec, policy: Policy) -> list[Violation]:
    """Every requirement of ``policy`` that ``spec`` breaks; empty when the run may go."""
    out: list[Violation] = []
    n = len(spec.participants)
    if n < policy.min_participants:
        out.append(
            Violation(
                "min_participants",
                f"run has {n} participants, policy requires at least {policy.min_participants}",
            )
        )
    if policy.required_backend is not None and spec.backend != policy.required_backend:
        out.append(
            Violation(
                "required_backend",
                f"run uses {spec.backend!r}, policy requires {policy.required_backend!r}",
            )
        )
    if policy.min_threshold is not None and spec.threshold < policy.min_threshold:
        out.append(
            Violation(
                "min_threshold",
                f"run threshold {spec.threshold} is below the policy's {policy.min_threshold}",
            )
        )
    if policy.max_epsilon is not None:
        if spec.epsilon is None:
            out.append(Violation("max_epsilon", "run has no DP budget, policy requires one"))
        elif spec.epsilon > policy.max_epsilon:
            out.append(
                Violation(
                    "max_epsilon",
                    f"run epsilon {spec.epsilon:g} exceeds the policy's {policy.max_epsilon:g}",
                )
            )
    if policy.allowed_trainers is not None and spec.trainer not in policy.allowed_trainers:
        out.append(Violation("allowed_trainers", f"trainer {spec.trainer!r} is not allowed"))
    if policy.allowed_peers is not None:
        strangers = sorted(set(spec.participants) - set(policy.allowed_peers))
        if strangers:
            out.append(
                Violation("allowed_peers", f"participants not allowed: {', '.join(strangers)}")
            )
    return out
