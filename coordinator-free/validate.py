"""Checks shared by the config dataclasses: unknown keys, numbers and integers in range.

A check names the field at fault as its caller spells it (``table.key`` for a table of
the node's config file, ``Class.field`` for a dataclass built in code) and raises the
error its caller picks, built as ``error(field, message)``: the config file's
``ConfigError``, the engine's ``EngineError``, or :func:`field_error` of a built-in
exception (``"field: message"``). A value of the wrong type goes through
``type_error`` where one is given (a dataclass built in code raises ``TypeError`` for
it and ``ValueError`` for a value out of range), else through ``error``.

``bool`` is never taken for a number: ``true`` in a TOML file is not ``1``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

__all__ = ["FieldError", "check_integer", "check_keys", "check_number", "field_error"]

FieldError = Callable[[str, str], Exception]
"""Builds the error to raise from the field's name and what is wrong with it."""


def field_error(kind: type[Exception]) -> FieldError:
    """Errors of type ``kind`` with the message ``"field: message"``."""

    def build(field: str, message: str) -> Exception:
        return kind(f"{field}: {message}")

    return build


def check_keys(
    cls: type[Any], values: Mapping[str, Any], table: str, error: FieldError
) -> dict[str, Any]:
    """``values`` as a dict, when each key is a field of the dataclass ``cls``.

    Otherwise ``error("table.key", "unknown key")`` for the first unknown key in sorted
    order; the message lists any other unknown keys too.
    """
    known = {f.name for f in fields(cls)}
    unknown = sorted(map(str, set(values) - known))
    if unknown:
        more = f" (also unknown: {', '.join(unknown[1:])})" if len(unknown) > 1 else ""
        raise error(f"{table}.{unknown[0]}", f"unknown key{more}")
    return dict(values)


def check_number(
    field: str,
    value: Any,
    error: FieldError,
    *,
    low: float = 0.0,
    open_low: bool = True,
    allow_inf: bool = False,
    type_error: FieldError | None = None,
) -> float:
    """``value`` if it is a number above ``low`` (or equal to it, without ``open_low``).

    NaN is refused; so is an infinity unless ``allow_inf`` (a bound that never binds).
    """
    bound = f"{'>' if open_low else '>='} {low:g}"
    problem = f"expected {'a number' if allow_inf else 'a finite number'} {bound}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise (type_error or error)(field, problem)
    too_low = value < low or (open_low and value == low)
    if too_low or math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise error(field, problem)
    return value


def check_integer(
    field: str,
    value: Any,
    error: FieldError,
    *,
    low: int = 0,
    type_error: FieldError | None = None,
) -> int:
    """``value`` if it is an integer ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise (type_error or error)(field, f"expected an integer >= {low}, got {value!r}")
    if value < low:
        raise error(field, f"expected an integer >= {low}, got {value!r}")
    return value
