"""Exceptions of the local training job; each names the field or parameter at fault."""

from __future__ import annotations

__all__ = [
    "JobFailedError",
    "NonFiniteUpdateError",
    "ShapeMismatchError",
    "SpecError",
    "TrainingError",
]


class TrainingError(Exception):
    """Base class of the local job's errors."""


class SpecError(TrainingError, ValueError):
    """A run spec field is missing, unknown or inconsistent; ``field`` names it."""

    def __init__(self, field: str, detail: str) -> None:
        self.field = field
        self.detail = detail
        super().__init__(f"{field}: {detail}")


class ShapeMismatchError(TrainingError, ValueError):
    """The global model and the task's model disagree on a parameter's name or shape."""

    def __init__(self, parameter: str, detail: str) -> None:
        self.parameter = parameter
        self.detail = detail
        super().__init__(f"parameter {parameter!r}: {detail}")


class NonFiniteUpdateError(TrainingError, ValueError):
    """An update (or a global model) holds NaN or Inf; it is never sent."""

    def __init__(self, parameter: str, count: int, what: str = "update") -> None:
        self.parameter = parameter
        self.count = count
        self.what = what
        super().__init__(f"{what}[{parameter!r}] holds {count} NaN/Inf value(s); not sent")


class JobFailedError(TrainingError, RuntimeError):
    """The torchrun job exited without a result."""
