"""Flower client code, written as Flower's docs teach it, run unchanged as an org's trainer.

The apps are written into a temporary directory: a Message-API Flower App in the style of
Flower 1.42's quickstart-pytorch (``ClientApp()`` with ``@app.train()`` /
``@app.evaluate()``, a ``ServerApp`` whose ``@app.main()`` starts ``FedAvg``), a legacy
``ClientApp(client_fn=...)`` around a ``NumPyClient``, and the same client with a legacy
``ServerApp(server_fn=...)``. The refusals use small apps built in the tests.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from org_node.trainers.base import TrainerError, TrainerRef, TrainRequest, WorkerSpec
from org_node.trainers.flower import FlowerContextConfig, FlowerExecutor, flower_ids

pytestmark = pytest.mark.usefixtures("restore_rng")  # tests/org_node/conftest.py

QUICK_PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fwquick"
version = "1.0.0"
dependencies = ["flwr[simulation]>=1.42.0", "torch>=2.4"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedweave-tests"

[tool.flwr.app.components]
serverapp = "fwquick.server_app:app"
clientapp = "fwquick.client_app:app"

[tool.flwr.app.config]
num-server-rounds = 3
fraction-evaluate = 0.5
local-epochs = 1
learning-rate = 0.1
batch-size = 32
"""

QUICK_TASK = '''\
"""fwquick: a small PyTorch task (synthetic data, no downloads)."""

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(240, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64)
    part = np.array_split(np.arange(len(x)), num_partitions)[partition_id]
    cut = int(0.8 * len(part))

    def dataset(idx):
        return TensorDataset(torch.from_numpy(x[idx]), torch.from_numpy(y[idx]))

    trainloader = DataLoader(dataset(part[:cut]), batch_size=batch_size, shuffle=True)
    testloader = DataLoader(dataset(part[cut:]), batch_size=batch_size)
    return trainloader, testloader


def train(net, trainloader, epochs, lr, device):
    net.to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for x, y in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(net, testloader, device):
    net.to(device)
    criterion = nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    net.eval()
    with torch.no_grad():
        for x, y in testloader:
            outputs = net(x.to(device))
            loss += criterion(outputs, y.to(device)).item()
            correct += (torch.max(outputs.data, 1)[1] == y.to(device)).sum().item()
    return loss / len(testloader), correct / len(testloader.dataset)
'''

QUICK_CLIENT = '''\
"""fwquick: A Flower / PyTorch app."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fwquick.task import Net, load_data
from fwquick.task import test as test_fn
from fwquick.task import train as train_fn

# Flower ClientApp
app = ClientApp()


@app.train()
def train(msg: Message, context: Context):
    """Train the model on local data."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cpu")

    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    batch_size = context.run_config["batch-size"]
    trainloader, _ = load_data(partition_id, num_partitions, batch_size)

    lr = msg.content["config"]["lr"]
    epochs = context.run_config["local-epochs"]
    train_loss = train_fn(model, trainloader, epochs, lr, device)

    # Stateful client: count the rounds this node trained
    if "history" not in context.state:
        context.state["history"] = MetricRecord({"rounds": 0})
    context.state["history"]["rounds"] += 1

    model_record = ArrayRecord(model.state_dict())
    metrics = {
        "train_loss": train_loss,
        "num-examples": len(trainloader.dataset),
        "lr": lr,
        "epochs": epochs,
        "partition": partition_id,
        "rounds": context.state["history"]["rounds"],
    }
    content = RecordDict({"arrays": model_record, "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context):
    """Evaluate the model on local data."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cpu")

    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    batch_size = context.run_config["batch-size"]
    _, valloader = load_data(partition_id, num_partitions, batch_size)

    eval_loss, eval_acc = test_fn(model, valloader, device)
    metrics = {
        "eval_loss": eval_loss,
        "eval_acc": eval_acc,
        "num-examples": len(valloader.dataset),
    }
    content = RecordDict({"metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)
'''

