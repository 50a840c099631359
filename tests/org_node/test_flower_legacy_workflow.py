"""A ServerApp that runs a legacy ``DefaultWorkflow`` with Flower's ``SecAggPlusWorkflow``,
run unchanged as an org's trainer: its initial model is taken from the workflow's state,
and the workflow's node-polling thread ends quietly once the model is taken."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from flwr.app import Context
from flwr.client import NumPyClient
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from org_node.trainers.base import TrainRequest
from org_node.trainers.flower import FlowerContextConfig, FlowerExecutor

pytestmark = pytest.mark.usefixtures("restore_rng")  # tests/org_node/conftest.py

INITIAL = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(3, np.float32)]
POLLER = "(_update_client_manager)"  # the name of Flower's node-polling thread ends so


def _secaggplus_server() -> ServerApp:
    from flwr.common import ndarrays_to_parameters
    from flwr.server import ServerConfig
    from flwr.server.compat import LegacyContext
    from flwr.server.strategy import FedAvg as LegacyFedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = LegacyFedAvg(
            min_fit_clients=2,
            min_available_clients=2,
            initial_parameters=ndarrays_to_parameters(INITIAL),
        )
        legacy = LegacyContext(context, ServerConfig(num_rounds=2), strategy)
        workflow = SecAggPlusWorkflow(num_shares=1.0, reconstruction_threshold=2)
        DefaultWorkflow(fit_workflow=workflow)(grid, legacy)

    return server


class _Plus(NumPyClient):
    def fit(self, parameters: Any, config: Any) -> Any:
        return [p + 1.0 for p in parameters], 5, {}


def _executor() -> FlowerExecutor:
    client = ClientApp(client_fn=lambda context: _Plus().to_client())
    context = FlowerContextConfig(node_id=5, run_id=9, node_config={"partition-id": 0})
    return FlowerExecutor(client, _secaggplus_server(), context=context, participants=2)


def test_a_secaggplus_workflow_serverapp_gives_its_initial_model() -> None:
    """SecAggPlusWorkflow's first train message is its setup stage, with no model: the
    model is the one its DefaultWorkflow keeps in the context's state. Under fedweave
    the orgs' masked sum replaces SecAgg+, so the client trains on plain messages."""
    ex = _executor()
    model = ex.initial_model()
    assert list(model) == ["p00000", "p00001"]
    for name, arr in zip(model, INITIAL, strict=True):
        np.testing.assert_array_equal(model[name], arr)
    out = ex.train(model, TrainRequest(round=0))
    assert out.num_examples == 5
    np.testing.assert_array_equal(out.update["p00000"], np.ones((2, 3), np.float32))


def test_the_workflows_polling_thread_ends_quietly_once_the_model_is_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Flower stops the workflow's node-polling thread only when its training returns,
    which it never does here: the thread's next poll (every 5 s) after the ServerApp
    stopped ends it, without a traceback in the worker's log and without counting
    against the ServerApp's own polls."""
    failures: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    before = set(threading.enumerate())
    _executor().initial_model()
    pollers = [t for t in threading.enumerate() if t not in before and t.name.endswith(POLLER)]
    assert pollers, "the workflow polls its nodes from a thread of its own"
    for thread in pollers:
        thread.join(timeout=15)
    assert not [t for t in pollers if t.is_alive()]
    assert failures == []
