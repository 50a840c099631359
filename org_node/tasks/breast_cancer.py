"""Breast-cancer MLP: the hospital demo (bundled as ``breast_cancer``).

scikit-learn's Wisconsin diagnostic breast-cancer data (569 patients, 30 features,
malignant or benign). Features are standardized with the training split's mean and
standard deviation; the split (80/20, stratified) is fixed, so every organization holds
the same held-out set and partitions only the training split.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import train_test_split
from torch import nn

from org_node.tasks import Task, TaskData

__all__ = ["TabularMLP", "accuracy_metrics", "build_data", "task"]

NUM_FEATURES = 30
NUM_CLASSES = 2
SPLIT_SEED = 0


class TabularMLP(nn.Module):
    """30 -> hidden -> hidden -> 2, ReLU."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(NUM_FEATURES, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return TabularMLP()


@cache
def build_data() -> TaskData:
    x, y = load_breast_cancer(return_X_y=True)
    x_tr, x_ev, y_tr, y_ev = train_test_split(
        x, y, test_size=0.2, random_state=SPLIT_SEED, stratify=y
    )
    mean = x_tr.mean(axis=0)
    std = x_tr.std(axis=0) + 1e-8
    return TaskData(
        inputs=torch.tensor((x_tr - mean) / std, dtype=torch.float32),
        targets=torch.tensor(y_tr, dtype=torch.long),
        eval_inputs=torch.tensor((x_ev - mean) / std, dtype=torch.float32),
        eval_targets=torch.tensor(y_ev, dtype=torch.long),
        labels=np.asarray(y_tr, dtype=np.int64),
    )


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs, targets)


def accuracy_metrics(outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Top-1 accuracy of class logits."""
    return {"accuracy": float((outputs.argmax(dim=-1) == targets).float().mean())}


def task() -> Task:
    return Task(
        name="breast_cancer",
        build_model=build_model,
        build_data=build_data,
        loss=cross_entropy,
        metrics=accuracy_metrics,
    )
