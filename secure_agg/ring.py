"""Arithmetic in the ring ``Z_2^b`` for ``b`` in {16, 32, 64}.

Ring elements are stored as ``np.uint16`` (``b = 16``, the ring of 8-bit compressed
updates: :mod:`secure_agg.q8`), ``np.uint32`` (``b = 32``) or ``np.uint64`` (``b = 64``)
one-dimensional arrays. Unsigned integer arithmetic in numpy wraps modulo ``2^b``,
which is exactly the ring addition used by masked secure aggregation
(Bonawitz et al., CCS'17, Section 4: masks cancel in ``Z_R``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from .errors import ConfigError, RingError

__all__ = ["RING_BITS", "check_ring", "ring_add", "ring_dtype", "ring_sub", "ring_sum"]

#: The supported ring widths.
RING_BITS: tuple[int, ...] = (16, 32, 64)

_DTYPES: dict[int, np.dtype[Any]] = {
    16: np.dtype(np.uint16),
    32: np.dtype(np.uint32),
    64: np.dtype(np.uint64),
}


def ring_dtype(bits: int) -> np.dtype[Any]:
    """Return the unsigned dtype that stores elements of ``Z_2^bits``.

    Raises:
        ConfigError: ``bits`` is not 16, 32 or 64.
    """
    if isinstance(bits, bool) or bits not in _DTYPES:
        raise ConfigError(f"bits must be 16, 32 or 64, got {bits!r}")
    return _DTYPES[bits]


def _bits_of(a: np.ndarray) -> int:
    if not isinstance(a, np.ndarray):
        raise RingError(f"expected a numpy array, got {type(a).__name__}")
    for bits, dtype in _DTYPES.items():
        if a.dtype == dtype:
            return bits
    raise RingError(f"ring arrays must have dtype uint16, uint32 or uint64, got {a.dtype}")


def check_ring(a: np.ndarray, bits: int, length: int | None = None) -> None:
    """Check that ``a`` is a one-dimensional ``Z_2^bits`` array of the given length.

    Raises:
        ConfigError: ``bits`` is not a supported width.
        RingError: ``a`` is not an ndarray, has another dtype, is not one-dimensional,
            or its length differs from ``length``.
    """
    dtype = ring_dtype(bits)
    if not isinstance(a, np.ndarray):
        raise RingError(f"expected a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise RingError(f"expected dtype {dtype} for a {bits}-bit ring, got {a.dtype}")
    if a.ndim != 1:
        raise RingError(f"ring arrays must be one-dimensional, got shape {a.shape}")
    if length is not None and a.shape[0] != length:
        raise RingError(f"expected length {length}, got {a.shape[0]}")


def _check_pair(a: np.ndarray, b: np.ndarray, out: np.ndarray | None) -> None:
    bits = _bits_of(a)
    check_ring(a, bits)
    check_ring(b, bits, a.shape[0])
    if out is not None:
        check_ring(out, bits, a.shape[0])


def ring_add(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Return ``a + b mod 2^b``; both operands share one ring dtype and length.

    ``out`` (which may be ``a`` or ``b``) receives the result without a temporary.
    """
    _check_pair(a, b, out)
    result: np.ndarray = np.add(a, b, out=out)
    return result


def ring_sub(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Return ``a - b mod 2^b``; both operands share one ring dtype and length."""
    _check_pair(a, b, out)
    result: np.ndarray = np.subtract(a, b, out=out)
    return result


def ring_sum(arrays: Iterable[np.ndarray]) -> np.ndarray:
    """Return the ring sum of one or more arrays of the same dtype and length.

    The inputs are not modified; the result is a new array.

    Raises:
        RingError: no arrays, or mismatched dtypes/lengths.
    """
    total: np.ndarray | None = None
    for a in arrays:
        if total is None:
            check_ring(a, _bits_of(a))
            total = a.copy()
        else:
            ring_add(total, a, out=total)
    if total is None:
        raise RingError("ring_sum needs at least one array")
    return total
