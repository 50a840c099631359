"""A Flower user's client code, unchanged, as an org's trainer (the worker's Flower side).

:class:`FlowerExecutor` is the :class:`~org_node.trainers.base.Executor` of the
``flower-clientapp`` and ``flower-app`` kinds. A Message-API ``ClientApp()`` gets, each
round, a ``train`` Message carrying ``{"arrays": ArrayRecord, "config": ConfigRecord}``
with the metadata a SuperNode delivers, and replies with an ArrayRecord and a
MetricRecord whose ``num-examples`` weighs the update. A legacy ``ClientApp(client_fn)``
goes through Flower's legacy message path (so its mods and ``client_fn`` run as under a
SuperNode); a ``NumPyClient`` / ``Client`` is called directly (:class:`FlowerTrainer`).
The :class:`flwr.app.Context` (ids from :func:`flower_ids`, the org's ``node_config``,
the app's ``[tool.flwr.app.config]`` under the run's config) and its ``state`` live as
long as the worker.

The round-0 model is the same at every org: with the RNGs seeded by the run's model
seed, the app's ServerApp runs until its first ``train`` message, which a capturing
:class:`flwr.serverapp.Grid` takes (its ArrayRecord is the model, its ConfigRecord each
round's train config, as the strategy sends them; a SecAgg+ workflow's model from its
state); else a legacy ServerApp's
``initial_parameters`` (and ``on_fit_config_fn``); else the legacy client's
``get_parameters``. Arrays keep their ArrayRecord keys, a list is named ``p00000``, ...;
the node sees float32, the client its own dtypes (integer buffers round-trip).

Whatever the client gets wrong (it raised, replied with an error, returned wrong names,
shapes or types, NaN/Inf, no ``num-examples``) is a one-line
:class:`~org_node.trainers.base.TrainerError`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import (
    ConfigRecord,
    Context,
    MessageType,
    RecordDict,
)
from flwr.client import Client, ClientApp, NumPyClient
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import ServerApp

from org_node.trainers.base import Model, TrainerError, TrainRequest, WorkerSpec
from org_node.trainers.code import read_flower_app
from org_node.trainers.flower_client import (
    NO_SERVER_APP,
    Arrays,
    EvalOutcome,
    FitOutcome,
    FlowerClientError,
    FlowerContextConfig,
    FlowerTrainer,
    Layout,
    LocalTrainer,
    UserValue,
    check_array,
    check_count,
    client_errors,
    flower_ids,
    list_names,
    metrics_of,
    num_examples_of,
    pick,
    seed_everything,
    to_numpy,
    to_record,
)
from org_node.trainers.flower_server import (
    ServerPlan,
    legacy_plan,
    load_app,
    module_server_app,
    run_main,
)
from org_node.training.exchange import LocalResult

__all__ = [
    "EvalOutcome",
    "FitOutcome",
    "FlowerClientError",
    "FlowerContextConfig",
    "FlowerExecutor",
    "FlowerTrainer",
    "LocalTrainer",
    "flower_ids",
    "seed_everything",
]


# -------------------------------------------------------------------- the executor


class FlowerExecutor:
    """A Flower client as an :class:`~org_node.trainers.base.Executor`.

    ``client``: a ClientApp (Message-API or ``client_fn``), NumPyClient or Client;
    ``server_app``: the app's ServerApp, if any; ``context``: the client's Context ids
    and configs; ``participants``: the nodes the ServerApp sees; ``evaluate``: evaluate
    the trained model after each round (when the client can).
    """

    def __init__(
        self,
        client: NumPyClient | Client | ClientApp,
        server_app: ServerApp | None = None,
        *,
        context: FlowerContextConfig | None = None,
        model_seed: int = 0,
        participants: int = 1,
        evaluate: bool = True,
    ) -> None:
        if not isinstance(client, NumPyClient | Client | ClientApp):
            kind = type(client).__name__
            raise TrainerError(f"the trainer is a {kind}, not a Flower ClientApp or client")
        if server_app is not None and not isinstance(server_app, ServerApp):
            raise TrainerError(f"the serverapp is a {type(server_app).__name__}, not a ServerApp")
        self._client = FlowerTrainer(client, context)
        self._server_app = server_app
        self._seed, self._participants, self._evaluate = model_seed, participants, evaluate
        self._plan = ServerPlan()
        self._layout: Layout | None = None
        self._model: Model | None = None

    @classmethod
    def from_spec(cls, spec: WorkerSpec) -> FlowerExecutor:
        """Import the trainer ``spec`` names (``flower-clientapp`` or ``flower-app``)."""
        seed_everything(spec.model_seed)  # module-level models are the same at every org
        kind, ref, defaults = spec.trainer.kind, spec.trainer.ref, {}
        if kind == "flower-app":
            app = read_flower_app(Path(ref))
            client = load_app(app.clientapp, "clientapp", app.root)
            server = load_app(app.serverapp, "serverapp", app.root) if app.serverapp else None
            defaults = dict(app.config)
        elif kind == "flower-clientapp":
            client, server = load_app(ref, "clientapp"), module_server_app(ref)
        else:
            raise TrainerError(f"FlowerExecutor runs Flower trainers, not kind {kind!r}")
        node_id, run_id = flower_ids(spec.org_id, spec.run_key)
        run_config = {**defaults, **spec.run_config}
        try:
            context = FlowerContextConfig(node_id, run_id, dict(spec.node_config), run_config)
        except ValueError as exc:
            raise TrainerError(str(exc)) from None
        evaluate = bool(spec.job.get("evaluate", True))
        return cls(
            client,
            server,
            context=context,
            model_seed=spec.model_seed,
            participants=spec.participants,
            evaluate=evaluate,
        )

    @property
    def context(self) -> Context:
        """The Flower Context the client sees (its ``state`` persists across rounds)."""
        return self._client.context

    def initial_model(self) -> Model:
        """The round-0 model (float32), from the ServerApp or the legacy client."""
        if self._model is None:
            seed_everything(self._seed)
            named, what = self._initial_arrays()
            self._layout = Layout.of(named, what)
            self._model = {k: a.astype(np.float32) for k, a in named.items()}
        return {k: a.copy() for k, a in self._model.items()}

    def _initial_arrays(self) -> tuple[Arrays, str]:
        app = self._server_app
        if app is not None:
            cc = self._client.context_config
            ctx = Context(cc.run_id, SUPERLINK_NODE_ID, {}, RecordDict(), dict(cc.run_config))
            main = app._main is not None
            self._plan = run_main(app, ctx, self._participants) if main else legacy_plan(app, ctx)
            if self._plan.model is not None:
                return self._plan.model, "the ServerApp's initial model"
        if self._client.message_api:
            raise TrainerError(
                NO_SERVER_APP
                if app is None
                else "the legacy ServerApp's strategy has no initial_parameters, and a "
                "Message-API ClientApp has no get_parameters"
            )
        return list_names(self._client.initial_parameters()), "get_parameters()"

    def statistics(self) -> np.ndarray | None:
        return None

    def train(self, global_model: Model, request: TrainRequest) -> LocalResult:
        """One round: the client trains from ``global_model``; the update and its weight."""
        if self._layout is None:
            self.initial_model()  # a restarted worker: the same layout and train config
        assert self._layout is not None
        layout, server_round = self._layout, request.round + 1
        given = layout.check({k: np.asarray(v) for k, v in global_model.items()}, "the global")
        options = {k: v for k, v in request.options.items() if isinstance(v, UserValue)}
        config = {**self._fit_config(server_round), **options, "server-round": server_round}
        if self._client.message_api:
            local, n, metrics = self._train_message(layout.to_client(given), config)
        else:
            local, n, metrics = self._train_legacy(layout.to_client(given), config)
        update: Arrays = {}
        for name in layout.names:
            diff = np.subtract(local[name], given[name], dtype=np.float64)
            update[name] = check_array(name, np.asarray(diff, np.float32), "the update")
        if self._evaluate and self._client.can_evaluate():
            metrics |= self._evaluate_local(layout.to_client(local), server_round)
        return LocalResult(update=update, num_examples=n, steps=1, metrics=metrics, losses=[])

    def _fit_config(self, server_round: int) -> dict[str, Any]:
        if (fn := self._plan.fit_config_fn) is None:
            return dict(self._plan.train_config)
        with client_errors("the strategy's on_fit_config_fn failed: "):
            return dict(fn(server_round))

    def _content(self, arrays: Arrays, config: Mapping[str, Any]) -> RecordDict:
        plan = self._plan
        with client_errors("the config: "):
            config_record = ConfigRecord(dict(config))
        return RecordDict({plan.arrays_key: to_record(arrays), plan.config_key: config_record})

    def _train_message(
        self, sent: Arrays, config: dict[str, Any]
    ) -> tuple[Arrays, int, dict[str, float]]:
        assert self._layout is not None
        group = str(config["server-round"])
        reply = self._client.call_app(self._content(sent, config), self._plan.train_type, group)
        record = pick(reply.content.array_records, self._plan.arrays_key, "ArrayRecord")
        if record is None:
            raise TrainerError("the train reply carries no ArrayRecord")
        local = self._layout.check(to_numpy(record, "the trained model"), "the trained model")
        metrics = pick(reply.content.metric_records, "metrics", "MetricRecord")
        return local, num_examples_of(metrics), metrics_of(metrics, "train_")

    def _train_legacy(
        self, sent: Arrays, config: dict[str, Any]
    ) -> tuple[Arrays, int, dict[str, float]]:
        assert self._layout is not None
        arrays, n, metrics = self._client.fit_raw(list(sent.values()), config)
        local = self._layout.check(self._layout.named(arrays), "the trained model")
        return local, check_count("num_examples", n, 1), metrics_of(metrics, "train_")

    def _evaluate_local(self, local: Arrays, server_round: int) -> dict[str, float]:
        """The client's evaluation of its trained model, as ``eval_*`` metrics."""
        fn = self._plan.evaluate_config_fn
        with client_errors("the strategy's on_evaluate_config_fn failed: "):
            config = {**(dict(fn(server_round)) if fn else {}), "server-round": server_round}
        if not self._client.message_api:
            out = self._client.evaluate_raw(list(local.values()), config)
            return {} if out is None else metrics_of({"loss": out[0], **out[2]}, "eval_")
        content = self._content(local, config)
        reply = self._client.call_app(content, MessageType.EVALUATE, str(server_round))
        metrics = pick(reply.content.metric_records, "metrics", "MetricRecord")
        return metrics_of(metrics or {}, "eval_")

    def close(self) -> None:
        """Nothing to release: the client's resources live as long as the process."""
