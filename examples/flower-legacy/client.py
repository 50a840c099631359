"""A legacy Flower client (``NumPyClient`` behind ``client_fn``), as Flower's older
quickstarts wrote it: logistic regression on scikit-learn's breast-cancer data.

Flower's legacy server asks one client for the initial parameters; fedweave asks each
org's client, after seeding every random generator with the run's model seed, so that
every org starts from the same model.
"""

from __future__ import annotations

import numpy as np
from flwr.client import ClientApp, NumPyClient
from flwr.common import Context
from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import train_test_split


def load_data(partition_id: int, num_partitions: int):
    x, y = load_breast_cancer(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0) + 1e-8
    x_tr, x_te = (x_tr - mean) / std, (x_te - mean) / std
    part = np.array_split(np.random.default_rng(7).permutation(len(y_tr)), num_partitions)
    idx = part[partition_id]
    return x_tr[idx], y_tr[idx], x_te, y_te


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


class LogisticClient(NumPyClient):
    def __init__(self, x, y, x_test, y_test, steps: int, lr: float) -> None:
        self.x, self.y, self.x_test, self.y_test = x, y, x_test, y_test
        self.steps, self.lr = steps, lr
        self.w = np.random.normal(0.0, 0.01, size=x.shape[1])
        self.b = np.zeros(1)

    def get_parameters(self, config):
        return [self.w, self.b]

    def fit(self, parameters, config):
        w, b = (np.array(p, dtype=np.float64) for p in parameters)
        for _ in range(self.steps):
            p = _sigmoid(self.x @ w + b[0])
            grad = p - self.y
            w -= self.lr * self.x.T @ grad / len(self.y)
            b -= self.lr * np.array([grad.mean()])
        loss = float(-np.mean(self.y * np.log(p + 1e-12) + (1 - self.y) * np.log(1 - p + 1e-12)))
        return [w, b], len(self.y), {"loss": loss}

    def evaluate(self, parameters, config):
        w, b = parameters
        p = _sigmoid(self.x_test @ w + b[0])
        loss = float(
            -np.mean(self.y_test * np.log(p + 1e-12) + (1 - self.y_test) * np.log(1 - p + 1e-12))
        )
        accuracy = float(np.mean((p > 0.5) == self.y_test))
        return loss, len(self.y_test), {"accuracy": accuracy}


def client_fn(context: Context):
    partition_id = int(context.node_config["partition-id"])
    num_partitions = int(context.node_config["num-partitions"])
    x, y, x_test, y_test = load_data(partition_id, num_partitions)
    return LogisticClient(x, y, x_test, y_test, steps=20, lr=0.5).to_client()


app = ClientApp(client_fn=client_fn)
