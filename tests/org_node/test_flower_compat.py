"""A plain Flower NumPyClient (and a legacy ClientApp) as an org's local trainer."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
from flwr.client import ClientApp, NumPyClient
from flwr.common import ConfigRecord, Context
from flwr.server.strategy.aggregate import aggregate

from org_node.strategies import FedAvg, pack_weighted, params_shapes, unpack_weighted
from org_node.trainers.flower import (
    EvalOutcome,
    FitOutcome,
    FlowerClientError,
    FlowerContextConfig,
    FlowerTrainer,
    LocalTrainer,
)

TRUE_W = np.array([2.0, -1.0, 0.5])
TRUE_B = 0.3


def _data(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3))
    y = x @ TRUE_W + TRUE_B + rng.normal(scale=0.01, size=n)
    return x, y


class LinearClient(NumPyClient):
    """A Flower client as a team would write it: linear regression by gradient descent."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return [np.zeros(3), np.zeros(1)]

    def fit(
        self, parameters: list[np.ndarray], config: dict[str, Any]
    ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        w, b = parameters[0].copy(), parameters[1].copy()
        lr = float(config.get("lr", 0.1))
        for _ in range(int(config.get("local_steps", 5))):
            err = self.x @ w + b[0] - self.y
            w -= lr * self.x.T @ err / len(self.y)
            b -= lr * np.array([err.mean()])
        return [w, b], len(self.y), {"train_mse": float(np.mean(err**2))}

    def evaluate(
        self, parameters: list[np.ndarray], config: dict[str, Any]
    ) -> tuple[float, int, dict[str, Any]]:
        w, b = parameters
        mse = float(np.mean((self.x @ w + b[0] - self.y) ** 2))
        return mse, len(self.y), {"mse": mse}


def test_numpy_client_fit_returns_delta_weight_and_metrics() -> None:
    x, y = _data(0, 50)
    client = LinearClient(x, y)
    trainer = FlowerTrainer(client)
    assert isinstance(trainer, LocalTrainer)
    init = trainer.get_parameters()
    out = trainer.fit(init, {"lr": 0.1, "local_steps": 3})
    assert isinstance(out, FitOutcome)
    expected_local, n, _ = LinearClient(x, y).fit(init, {"lr": 0.1, "local_steps": 3})
    assert n == 50 and out.num_examples == 50
    for u, loc, g in zip(out.update, expected_local, init, strict=True):
        assert u.dtype == np.float64
        np.testing.assert_allclose(u, loc - g, rtol=0, atol=0)
    assert "train_mse" in out.metrics
    ev = trainer.evaluate(init, {})
    assert isinstance(ev, EvalOutcome)
    assert ev.loss == pytest.approx(float(np.mean(y**2)))
    assert ev.num_examples == 50


def test_federation_of_numpy_clients_through_packed_sum_matches_flower_fedavg() -> None:
    """Three orgs, unequal sizes: the packed secure-sum path equals Flower's aggregate,
    and the model converges to the truth."""
    trainers = [FlowerTrainer(LinearClient(*_data(i, n))) for i, n in enumerate((20, 60, 120))]
    params = trainers[0].get_parameters()
    strategy = FedAvg()
    cfg = {"lr": 0.1, "local_steps": 5}
    for _ in range(30):
        outs = [t.fit(params, cfg) for t in trainers]
        total = np.sum([pack_weighted(o.update, o.num_examples) for o in outs], axis=0)
        summed, weight = unpack_weighted(total, params_shapes(params))
        new = strategy.step(params, summed, weight)
        flower = aggregate(
            [([p + u for p, u in zip(params, o.update, strict=True)], o.num_examples) for o in outs]
        )
        for a, b in zip(new, flower, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
        params = new
    np.testing.assert_allclose(params[0], TRUE_W, atol=0.02)
    assert params[1][0] == pytest.approx(TRUE_B, abs=0.02)
    losses = [t.evaluate(params, {}).loss for t in trainers]
    assert max(losses) < 1e-3


def test_legacy_client_app_with_client_fn_and_context() -> None:
    """A ClientApp(client_fn=...) picks its partition from the Context we build, and
    keeps state in context.state across rounds."""
    parts = {0: _data(10, 40), 1: _data(11, 80)}

    def client_fn(context: Context) -> Any:
        pid = int(str(context.node_config["partition-id"]))
        record = context.state.config_records.setdefault("calls", ConfigRecord({"n": 0}))
        record["n"] = cast(int, record["n"]) + 1
        return LinearClient(*parts[pid]).to_client()

    app = ClientApp(client_fn=client_fn)
    trainer = FlowerTrainer(
        app, FlowerContextConfig(node_id=7, run_id=3, node_config={"partition-id": 1})
    )
    params = [np.zeros(3), np.zeros(1)]
    out = trainer.fit(params, {"lr": 0.05, "local_steps": 4})
    direct = FlowerTrainer(LinearClient(*parts[1])).fit(params, {"lr": 0.05, "local_steps": 4})
    assert out.num_examples == 80
    for a, b in zip(out.update, direct.update, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=0)
    assert out.metrics["train_mse"] == pytest.approx(direct.metrics["train_mse"])
    ev = trainer.evaluate(params, {})
    assert ev.num_examples == 80 and ev.loss == pytest.approx(float(np.mean(parts[1][1] ** 2)))
    assert trainer.context.state.config_records["calls"]["n"] == 2
    with pytest.raises(FlowerClientError, match="initial parameters"):
        trainer.get_parameters()


def test_client_app_failure_is_reported() -> None:
    def client_fn(context: Context) -> Any:
        raise RuntimeError("disk full")

    trainer = FlowerTrainer(ClientApp(client_fn=client_fn))
    with pytest.raises(FlowerClientError, match="disk full"):
        trainer.fit([np.zeros(2)], {})


def test_malformed_client_results_are_refused() -> None:
    class WrongShape(LinearClient):
        def fit(
            self, parameters: list[np.ndarray], config: dict[str, Any]
        ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
            return [np.zeros(4), np.zeros(1)], 10, {}

    class NegativeCount(LinearClient):
        def fit(
            self, parameters: list[np.ndarray], config: dict[str, Any]
        ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
            return parameters, -1, {}

    x, y = _data(0, 10)
    params = [np.zeros(3), np.zeros(1)]
    with pytest.raises(FlowerClientError, match="shape"):
        FlowerTrainer(WrongShape(x, y)).fit(params, {})
    with pytest.raises(FlowerClientError, match="num_examples"):
        FlowerTrainer(NegativeCount(x, y)).fit(params, {})
    with pytest.raises(TypeError, match="NumPyClient"):
        FlowerTrainer(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="node_id"):
        FlowerContextConfig(node_id=-1)


def test_client_object_path() -> None:
    """A NumPyClient converted with to_client() goes through Flower's Client path."""
    x, y = _data(5, 30)
    params = [np.ones(3), np.zeros(1)]
    via_client = FlowerTrainer(LinearClient(x, y).to_client()).fit(params, {"local_steps": 2})
    direct = FlowerTrainer(LinearClient(x, y)).fit(params, {"local_steps": 2})
    assert via_client.num_examples == direct.num_examples == 30
    for a, b in zip(via_client.update, direct.update, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=0)
    init = FlowerTrainer(LinearClient(x, y).to_client()).get_parameters()
    assert [p.shape for p in init] == [(3,), (1,)]
