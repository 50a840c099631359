"""A hospital's own trainer: a small risk model on the patient table the org bound.

Installed by each hospital's admin as a ``task`` trainer (docs/OPERATIONS.md, "Three
organizations by hand"):

    fedweave trainers install risk-model examples/hospitals/risk_model.py:task

The node never imports this file; its local worker does, for a run whose spec names
``risk-model``, after checking the file's hash. ``task(context)`` reads the CSV the org
bound when it accepted the run (``context.dataset``), takes every numeric column but
the target as a feature, standardises them with its own rows' mean and spread, holds
out a fifth of its rows for ``eval_*`` metrics, and trains a two-layer network. The run
spec's ``config`` may set ``target`` (default ``diagnosis``), ``positive`` (the label
value of the positive class, default ``malignant``) and ``hidden`` (default 16).
"""

from __future__ import annotations

import csv

import numpy as np
import torch
from torch import nn

from org_node.tasks import Task, TaskContext, TaskData, TaskError


def _table(path: str, target: str, positive: str) -> tuple[np.ndarray, np.ndarray]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows or target not in rows[0]:
        raise TaskError(f"the table has no column {target!r}")
    features = sorted(c for c in rows[0] if c != target)
    x = np.array([[float(r[c]) for c in features] for r in rows], dtype=np.float32)
    y = np.array([1 if r[target] == positive else 0 for r in rows], dtype=np.int64)
    return x, y


def task(context: TaskContext) -> Task:
    if context.dataset is None:
        raise TaskError("risk-model needs the patient table bound to the run")
    target = str(context.run_config.get("target", "diagnosis"))
    positive = str(context.run_config.get("positive", "malignant"))
    hidden = int(context.run_config.get("hidden", 16))
    x, y = _table(context.dataset.path, target, positive)
    x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1e-6)
    order = np.random.default_rng(0).permutation(len(y))
    cut = max(1, len(y) // 5)
    held, kept = order[:cut], order[cut:]

    def build_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(x.shape[1], hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def build_data() -> TaskData:
        return TaskData(
            inputs=torch.tensor(x[kept]),
            targets=torch.tensor(y[kept]),
            eval_inputs=torch.tensor(x[held]),
            eval_targets=torch.tensor(y[held]),
            labels=y[kept],
        )

    def metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
        return {"accuracy": float((outputs.argmax(dim=-1) == targets).float().mean())}

    return Task(
        name="risk-model",
        build_model=build_model,
        build_data=build_data,
        loss=nn.functional.cross_entropy,
        metrics=metrics,
    )
