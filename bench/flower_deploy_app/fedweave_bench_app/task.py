"""fedweave_bench_app: the model, one partition's data, and local training (NumPy only).

The model is one linear layer ``y = x @ W + b`` with ``input-dim`` inputs and as many
outputs as make ``model-params`` parameters (``W`` and ``b``, float32). Partition ``i``
holds ``samples`` synthetic rows drawn from a seed of its own, with targets from a
fixed low-rank teacher, so every runtime that gives a node the same ``partition-id``
trains it on the same data. Local training is ``local-steps`` steps of minibatch SGD on
the mean squared error, the batches seeded by the partition and the round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

Arrays = list[np.ndarray]
TEACHER_RANK = 4


def outputs(params: int, input_dim: int) -> int:
    """Outputs of the layer that holds (about) ``params`` parameters."""
    return max(1, params // (input_dim + 1))


def initial_model(params: int, input_dim: int, seed: int = 0) -> Arrays:
    """``[W, b]``: small random weights, zero bias (float32)."""
    rng = np.random.default_rng(seed)
    k = outputs(params, input_dim)
    weights = (rng.standard_normal((input_dim, k), dtype=np.float32) * 0.01).astype(np.float32)
    return [weights, np.zeros(k, dtype=np.float32)]


def partition(partition_id: int, input_dim: int, k: int, samples: int) -> tuple[np.ndarray, ...]:
    """The rows ``(x, y)`` of one partition."""
    teacher = np.random.default_rng(7)
    a = teacher.standard_normal((input_dim, TEACHER_RANK), dtype=np.float32)
    b = teacher.standard_normal((TEACHER_RANK, k), dtype=np.float32) * 0.1
    rng = np.random.default_rng(1000 + partition_id)
    x = rng.standard_normal((samples, input_dim), dtype=np.float32)
    y = (x @ a) @ b + 0.01 * rng.standard_normal((samples, k), dtype=np.float32)
    return x, y


def train(model: Arrays, config: Mapping[str, Any], partition_id: int, rnd: int) -> float:
    """Train ``model`` in place on the partition; the mean loss of the steps."""
    weights, bias = model
    input_dim, k = weights.shape
    x, y = partition(partition_id, input_dim, k, int(config["samples"]))
    steps, batch = int(config["local-steps"]), int(config["batch-size"])
    lr = np.float32(config["learning-rate"])
    rng = np.random.default_rng(1000 * partition_id + rnd)
    losses = []
    for _ in range(steps):
        idx = rng.choice(len(x), size=min(batch, len(x)), replace=False)
        xb, yb = x[idx], y[idx]
        err = xb @ weights + bias - yb
        losses.append(float(np.mean(err * err)))
        grad = err * (2.0 / len(idx))
        weights -= lr * (xb.T @ grad)
        bias -= lr * grad.sum(axis=0)
    return float(np.mean(losses)) if losses else 0.0
