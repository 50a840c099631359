"""One Flower App, unchanged, under Flower and under fedweave: the same accuracy.

Run ``python -m bench.flower_app [--quick] [--json PATH]``. The app is
``examples/flower-quickstart`` (a Message-API ``ClientApp`` with ``@app.train()`` and
``@app.evaluate()``, and a ServerApp running Flower's ``FedAvg``), on scikit-learn's
digits cut into one partition per node (``partition-id`` / ``num-partitions``).

* **Flower:** the app's own ServerApp (``FedAvg.start``) drives the three ClientApps
  over an in-process ``Grid`` (:class:`bench.flower_secaggplus.InProcessGrid`: every
  message through Flower's protobuf encoding, each node's ``Context`` kept between
  rounds). Flower's own simulation engine needs Ray, which fedweave does not install;
  the Grid is what that engine drives, without the network, TLS or any secure sum, so
  Flower's wall time per round here is, if anything, lower than deployed.
* **fedweave:** three real ``fedweave run`` nodes over mutual TLS (the harness), each
  running the same ClientApp in its own worker, adding their updates by the
  pairwise-masked secure sum, and stepping with fedweave's FedAvg.

Both start from the ServerApp's initial model, and the client's shuffles are seeded by
its partition and the round, so the two runs train the same updates up to the masked
sum's fixed-point rounding. Rows: ``fed_acc_vs_flower`` (test accuracy of the final
model, fedweave / Flower; target ``>= 0.99``), ``round_wall_s[fedweave]`` against
``[flower]`` (report).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import Report, run_main

__all__ = ["APP", "main", "run_fedweave", "run_flower"]

APP = Path(__file__).resolve().parents[1] / "examples" / "flower-quickstart"
ORGS = 3


@contextlib.contextmanager
def _app_on_path() -> Iterator[Any]:
    """The Flower App's config, its code importable (as ``flwr run`` would)."""
    from org_node.trainers.code import read_flower_app

    if not APP.is_dir():
        raise SystemExit(f"the example Flower App is missing: {APP}")
    sys.path.insert(0, str(APP))
    try:
        yield read_flower_app(APP)
    finally:
        sys.path.remove(str(APP))


def _accuracy(arrays: Mapping[str, np.ndarray]) -> float:
    import torch
    from fedweave_quickstart.task import Net, load_data, test

    net = Net()
    net.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in arrays.items()})
    _, testloader = load_data(0, ORGS, 256)
    return float(test(net, testloader, torch.device("cpu"))[1])


def run_flower(rounds: int) -> tuple[float, float]:
    """Accuracy and wall seconds per round of the app under Flower's own FedAvg."""
    from flwr.app import Context, RecordDict

    from bench.flower_secaggplus import InProcessGrid, quiet_flower
    from org_node.trainers.code import load_object
    from org_node.trainers.flower_client import seed_everything, task_identity

    quiet_flower()
    with _app_on_path() as app:
        client = load_object(app.clientapp, "app", app_root=app.root)
        server = load_object(str(app.serverapp), "app", app_root=app.root)
        ids = list(range(1, ORGS + 1))
        configs = {nid: {"partition-id": i, "num-partitions": ORGS} for i, nid in enumerate(ids)}
        run_config = dict(app.config) | {"num-server-rounds": rounds}
        grid = InProcessGrid(
            {nid: client for nid in ids}, node_configs=configs, run_config=run_config
        )
        context = Context(1, 0, node_config={}, state=RecordDict(), run_config=run_config)
        seed_everything(0)
        start = time.perf_counter()
        with task_identity(1, 1, 1):
            server(grid, context)
        elapsed = time.perf_counter() - start
        final = context.state["final_arrays"]
        arrays = {k: final[k].numpy() for k in final}  # type: ignore[union-attr]
        return _accuracy(arrays), elapsed / rounds


def run_fedweave(rounds: int) -> tuple[float, float]:
    """Accuracy and median wall seconds per round of the app under fedweave (3 nodes)."""
    from org_node.engine import STATE_FILE, EngineState
    from org_node.harness.runner import run_harness
    from org_node.harness.scenario import Scenario

    scenario = Scenario(orgs=ORGS, rounds=rounds, flower_app=str(APP))
    with tempfile.TemporaryDirectory(prefix="fw-flower-app-") as tmp:
        obs = run_harness(scenario, Path(tmp) / "run")
        if obs.errors or any(n.state != "completed" for n in obs.nodes.values()):
            raise RuntimeError(f"the fedweave run did not complete: {obs.errors or obs.states}")
        node = obs.nodes["org1"]
        state = EngineState.from_bytes(
            (node.data_dir / "runs" / obs.run_key / STATE_FILE).read_bytes()
        )
        walls = [m["round_s"] for per in obs.metrics.values() for m in per.values()]
    with _app_on_path():
        return _accuracy(state.model), statistics.median(walls)


def body(report: Report) -> None:
    rounds = 3 if report.quick else 10
    flower_acc, flower_wall = run_flower(rounds)
    fed_acc, fed_wall = run_fedweave(rounds)
    note = f"{ORGS} orgs, {rounds} rounds, examples/flower-quickstart (digits MLP)"
    report.add("fed_acc_vs_flower", fed_acc, "accuracy", flower_acc, target=">= 0.99", note=note)
    report.add(
        "round_wall_s[fedweave]",
        fed_wall,
        "s",
        flower_wall,
        note=f"{note}; fedweave: 3 nodes over mutual TLS with the masked sum, median round; "
        "Flower: in-process Grid, no network (report, not a like-for-like cost)",
    )


def main(argv: Sequence[str] | None = None) -> Report:
    """``python -m bench.flower_app [--quick] [--json PATH]``."""
    return run_main("flower_app", body, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    main()
