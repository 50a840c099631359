"""fedweave_bench_app: the ClientApp (a legacy ``client_fn`` with SecAgg+ when asked).

Flower's SecAgg+ runs in the ``secaggplus_mod`` client mod, which expects every train
message to be a SecAgg+ stage; :func:`secaggplus_when_asked` hands it the messages that
carry SecAgg+ configs and passes plain train messages straight to the client, so that
one ClientApp serves the runs with and without secure aggregation.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Context, Message, MessageType
from flwr.client import Client, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Config, NDArrays, Scalar
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from fedweave_bench_app.task import initial_model, train


class BenchClient(NumPyClient):
    """Trains the linear model on this node's partition."""

    def __init__(self, context: Context) -> None:
        self.run_config = context.run_config
        self.partition_id = int(context.node_config.get("partition-id", 0))

    def get_parameters(self, config: Config) -> NDArrays:
        rc = self.run_config
        model: NDArrays = initial_model(int(rc["model-params"]), int(rc["input-dim"]))
        return model

    def fit(self, parameters: NDArrays, config: Config) -> tuple[NDArrays, int, dict[str, Scalar]]:
        model = [np.array(p, dtype=np.float32) for p in parameters]
        rnd = int(config.get("server-round", 0))
        loss = train(model, self.run_config, self.partition_id, rnd)
        return model, int(self.run_config["samples"]), {"train_loss": loss}


def client_fn(context: Context) -> Client:
    return BenchClient(context).to_client()


def secaggplus_when_asked(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """``secaggplus_mod`` for the train messages of a SecAgg+ workflow, else the client."""
    if msg.metadata.message_type == MessageType.TRAIN and (
        RECORD_KEY_CONFIGS in msg.content.config_records
    ):
        return secaggplus_mod(msg, ctxt, call_next)
    return call_next(msg, ctxt)


app = ClientApp(client_fn=client_fn, mods=[secaggplus_when_asked])