QUICK_SERVER = '''\
"""fwquick: A Flower / PyTorch app."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fwquick.task import Net

GLOBAL_EVALUATIONS = []

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    fraction_evaluate = context.run_config["fraction-evaluate"]
    num_rounds = context.run_config["num-server-rounds"]
    lr = context.run_config["learning-rate"]

    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    strategy = FedAvg(fraction_evaluate=fraction_evaluate)
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
        evaluate_fn=global_evaluate,
    )
    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Centralized evaluation (here: the norm of the model)."""
    GLOBAL_EVALUATIONS.append(server_round)
    state = arrays.to_torch_state_dict()
    return MetricRecord({"norm": float(sum(v.float().norm() for v in state.values()))})
'''

LEGACY_CLIENT = '''\
"""A legacy Flower client: a NumPyClient returned by client_fn."""

import numpy as np
from flwr.client import ClientApp, NumPyClient
from flwr.common import Context


def load_data(partition_id: int):
    rng = np.random.default_rng(100 + partition_id)
    x = rng.normal(size=(30 + 10 * partition_id, 4))
    y = x @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.7
    return x, y


class FlowerClient(NumPyClient):
    def __init__(self, x, y, local_epochs):
        self.x, self.y, self.local_epochs = x, y, local_epochs

    def get_parameters(self, config):
        return [np.random.normal(size=4), np.zeros(1), np.zeros((), dtype=np.int64)]

    def fit(self, parameters, config):
        w, b, steps = parameters[0].copy(), parameters[1].copy(), parameters[2]
        lr = float(config.get("lr", 0.1))
        for _ in range(self.local_epochs):
            err = self.x @ w + b[0] - self.y
            w -= lr * self.x.T @ err / len(self.y)
            b -= lr * np.array([err.mean()])
            steps = steps + 1
        mse = float(np.mean((self.x @ w + b[0] - self.y) ** 2))
        metrics = {"mse": mse, "lr": lr, "server_round": config["server-round"]}
        return [w, b, steps], len(self.y), metrics

    def evaluate(self, parameters, config):
        w, b = parameters[0], parameters[1]
        mse = float(np.mean((self.x @ w + b[0] - self.y) ** 2))
        return mse, len(self.y), {"mse": mse}


def client_fn(context: Context):
    partition_id = context.node_config["partition-id"]
    x, y = load_data(partition_id)
    return FlowerClient(x, y, context.run_config["local-epochs"]).to_client()


app = ClientApp(client_fn=client_fn)
'''

LEGACY_SERVER = """

from flwr.common import ndarrays_to_parameters
from flwr.server import ServerAppComponents, ServerConfig
from flwr.server import ServerApp
from flwr.server.strategy import FedAvg

INITIAL = [np.full(4, 0.5), np.full(1, -0.25), np.array(2, dtype=np.int64)]


def fit_config(server_round: int):
    return {"lr": 0.01 * server_round}


def server_fn(context: Context):
    strategy = FedAvg(
        initial_parameters=ndarrays_to_parameters(INITIAL),
        on_fit_config_fn=fit_config,
    )
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=3))


server_app = ServerApp(server_fn=server_fn)
"""

MESSAGE_CLIENT_ONLY = """\
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context):
    return Message(msg.content, reply_to=msg)
"""

MESSAGE_SINGLE_FILE = """\
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ClientApp()


@app.train()
def train(msg: Message, context: Context):
    lr = msg.content["config"]["lr"]
    arrays = [a - lr for a in msg.content["arrays"].to_numpy_ndarrays()]
    metrics = MetricRecord({"num-examples": 4})
    return Message(RecordDict({"arrays": ArrayRecord(arrays), "metrics": metrics}), reply_to=msg)


server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    initial = ArrayRecord([np.random.normal(size=(2, 2)), np.zeros(3)])
    strategy = FedAvg(fraction_evaluate=0.0)
    strategy.start(grid=grid, initial_arrays=initial, train_config=ConfigRecord({"lr": 0.5}))
"""


