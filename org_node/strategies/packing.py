"""The secure vector of one org: ``[w * delta, w]`` flattened (:func:`pack_weighted`), and
its inverse on the summed vector (:func:`unpack_weighted`).

Summing the packed vectors of the orgs gives ``sum_i w_i delta_i`` and ``sum_i w_i``, so
the weighted mean is computed without any org revealing its own weight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from org_node.strategies.errors import ShapeMismatchError, StrategyConfigError

__all__ = ["NDArrays", "pack_weighted", "params_shapes", "unpack_weighted"]

NDArrays = list[np.ndarray]


def params_shapes(params: Sequence[np.ndarray]) -> list[tuple[int, ...]]:
    """The shape of every tensor of ``params``, the layout that unpacking needs."""
    return [tuple(int(d) for d in np.shape(p)) for p in params]


def pack_weighted(update: Sequence[np.ndarray], weight: float) -> np.ndarray:
    """Flatten ``weight * update`` and append ``weight``: one org's secure vector.

    The result is float64 of length ``sum(p.size) + 1``. Summing these vectors over
    orgs (by the secure sum) yields ``[sum_i w_i delta_i, sum_i w_i]``, so the
    weighted mean is computed without any org revealing its own weight.

    Raises :class:`StrategyConfigError` for a negative or non-finite weight.
    """
    w = float(weight)
    if not math.isfinite(w) or w < 0:
        raise StrategyConfigError(f"weight must be finite and >= 0, got {weight!r}")
    parts = [np.asarray(u, dtype=np.float64).ravel() * w for u in update]
    parts.append(np.array([w], dtype=np.float64))
    return np.concatenate(parts)


def unpack_weighted(vec: np.ndarray, shapes: Sequence[Sequence[int]]) -> tuple[NDArrays, float]:
    """Split a (summed) packed vector into ``(updates, total_weight)``.

    ``shapes`` is the layout of the model (:func:`params_shapes`); raises
    :class:`ShapeMismatchError` when ``vec`` does not have ``sum(sizes) + 1`` entries.
    """
    flat = np.asarray(vec, dtype=np.float64).ravel()
    sizes = [math.prod(s) for s in shapes]
    expected = sum(sizes) + 1
    if flat.size != expected:
        raise ShapeMismatchError(
            f"packed vector has {flat.size} entries, the layout needs {expected}"
        )
    out: NDArrays = []
    offset = 0
    for shape, size in zip(shapes, sizes, strict=True):
        out.append(flat[offset : offset + size].reshape(tuple(shape)).copy())
        offset += size
    return out, float(flat[-1])
