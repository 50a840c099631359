"""Flower's SecAgg+ round, driven in process without Ray: the baseline of ``bench.secure_agg``.

Flower (flwr 1.42) runs SecAgg+ (Bell et al., CCS'20) as a server-side workflow,
:class:`flwr.server.workflow.SecAggPlusWorkflow`, that talks to its nodes through a
:class:`flwr.serverapp.grid.Grid`; every node runs a ``ClientApp`` wrapped in the
``secaggplus_mod`` client mod, which does the key agreement, share creation,
quantization and masking. :class:`InProcessGrid` is a ``Grid`` whose ``push_messages``
hands each message straight to the destination node's ``ClientApp`` in the same
process, with a per-node ``Context`` that keeps the mod's state between stages, so the
unmodified workflow and mod run all four stages (setup, share keys, collect masked
vectors, unmask) exactly as they would behind a SuperLink.

Every message's content goes through Flower's protobuf encoding and back on its way to
the node and on the way back (:attr:`InProcessGrid.wire_bytes` counts the encoded
bytes), as it would through a SuperLink; gRPC, TLS and the network are left out, so
this baseline is, if anything, faster than Flower deployed. Flower's round ends with
``strategy.aggregate_fit`` (FedAvg over the unmasked sum), part of the timed call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.client import Client, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import (
    Config,
    Metrics,
    NDArrays,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
    serde,
)
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import FedAvg
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp.grid import Grid
from flwr.supercore.logger import FLOWER_LOGGER as flwr_logger
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from bench.common import Report, run_main

__all__ = [
    "FlowerRound",
    "InProcessGrid",
    "main",
    "prepare_secaggplus_round",
    "quiet_flower",
    "run_secaggplus_round",
]

_RUN_ID = 1
_SERVER_NODE_ID = 1


class InProcessGrid(Grid):
    """A Flower ``Grid`` that runs each node's ``ClientApp`` synchronously, in process."""

    def __init__(
        self,
        apps: Mapping[int, ClientApp],
        *,
        node_configs: Mapping[int, Mapping[str, Any]] | None = None,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        self._apps = dict(apps)
        configs = node_configs or {}
        self._contexts = {
            nid: Context(
                _RUN_ID,
                nid,
                node_config=dict(configs.get(nid, {})),
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for nid in self._apps
        }
        self._replies: dict[str, Message] = {}
        self._run = Run.create_empty(_RUN_ID)
        self.messages_delivered = 0
        self.wire_bytes = 0

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._apps)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for msg in messages:
            msg_id = uuid4().hex
            # what a SuperLink fills in when it accepts an instruction message
            msg.metadata.__dict__["_message_id"] = msg_id
            nid = msg.metadata.dst_node_id
            reply = self._apps[nid](self._over_the_wire(msg), self._contexts[nid])
            self._replies[msg_id] = self._over_the_wire(reply)
            self.messages_delivered += 1
            ids.append(msg_id)
        return ids

    def _over_the_wire(self, msg: Message) -> Message:
        """The message as its receiver would decode it: content through protobuf."""
        if not msg.has_content():
            return msg
        proto = serde.recorddict_to_proto(msg.content)
        self.wire_bytes += proto.ByteSize()
        # a new RecordDict for this receiver; the workflow shares one among messages
        msg.content = serde.recorddict_from_proto(proto)
        return msg

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return list(self.pull_messages(list(self.push_messages(messages))))


class _VectorClient(NumPyClient):
    """Returns a fixed float32 vector as its "trained" parameters, weight 1."""

    def __init__(self, vector: np.ndarray) -> None:
        self.vector = vector

    def fit(self, parameters: NDArrays, config: Config) -> tuple[NDArrays, int, dict[str, Scalar]]:
        return [self.vector], 1, {}


def _no_metrics(results: list[tuple[int, Metrics]]) -> Metrics:
    return {}


def _client_app(vector: np.ndarray) -> ClientApp:
    def client_fn(context: Context) -> Client:
        return _VectorClient(vector).to_client()

    return ClientApp(client_fn=client_fn, mods=[secaggplus_mod])


@dataclass
class FlowerRound:
    """A prepared Flower SecAgg+ round over fixed client vectors (one call of :meth:`run`)."""

    grid: InProcessGrid
    context: LegacyContext
    workflow: SecAggPlusWorkflow

    def run(self) -> np.ndarray:
        """Run all four stages and FedAvg; return the aggregated (averaged) vector."""
        self.workflow(self.grid, self.context)
        record = self.context.state.array_records[MAIN_PARAMS_RECORD]
        arrays = parameters_to_ndarrays(compat.arrayrecord_to_parameters(record, keep_input=True))
        return np.asarray(arrays[0])


def prepare_secaggplus_round(
    vectors: list[np.ndarray],
    *,
    reconstruction_threshold: int,
    clipping_range: float = 8.0,
    quantization_range: int = 1 << 22,
) -> FlowerRound:
    """Build a grid of ``len(vectors)`` nodes and a SecAgg+ workflow over all of them.

    ``num_shares`` is the number of nodes (every node shares with every other, the
    complete graph of the original SecAgg), with ``reconstruction_threshold`` of them
    needed to reconstruct a secret.
    """
    n = len(vectors)
    # what the ServerApp process sets at start-up; instruction messages read it
    TaskIdentity.run_id = _RUN_ID
    TaskIdentity.node_id = _SERVER_NODE_ID
    TaskIdentity.task_id = _RUN_ID
    node_ids = list(range(100, 100 + n))
    grid = InProcessGrid({nid: _client_app(v) for nid, v in zip(node_ids, vectors, strict=True)})
    manager = SimpleClientManager()
    for nid in node_ids:
        manager.register(GridClientProxy(node_id=nid, grid=grid, run_id=_RUN_ID))
    strategy = FedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=n,
        min_available_clients=n,
        fit_metrics_aggregation_fn=_no_metrics,
    )
    base = Context(_RUN_ID, 0, node_config={}, state=RecordDict(), run_config={})
    context = LegacyContext(base, strategy=strategy, client_manager=manager)
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: 1})
    initial = ndarrays_to_parameters([np.zeros_like(vectors[0])])
    context.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
        initial, keep_input=True
    )
    workflow = SecAggPlusWorkflow(
        num_shares=n,
        reconstruction_threshold=reconstruction_threshold,
        clipping_range=clipping_range,
        quantization_range=quantization_range,
    )
    return FlowerRound(grid, context, workflow)


