"""The errors of the strategies and their helpers: one base class, :class:`StrategyError`
(a ``ValueError``), and a subclass per kind of fault."""

from __future__ import annotations

__all__ = [
    "EmptyAggregateError",
    "ShapeMismatchError",
    "StateMismatchError",
    "StrategyConfigError",
    "StrategyError",
]


class StrategyError(ValueError):
    """Base class of the errors raised by strategies and their helpers."""


class StrategyConfigError(StrategyError):
    """A strategy configuration has an unknown key or an invalid value."""


class ShapeMismatchError(StrategyError):
    """Parameters, updates or packed vectors disagree in layout."""


class EmptyAggregateError(StrategyError):
    """The summed weight is not positive: no org contributed to the round."""


class StateMismatchError(StrategyError):
    """A state dict belongs to another strategy or another configuration."""
