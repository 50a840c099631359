"""Step 3 of a round, pack, and its inverse: one org's update as its secure vector.

The run engine (:class:`~org_node.engine.RunEngine`) packs the local job's update with
FedNova normalization (Wang et al., NeurIPS 2020, eq. 7) when the engine config asks
for it: the org contributes ``w * delta / tau``, ``w * tau`` and ``w`` inside one
vector (:func:`org_node.strategies.pack_weighted`), so that orgs on a time budget do
not bias the model and no org reveals its weight or steps; without FedNova,
``w * delta`` and ``w``. After the secure sum, :func:`unpack_sum` turns the decoded
vector back into ``(sum of w * delta, sum of w)`` for the strategy's step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from org_node.run_config import UpdateRejected
from org_node.strategies import pack_weighted, params_shapes, unpack_weighted
from org_node.training.exchange import LocalResult

__all__ = ["pack_update", "packing_scale", "unpack_sum"]


def _weight(result: LocalResult, weighting: str) -> float:
    return float(result.num_examples) if weighting == "examples" else 1.0


def _tau(result: LocalResult, fednova: bool) -> float:
    return float(max(1, result.steps)) if fednova else 1.0


def packing_scale(result: LocalResult, *, weighting: str, fednova: bool) -> float:
    """The packed body's units per model unit: the weight, over tau under FedNova."""
    return _weight(result, weighting) / _tau(result, fednova)


def pack_update(
    result: LocalResult, names: Sequence[str], *, weighting: str, fednova: bool
) -> np.ndarray:
    """The update of tensors ``names`` (in that order) as one float64 vector; raises
    :class:`UpdateRejected` when it holds NaN or Inf."""
    weight = _weight(result, weighting)
    update = [np.asarray(result.update[k], dtype=np.float64) for k in names]
    if fednova:
        tau = _tau(result, fednova)
        packed = pack_weighted([*(u / tau for u in update), np.array([tau])], weight)
    else:
        packed = pack_weighted(update, weight)
    if not np.isfinite(packed).all():
        raise UpdateRejected("update", "the packed update holds NaN or Inf")
    return packed


def unpack_sum(
    total: np.ndarray,
    model: Mapping[str, np.ndarray],
    *,
    fednova: bool,
    public_count: int | None = None,
) -> tuple[list[np.ndarray], float]:
    """``(sum of w * delta, sum of w)`` from the decoded sum, tensors by sorted name.

    Under DP the summed weight carries noise (it may even be negative), so the public
    count of survivors (``public_count``) divides instead (uniform weights, ``w = 1``).
    """
    shapes = params_shapes([model[k] for k in sorted(model)])
    extra = [(1,)] if fednova else []
    parts, weight = unpack_weighted(total, [*shapes, *extra])
    if public_count is not None:
        weight = float(public_count)
    if fednova:
        tau_eff = max(float(parts[-1][0]) / weight, 0.0) if weight > 0 else 0.0
        return [p * tau_eff for p in parts[:-1]], weight
    return parts, weight