@pytest.fixture(scope="module")
def apps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("flower_apps")
    quick = root / "quickstart"
    (quick / "fwquick").mkdir(parents=True)
    (quick / "pyproject.toml").write_text(QUICK_PYPROJECT)
    (quick / "fwquick" / "__init__.py").write_text('"""fwquick."""\n')
    (quick / "fwquick" / "task.py").write_text(QUICK_TASK)
    (quick / "fwquick" / "client_app.py").write_text(QUICK_CLIENT)
    (quick / "fwquick" / "server_app.py").write_text(QUICK_SERVER)
    files = root / "files"
    files.mkdir()
    (files / "fw_legacy_client.py").write_text(LEGACY_CLIENT)
    (files / "fw_legacy_app.py").write_text(LEGACY_CLIENT + LEGACY_SERVER)
    (files / "fw_message_only.py").write_text(MESSAGE_CLIENT_ONLY)
    (files / "fw_message_single.py").write_text(MESSAGE_SINGLE_FILE)
    return {
        "quick": quick,
        "legacy_client": files / "fw_legacy_client.py",
        "legacy_app": files / "fw_legacy_app.py",
        "message_only": files / "fw_message_only.py",
        "message_single": files / "fw_message_single.py",
    }


def _spec(
    kind: str,
    ref: str,
    org: str = "org-a",
    *,
    partition: int = 0,
    run_config: dict[str, Any] | None = None,
    seed: int = 7,
    job: dict[str, Any] | None = None,
) -> WorkerSpec:
    return WorkerSpec(
        session="s1",
        node_pid=1,
        org_id=org,
        run_key="run-1",
        trainer=TrainerRef("t", kind, ref, "0" * 64),
        run_config=run_config or {},
        node_config={"partition-id": partition, "num-partitions": 2},
        job=job or {},
        model_seed=seed,
        participants=2,
    )


def _quick(apps: dict[str, Path], org: str = "org-a", **kw: Any) -> FlowerExecutor:
    return FlowerExecutor.from_spec(_spec("flower-app", str(apps["quick"]), org, **kw))


def _apply(model: dict[str, np.ndarray], update: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.asarray(model[k] + update[k]) for k in model}


# ------------------------------------------------------------ Message-API Flower App


def test_quickstart_initial_model_is_the_serverapps_and_the_same_at_every_org(
    apps: dict[str, Path],
) -> None:
    a = _quick(apps, "org-a", partition=0).initial_model()
    b = _quick(apps, "org-b", partition=1).initial_model()
    net_module = sys.modules["fwquick.task"]
    torch.manual_seed(7)
    expected = net_module.Net().state_dict()
    assert list(a) == list(expected)  # the state_dict's names, in its order
    for name, tensor in expected.items():
        assert a[name].dtype == np.float32 and b[name].dtype == np.float32
        np.testing.assert_array_equal(a[name], b[name])
        np.testing.assert_array_equal(a[name], tensor.numpy().astype(np.float32))
    other = _quick(apps, "org-a", seed=8).initial_model()
    assert not np.array_equal(other["fc1.weight"], a["fc1.weight"])
    # the strategy ran as under Flower up to round 1: evaluate_fn saw round 0
    assert 0 in sys.modules["fwquick.server_app"].GLOBAL_EVALUATIONS


def test_quickstart_context_has_the_orgs_node_config_and_the_apps_run_config(
    apps: dict[str, Path],
) -> None:
    a = _quick(apps, "org-a", partition=1, run_config={"learning-rate": 0.05})
    b = _quick(apps, "org-b")
    assert a.context.node_config == {"partition-id": 1, "num-partitions": 2}
    assert a.context.run_config == {
        "num-server-rounds": 3,
        "fraction-evaluate": 0.5,
        "local-epochs": 1,
        "learning-rate": 0.05,
        "batch-size": 32,
    }
    assert (a.context.node_id, a.context.run_id) == flower_ids("org-a", "run-1")
    assert a.context.node_id != b.context.node_id and a.context.run_id == b.context.run_id


