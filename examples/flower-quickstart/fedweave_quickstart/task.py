"""fedweave_quickstart: the model, the data of one partition, and training and testing.

The data is scikit-learn's 8x8 handwritten digits (no download); partition ``i`` of
``n`` is a fixed random share of the training split, the test split is the same for
every partition. Shuffling is seeded by the partition and the round, so a run is
reproducible.
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    """64 pixels -> 64 hidden units -> 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def load_data(
    partition_id: int, num_partitions: int, batch_size: int, seed: int = 0
) -> tuple[DataLoader, DataLoader]:
    """The train loader of one partition and the shared test loader."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    share = np.array_split(np.random.default_rng(42).permutation(len(y_tr)), num_partitions)
    idx = share[partition_id]
    train = TensorDataset(torch.from_numpy(x_tr[idx]), torch.from_numpy(y_tr[idx]))
    test = TensorDataset(torch.from_numpy(x_te), torch.from_numpy(y_te))
    shuffle = torch.Generator().manual_seed(1000 * partition_id + seed)
    return (
        DataLoader(train, batch_size=batch_size, shuffle=True, generator=shuffle),
        DataLoader(test, batch_size=256),
    )


def train(net: Net, loader: DataLoader, epochs: int, lr: float, device: torch.device) -> float:
    """SGD over ``loader`` for ``epochs``; the mean training loss."""
    net.to(device).train()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    total, batches = 0.0, 0
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(net(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
    return total / max(batches, 1)


def test(net: Net, loader: DataLoader, device: torch.device) -> tuple[float, float]:
    """Loss and accuracy of ``net`` on ``loader``."""
    net.to(device).eval()
    loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            out = net(x.to(device))
            loss += float(nn.functional.cross_entropy(out, y.to(device), reduction="sum"))
            correct += int((out.argmax(1) == y.to(device)).sum())
            count += len(y)
    return loss / count, correct / count
