"""The config checks: each names the field, raises the caller's error, and refuses
bools, NaN and (unless allowed) infinities as numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
from coordinator_free.validate import check_integer, check_keys, check_number, field_error


class FieldFault(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Table:
    a: int = 1
    b: float = 2.0


def test_known_keys_pass_as_a_dict() -> None:
    assert check_keys(Table, {"a": 3}, "table", FieldFault) == {"a": 3}


def test_an_unknown_key_is_named_with_its_table_and_any_others_listed() -> None:
    with pytest.raises(FieldFault) as info:
        check_keys(Table, {"a": 1, "zeta": 2, "gamma": 3}, "table", FieldFault)
    assert info.value.field == "table.gamma"
    assert str(info.value) == "table.gamma: unknown key (also unknown: zeta)"


@pytest.mark.parametrize(
    ("value", "kwargs"),
    [(1, {}), (0.5, {}), (0, {"open_low": False}), (math.inf, {"allow_inf": True})],
)
def test_numbers_in_range_pass(value: float, kwargs: dict[str, Any]) -> None:
    assert check_number("t.x", value, FieldFault, **kwargs) == value


@pytest.mark.parametrize(
    ("value", "kwargs", "message"),
    [
        (0, {}, "t.x: expected a finite number > 0, got 0"),
        (-1, {"open_low": False}, "t.x: expected a finite number >= 0, got -1"),
        (1, {"low": 1}, "t.x: expected a finite number > 1, got 1"),
        (math.nan, {}, "t.x: expected a finite number > 0, got nan"),
        (math.inf, {}, "t.x: expected a finite number > 0, got inf"),
        (math.nan, {"allow_inf": True}, "t.x: expected a number > 0, got nan"),
        (True, {}, "t.x: expected a finite number > 0, got True"),
        ("1", {}, "t.x: expected a finite number > 0, got '1'"),
    ],
)
def test_numbers_out_of_range_or_of_another_type_are_refused(
    value: Any, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(FieldFault) as info:
        check_number("t.x", value, FieldFault, **kwargs)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("value", "low", "passes"),
    [(0, 0, True), (3, 1, True), (0, 1, False), (-1, 0, False), (1.0, 0, False), (True, 0, False)],
)
def test_integers(value: Any, low: int, passes: bool) -> None:
    if passes:
        assert check_integer("t.n", value, FieldFault, low=low) == value
        return
    with pytest.raises(FieldFault) as info:
        check_integer("t.n", value, FieldFault, low=low)
    assert str(info.value) == f"t.n: expected an integer >= {low}, got {value!r}"


def test_a_wrong_type_goes_to_the_type_error_when_one_is_given() -> None:
    bad, mistyped = field_error(ValueError), field_error(TypeError)
    with pytest.raises(TypeError, match=r"^C\.x: expected a finite number > 0, got 'x'$"):
        check_number("C.x", "x", bad, type_error=mistyped)
    with pytest.raises(ValueError, match=r"^C\.x: expected a finite number > 0, got -1$"):
        check_number("C.x", -1, bad, type_error=mistyped)
    with pytest.raises(TypeError, match=r"^C\.n: expected an integer >= 1, got 1\.5$"):
        check_integer("C.n", 1.5, bad, low=1, type_error=mistyped)