def test_quickstart_rounds_train_config_weight_update_state_and_evaluation(
    apps: dict[str, Path],
) -> None:
    ex = _quick(apps, "org-b", partition=1, run_config={"learning-rate": 0.05})
    model = ex.initial_model()
    first = ex.train(model, TrainRequest(round=0))
    assert first.num_examples == 96  # 80% of the 120 examples of partition 1
    assert first.steps == 1 and first.losses == []
    m = first.metrics
    assert m["train_lr"] == pytest.approx(0.05)  # the ServerApp's train config (run config)
    assert m["train_partition"] == 1.0 and m["train_epochs"] == 1.0
    assert m["train_rounds"] == 1.0 and math.isfinite(m["train_loss"])
    assert "train_num-examples" not in m and "eval_num-examples" not in m
    assert set(first.update) == set(model)
    assert all(u.dtype == np.float32 for u in first.update.values())
    # BatchNorm's int64 counter went to the client as an int and came back: 3 batches
    assert first.update["bn.num_batches_tracked"] == 3.0
    assert float(np.abs(first.update["fc1.weight"]).max()) > 0
    # the evaluation is of the trained model, not the global one
    trained = _apply(model, first.update)
    net = sys.modules["fwquick.task"].Net()
    net.load_state_dict({k: torch.from_numpy(v) for k, v in trained.items()}, strict=True)
    _, valloader = sys.modules["fwquick.task"].load_data(1, 2, 32)
    loss, acc = sys.modules["fwquick.task"].test(net, valloader, torch.device("cpu"))
    assert m["eval_loss"] == pytest.approx(loss, rel=1e-4)
    assert m["eval_acc"] == pytest.approx(acc)

    second = ex.train(trained, TrainRequest(round=1))
    assert second.metrics["train_rounds"] == 2.0  # context.state persisted
    assert ex.context.state["history"]["rounds"] == 2
    assert second.update["bn.num_batches_tracked"] == 3.0


def test_evaluate_false_skips_the_evaluation(apps: dict[str, Path]) -> None:
    ex = _quick(apps, job={"evaluate": False})
    out = ex.train(ex.initial_model(), TrainRequest(round=0))
    assert "train_loss" in out.metrics
    assert not [k for k in out.metrics if k.startswith("eval_")]


def test_message_api_clientapp_without_serverapp_is_refused(apps: dict[str, Path]) -> None:
    ex = FlowerExecutor.from_spec(_spec("flower-clientapp", f"{apps['message_only']}:app"))
    with pytest.raises(TrainerError, match="gets its initial model from the app's ServerApp"):
        ex.initial_model()


def test_a_serverapp_in_the_clientapps_module_gives_the_initial_model(
    apps: dict[str, Path],
) -> None:
    ex = FlowerExecutor.from_spec(_spec("flower-clientapp", f"{apps['message_single']}:app"))
    model = ex.initial_model()
    assert list(model) == ["0", "1"]  # the ArrayRecord's own keys
    np.random.seed(7)
    np.testing.assert_array_equal(model["0"], np.random.normal(size=(2, 2)).astype(np.float32))
    out = ex.train(model, TrainRequest(round=0))
    assert out.num_examples == 4 and out.metrics == {}  # no evaluate function registered
    for name in model:
        np.testing.assert_allclose(out.update[name], np.full(model[name].shape, -0.5))


# ------------------------------------------------------------------ legacy Flower


def test_legacy_client_fn_initial_model_from_get_parameters(apps: dict[str, Path]) -> None:
    ref, cfg = f"{apps['legacy_client']}:app", {"local-epochs": 1}
    ex_a = FlowerExecutor.from_spec(_spec("flower-clientapp", ref, run_config=cfg))
    ex_b = FlowerExecutor.from_spec(
        _spec("flower-clientapp", ref, "b", partition=1, run_config=cfg)
    )
    a, b_model = ex_a.initial_model(), ex_b.initial_model()  # each seeds the RNGs first
    assert list(a) == ["p00000", "p00001", "p00002"]
    for name in a:
        assert a[name].dtype == np.float32
        np.testing.assert_array_equal(a[name], b_model[name])
    np.random.seed(7)
    np.testing.assert_array_equal(a["p00000"], np.random.normal(size=4).astype(np.float32))
    assert a["p00002"].shape == () and a["p00002"] == 0.0