def run_secaggplus_round(vectors: list[np.ndarray], *, reconstruction_threshold: int) -> np.ndarray:
    """Prepare and run one round; the FedAvg of ``vectors`` as Flower computes it."""
    return prepare_secaggplus_round(
        vectors, reconstruction_threshold=reconstruction_threshold
    ).run()


def quiet_flower() -> None:
    """Keep Flower's per-stage INFO logging out of the benchmark table."""
    flwr_logger.setLevel(logging.WARNING)


def _body(report: Report) -> None:
    quiet_flower()
    ns = (5,) if report.quick else (5, 10)
    params = 1_000_000
    for n in ns:
        rng = np.random.default_rng(n)
        vectors = [rng.uniform(-1.0, 1.0, params).astype(np.float32) for _ in range(n)]
        t = n // 2 + 1
        times, plain = [], []
        for _ in range(1 if report.quick else 2):
            prepared = prepare_secaggplus_round(vectors, reconstruction_threshold=t)
            t0 = time.perf_counter()
            mean = prepared.run()
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            expected = np.mean(vectors, axis=0)
            plain.append(time.perf_counter() - t0)
        report.add(
            f"flower_secaggplus_round_vs_plain_mean[n={n},params=1M]",
            min(times),
            "s",
            min(plain),
            note=f"num_shares={n}, threshold={t}; max error {np.max(np.abs(mean - expected)):.1e}",
        )
        report.add(
            f"flower_secaggplus_wire_bytes_per_param[n={n}]",
            prepared.grid.wire_bytes / (n * params),
            "B/param",
            note="protobuf bytes of all messages both ways, per node and parameter",
        )


def main(argv: Sequence[str] | None = None) -> Report:
    """``python -m bench.flower_secaggplus [--quick] [--json PATH]``: Flower's round alone."""
    return run_main(
        "flower_secaggplus",
        _body,
        argv,
        description="Flower SecAgg+ workflow driven in process: round time and wire bytes",
    )


if __name__ == "__main__":
    main()
