"""This org's policies, and the pure check of a run spec against them.

A :class:`RunSpec` is what a run asks of the federation: the task, the number of rounds,
the participating orgs, the secure-aggregation backend and its reconstruction threshold,
and the total differential-privacy budget ``epsilon`` (None: no DP). A
:class:`Policy` is what this org requires of any run it joins. The node checks every
enabled policy before it consents to a run and again before it starts it
(:func:`check_run_against_policy`); each unmet requirement is one :class:`Violation`.

Both dataclasses reject unknown keys and invalid values with :class:`PolicyError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

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


@dataclass(frozen=True)
class RunSpec:
    """What a run asks of every participant.

    task: the training task (a bundled name such as ``tabular`` or ``module:callable``).
    rounds: number of federated rounds.
    participants: org ids taking part, this org included.
    backend: secure-aggregation backend, one of :data:`BACKENDS`.
    threshold: Shamir reconstruction threshold ``t`` (masked backend), at most the number
        of participants.
    epsilon: the run's total (epsilon, delta)-DP budget; None for a run without DP.
    """

    task: str
    rounds: int
    participants: tuple[str, ...]
    backend: str = "masked"
    threshold: int = 2
    epsilon: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not self.task.strip():
            raise PolicyError("task must be a non-empty string")
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
            "task": self.task,
            "rounds": self.rounds,
            "participants": list(self.participants),
            "backend": self.backend,
            "threshold": self.threshold,
            "epsilon": self.epsilon,
        }


@dataclass(frozen=True)
class Policy:
    """What this org requires of every run it joins (None: no requirement).

    min_participants: the fewest orgs a run may have.
    required_backend: the only secure-aggregation backend accepted.
    min_threshold: the smallest reconstruction threshold accepted.
    max_epsilon: the largest total DP budget accepted; a run without DP is refused when set.
    allowed_tasks: the tasks this org trains.
    allowed_peers: the orgs this org trains with (this org itself must be listed too).
    """

    min_participants: int = 2
    required_backend: str | None = None
    min_threshold: int | None = None
    max_epsilon: float | None = None
    allowed_tasks: tuple[str, ...] | None = None
    allowed_peers: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _pos_int(self.min_participants, "min_participants")
        if self.required_backend is not None and self.required_backend not in BACKENDS:
            raise PolicyError(f"required_backend must be one of {', '.join(BACKENDS)}")
        if self.min_threshold is not None:
            _pos_int(self.min_threshold, "min_threshold")
        if self.max_epsilon is not None:
            object.__setattr__(self, "max_epsilon", _pos_float(self.max_epsilon, "max_epsilon"))
        for name in ("allowed_tasks", "allowed_peers"):
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
    if policy.allowed_tasks is not None and spec.task not in policy.allowed_tasks:
        out.append(Violation("allowed_tasks", f"task {spec.task!r} is not allowed"))
    if policy.allowed_peers is not None:
        strangers = sorted(set(spec.participants) - set(policy.allowed_peers))
        if strangers:
            out.append(
                Violation("allowed_peers", f"participants not allowed: {', '.join(strangers)}")
            )
    return out