def test_legacy_client_fn_round_update_is_trained_minus_global(apps: dict[str, Path]) -> None:
    ref = f"{apps['legacy_client']}:app"
    ex = FlowerExecutor.from_spec(
        _spec("flower-clientapp", ref, partition=1, run_config={"local-epochs": 5})
    )
    model = ex.initial_model()
    model["p00002"] = np.asarray(2.4, dtype=np.float32)  # an averaged int counter
    out = ex.train(model, TrainRequest(round=2, options={"lr": 0.05, "skip": [1]}))
    module = sys.modules["fw_legacy_client"]
    x, y = module.load_data(1)
    sent = [model["p00000"].astype(np.float64), model["p00001"].astype(np.float64)]
    sent.append(np.array(2, dtype=np.int64))
    local, n, _ = module.FlowerClient(x, y, 5).fit(sent, {"lr": 0.05, "server-round": 3})
    assert out.num_examples == n == 40
    for i, name in enumerate(["p00000", "p00001", "p00002"]):
        expected = (np.asarray(local[i], np.float64) - model[name].astype(np.float64)).astype(
            np.float32
        )
        np.testing.assert_array_equal(out.update[name], expected)
    assert out.update["p00002"] == pytest.approx(7 - 2.4)  # rint(2.4) + 5 steps - 2.4
    assert out.metrics["train_lr"] == 0.05  # a scalar strategy option reached fit
    assert out.metrics["train_server_round"] == 3.0
    # evaluated on the trained model: the client's own mse of its local parameters
    assert out.metrics["eval_loss"] == pytest.approx(out.metrics["eval_mse"])
    assert out.metrics["eval_mse"] == pytest.approx(out.metrics["train_mse"])


def test_legacy_serverapp_initial_parameters_and_on_fit_config_fn(apps: dict[str, Path]) -> None:
    ref = f"{apps['legacy_app']}:app"
    ex = FlowerExecutor.from_spec(_spec("flower-clientapp", ref, run_config={"local-epochs": 1}))
    model = ex.initial_model()
    initial = sys.modules["fw_legacy_app"].INITIAL
    assert list(model) == ["p00000", "p00001", "p00002"]
    for name, arr in zip(model, initial, strict=True):
        np.testing.assert_array_equal(model[name], arr.astype(np.float32))
    first = ex.train(model, TrainRequest(round=0))
    assert first.metrics["train_lr"] == pytest.approx(0.01)  # on_fit_config_fn(1)
    assert first.update["p00002"] == 1.0
    second = ex.train(_apply(model, first.update), TrainRequest(round=1))
    assert second.metrics["train_lr"] == pytest.approx(0.02)  # on_fit_config_fn(2)
    assert second.metrics["train_server_round"] == 2.0


# ------------------------------------------------------------- apps built in tests

INITIAL = {"w": np.arange(6, dtype=np.float64).reshape(2, 3), "steps": np.array(4, np.int64)}


def _server_app(initial: dict[str, np.ndarray] = INITIAL) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        arrays = ArrayRecord({k: Array(v) for k, v in initial.items()})
        FedAvg().start(grid=grid, initial_arrays=arrays, train_config=ConfigRecord({"lr": 0.5}))

    return app


Reply = Callable[[dict[str, np.ndarray]], tuple[dict[str, np.ndarray], dict[str, Any]]]


def _client_app(reply: Reply, seen: list[Message] | None = None) -> ClientApp:
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if seen is not None:
            seen.append(msg)
        received = msg.content.array_records["arrays"]
        arrays, metrics = reply({k: a.numpy() for k, a in received.items()})
        record = ArrayRecord({k: Array(v) for k, v in arrays.items()})
        content = RecordDict({"arrays": record, "metrics": MetricRecord(metrics)})
        return Message(content, reply_to=msg)

    return app


def _executor(client: Any, server: ServerApp | None = None, **kw: Any) -> FlowerExecutor:
    context = FlowerContextConfig(node_id=5, run_id=9, node_config={"partition-id": 0})
    return FlowerExecutor(client, server or _server_app(), context=context, participants=2, **kw)


def _global() -> dict[str, np.ndarray]:
    return {"w": np.full((2, 3), 0.25, np.float32), "steps": np.asarray(4.6, np.float32)}


