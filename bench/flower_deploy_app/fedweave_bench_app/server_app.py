"""fedweave_bench_app: the ServerApp (FedAvg, with SecAgg+ when ``secure-aggregation``).

Under Flower it runs the rounds: Flower's legacy ``FedAvg`` in a ``DefaultWorkflow``,
whose fit step is ``SecAggPlusWorkflow`` (every node shares with every other,
``reconstruction-threshold`` of them reconstruct) when ``secure-aggregation`` is true.
Under fedweave each org's node takes only the initial model from it; the orgs' masked
sum and fedweave's FedAvg run the rounds.
"""

from __future__ import annotations

from flwr.app import Context
from flwr.common import Metrics, ndarrays_to_parameters
from flwr.server import ServerConfig
from flwr.server.compat import LegacyContext
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.serverapp import Grid, ServerApp

from fedweave_bench_app.task import initial_model

app = ServerApp()


def _mean_loss(results: list[tuple[int, Metrics]]) -> Metrics:
    total = sum(n for n, _ in results)
    loss = sum(n * float(m.get("train_loss", 0.0)) for n, m in results)
    return {"train_loss": loss / total} if total else {}


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    orgs = int(rc["num-orgs"])
    model = initial_model(int(rc["model-params"]), int(rc["input-dim"]))
    strategy = FedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=orgs,
        min_available_clients=orgs,
        initial_parameters=ndarrays_to_parameters(model),
        fit_metrics_aggregation_fn=_mean_loss,
    )
    legacy = LegacyContext(
        context=context,
        config=ServerConfig(num_rounds=int(rc["num-server-rounds"])),
        strategy=strategy,
    )
    fit = None
    if bool(rc["secure-aggregation"]):
        fit = SecAggPlusWorkflow(
            num_shares=orgs,
            reconstruction_threshold=int(rc["reconstruction-threshold"]),
            clipping_range=8.0,
        )
    DefaultWorkflow(fit_workflow=fit)(grid, legacy)
