"""Ring arithmetic in Z_2^b: dtypes, checks, wrap-around, sums."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from secure_agg.errors import ConfigError, RingError
from secure_agg.ring import check_ring, ring_add, ring_dtype, ring_sub, ring_sum


@pytest.mark.parametrize(
    ("bits", "dtype"),
    [(16, np.uint16), (32, np.uint32), (64, np.uint64)],
    ids=["b16", "b32", "b64"],
)
def test_ring_dtype(bits: int, dtype: type) -> None:
    assert ring_dtype(bits) == np.dtype(dtype)


@pytest.mark.parametrize("bits", [0, 8, 31, 128, True], ids=str)
def test_ring_dtype_rejects_other_widths(bits: int) -> None:
    with pytest.raises(ConfigError, match="bits"):
        ring_dtype(bits)


def test_check_ring_accepts_matching_array() -> None:
    check_ring(np.zeros(5, np.uint64), 64, 5)
    check_ring(np.zeros(0, np.uint32), 32)


@pytest.mark.parametrize(
    ("array", "bits", "length", "match"),
    [
        (np.zeros(4, np.uint64), 32, None, "dtype"),
        (np.zeros(4, np.int32), 32, None, "dtype"),
        (np.zeros((2, 2), np.uint32), 32, None, "one-dimensional"),
        (np.zeros(4, np.uint32), 32, 5, "length"),
        ([0, 1], 32, None, "numpy array"),
    ],
    ids=["wrong-width", "signed", "2d", "wrong-length", "list"],
)
def test_check_ring_rejects(array: np.ndarray, bits: int, length: int | None, match: str) -> None:
    with pytest.raises(RingError, match=match):
        check_ring(array, bits, length)


def test_add_and_sub_wrap() -> None:
    top = np.array([2**32 - 1, 5], np.uint32)
    one = np.array([1, 7], np.uint32)
    np.testing.assert_array_equal(ring_add(top, one), np.array([0, 12], np.uint32))
    np.testing.assert_array_equal(ring_sub(one, top), np.array([2, 2], np.uint32))


def test_add_in_place() -> None:
    a = np.array([1, 2, 3], np.uint64)
    result = ring_add(a, np.array([2**64 - 1] * 3, np.uint64), out=a)
    assert result is a
    np.testing.assert_array_equal(a, np.array([0, 1, 2], np.uint64))


def test_mismatched_operands_are_refused() -> None:
    with pytest.raises(RingError):
        ring_add(np.zeros(3, np.uint32), np.zeros(3, np.uint64))
    with pytest.raises(RingError, match="length"):
        ring_sub(np.zeros(3, np.uint32), np.zeros(4, np.uint32))
    with pytest.raises(RingError):
        ring_add(np.zeros(3, np.uint32), np.zeros(3, np.uint32), out=np.zeros(2, np.uint32))


def test_ring_sum_empty_is_an_error() -> None:
    with pytest.raises(RingError, match="at least one"):
        ring_sum([])


def test_ring_sum_does_not_modify_inputs() -> None:
    a = np.array([1, 2], np.uint32)
    total = ring_sum([a, a, a])
    np.testing.assert_array_equal(total, [3, 6])
    np.testing.assert_array_equal(a, [1, 2])


@given(
    bits=st.sampled_from([32, 64]),
    rows=st.lists(
        st.lists(st.integers(-(2**70), 2**70), min_size=3, max_size=3), min_size=1, max_size=6
    ),
)
def test_ring_sum_matches_integer_sum_mod_2b(bits: int, rows: list[list[int]]) -> None:
    modulus = 2**bits
    arrays = [np.array([v % modulus for v in row], dtype=ring_dtype(bits)) for row in rows]
    expected = [sum(col) % modulus for col in zip(*rows, strict=True)]
    assert [int(v) for v in ring_sum(arrays)] == expected
    diff = ring_sub(arrays[0], arrays[-1])
    assert [int(v) for v in diff] == [
        (a - b) % modulus for a, b in zip(rows[0], rows[-1], strict=True)
    ]


def test_the_16_bit_ring_wraps_mod_2_16() -> None:
    a = np.array([65535, 1, 40000], dtype=np.uint16)
    b = np.array([1, 65535, 40000], dtype=np.uint16)
    np.testing.assert_array_equal(ring_add(a, b), [0, 0, (80000) % 65536])
    np.testing.assert_array_equal(ring_sub(b, a), [2, 65534, 0])