def test_arrays_go_back_in_their_dtypes_and_the_update_is_local_minus_global() -> None:
    seen: list[Message] = []

    def double(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        doubled = {"w": arrays["w"] * 2, "steps": np.asarray(arrays["steps"] + 1)}
        return doubled, {"num-examples": 12}

    ex = _executor(_client_app(double, seen))
    model = ex.initial_model()
    assert model["steps"].dtype == np.float32 and model["steps"] == 4.0
    out = ex.train(_global(), TrainRequest(round=4, options={"prox_mu": 0.1, "skip": [1]}))
    got = seen[0].content.array_records["arrays"]
    assert got["w"].dtype == "float64" and got["steps"].dtype == "int64"
    assert int(got["steps"].numpy()) == 5  # 4.6 rounded, not truncated
    config = dict(seen[0].content.config_records["config"])
    assert config == {"lr": 0.5, "prox_mu": 0.1, "server-round": 5}
    assert seen[0].metadata.message_type == "train" and seen[0].metadata.dst_node_id == 5
    assert out.num_examples == 12 and out.metrics == {}
    np.testing.assert_array_equal(out.update["w"], np.full((2, 3), 0.25, np.float32))
    assert out.update["steps"] == pytest.approx(6 - 4.6)


def _refusal(reply: Reply) -> str:
    ex = _executor(_client_app(reply))
    ex.initial_model()
    with pytest.raises(TrainerError) as info:
        ex.train(_global(), TrainRequest(round=0))
    message = str(info.value)
    assert "\n" not in message
    return message


OK_METRICS = {"num-examples": 3}


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        (lambda a: ({"w": np.zeros((3, 2)), "steps": a["steps"]}, OK_METRICS), r"'w'.*shape"),
        (lambda a: ({"w": a["w"] * np.nan, "steps": a["steps"]}, OK_METRICS), r"'w'.*NaN"),
        (lambda a: ({"w": a["w"] + 1j, "steps": a["steps"]}, OK_METRICS), r"'w'.*complex128"),
        (lambda a: ({"w": a["w"] > 0, "steps": a["steps"]}, OK_METRICS), r"'w'.*dtype bool"),
        (lambda a: ({"w": a["w"]}, OK_METRICS), r"lacks array 'steps'"),
        (lambda a: ({**a, "extra": a["w"]}, OK_METRICS), r"lacks: 'extra'"),
        (lambda a: (a, {"train_loss": 0.5}), r"no 'num-examples'"),
        (lambda a: (a, {"num-examples": 0}), r"'num-examples' must be an int >= 1"),
        (lambda a: (a, {"num-examples": 2.5}), r"'num-examples' must be an int >= 1"),
    ],
)
def test_malformed_replies_are_refused_with_a_readable_reason(reply: Reply, expected: str) -> None:
    assert re.search(expected, _refusal(reply))


def test_the_clients_exception_and_error_reply_are_trainer_errors() -> None:
    def boom(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        raise RuntimeError("disk full\nsecond line")

    assert _refusal(boom) == "RuntimeError: disk full"

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return Message(Error(code=0, reason="out of memory"), reply_to=msg)

    ex = _executor(app)
    ex.initial_model()
    with pytest.raises(TrainerError, match="replied with an error: out of memory"):
        ex.train(_global(), TrainRequest(round=0))


def test_an_evaluation_failure_is_a_trainer_error() -> None:
    app = _client_app(lambda a: (a, {"num-examples": 1}))

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        raise ValueError("no validation split")

    ex = _executor(app)
    ex.initial_model()
    with pytest.raises(TrainerError, match="ValueError: no validation split"):
        ex.train(_global(), TrainRequest(round=0))
    quiet = _executor(app, evaluate=False)
    quiet.initial_model()
    assert quiet.train(_global(), TrainRequest(round=0)).metrics == {}


class _WrongShapeClient(NumPyClient):
    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return [np.zeros(3)]

    def fit(
        self, parameters: list[np.ndarray], config: dict[str, Any]
    ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
        return [np.zeros(4)], 10, {}


def test_legacy_numpy_client_refusals() -> None:
    ex = FlowerExecutor(_WrongShapeClient())
    model = ex.initial_model()
    with pytest.raises(TrainerError, match=r"'p00000' has shape \(4,\), the model \(3,\)"):
        ex.train(model, TrainRequest(round=0))
    with pytest.raises(TrainerError, match="not a Flower ClientApp"):
        FlowerExecutor(object())  # type: ignore[arg-type]


def test_a_serverapp_waiting_for_more_nodes_than_participants_is_refused() -> None:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        while len(list(grid.get_node_ids())) < 3:
            pass

    with pytest.raises(TrainerError, match="waiting for more nodes than the run's 2"):
        _executor(_client_app(lambda a: (a, OK_METRICS)), app).initial_model()
