"""fedweave_quickstart: the ServerApp (Flower's Message API).

Under Flower it runs FedAvg. Under fedweave no ServerApp runs the federation: each org's
node takes the initial model and the train config (``lr``) from it, and the secure sum
and fedweave's own FedAvg replace the strategy.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedweave_quickstart.task import Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    num_rounds = context.run_config["num-server-rounds"]
    lr = context.run_config["learning-rate"]
    torch.manual_seed(0)
    arrays = ArrayRecord(Net().state_dict())
    strategy = FedAvg(fraction_evaluate=0.0)
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
    )
    context.state["final_arrays"] = result.arrays
