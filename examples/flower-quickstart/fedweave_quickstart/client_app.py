"""fedweave_quickstart: the ClientApp (Flower's Message API)."""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedweave_quickstart.task import Net, load_data
from fedweave_quickstart.task import test as test_fn
from fedweave_quickstart.task import train as train_fn

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train the received model on this node's partition."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cpu")
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    server_round = int(msg.content["config"]["server-round"])
    trainloader, _ = load_data(
        partition_id, num_partitions, context.run_config["batch-size"], seed=server_round
    )
    train_loss = train_fn(
        model, trainloader, context.run_config["local-epochs"], msg.content["config"]["lr"], device
    )
    metrics = {"train_loss": train_loss, "num-examples": len(trainloader.dataset)}
    content = RecordDict(
        {"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)}
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received model on the test split."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    _, testloader = load_data(partition_id, num_partitions, context.run_config["batch-size"])
    eval_loss, eval_acc = test_fn(model, testloader, torch.device("cpu"))
    metrics = {
        "eval_loss": eval_loss,
        "eval_acc": eval_acc,
        "num-examples": len(testloader.dataset),
    }
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
