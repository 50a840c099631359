"""A small CNN on scikit-learn's 8x8 handwritten digits (1797 images, 10 classes).

Pixels (0..16) are scaled to [0, 1]; the 80/20 stratified split is fixed so every
organization shares the held-out set.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from org_node.tasks import Task, TaskData
from org_node.tasks.breast_cancer import accuracy_metrics, cross_entropy

__all__ = ["DigitsCNN", "build_data", "task"]

SPLIT_SEED = 0


class DigitsCNN(nn.Module):
    """conv(1->8) -> conv(8->16) -> maxpool -> linear(256->10); input (N, 1, 8, 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))  # type: ignore[no-any-return]


def build_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return DigitsCNN()


@cache
def build_data() -> TaskData:
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).reshape(-1, 1, 8, 8)
    x_tr, x_ev, y_tr, y_ev = train_test_split(
        x, y, test_size=0.2, random_state=SPLIT_SEED, stratify=y
    )
    return TaskData(
        inputs=torch.tensor(x_tr, dtype=torch.float32),
        targets=torch.tensor(y_tr, dtype=torch.long),
        eval_inputs=torch.tensor(x_ev, dtype=torch.float32),
        eval_targets=torch.tensor(y_ev, dtype=torch.long),
        labels=np.asarray(y_tr, dtype=np.int64),
    )


def task() -> Task:
    return Task(
        name="digits",
        build_model=build_model,
        build_data=build_data,
        loss=cross_entropy,
        metrics=accuracy_metrics,
    )
