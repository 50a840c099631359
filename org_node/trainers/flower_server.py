"""A Flower app's ServerApp, run only for what a fedweave round needs of it: the
initial model and each round's train config.

With the RNGs seeded, a Message-API ServerApp's ``main`` runs against a capturing
:class:`flwr.serverapp.Grid` until its strategy sends its first ``train`` message, and
stops there (:func:`run_main`); when that message carries no model (the setup stage of
a legacy ``DefaultWorkflow`` whose fit step is ``SecAggPlusWorkflow``), the model is
the one the workflow keeps in the context's state (the orgs' masked sum replaces
SecAgg+). A legacy ServerApp's ``server_fn`` gives its strategy's
``initial_parameters`` and ``on_fit_config_fn`` (:func:`legacy_plan`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import (
    ConfigRecord,
    Context,
    Message,
    MessageType,
    RecordDict,
)
from flwr.common import (
    parameters_to_ndarrays,
)
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.compat.common.recorddict_compat import arrayrecord_to_parameters
from flwr.server.workflow.constant import MAIN_PARAMS_RECORD
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.run import Run, RunNotRunningException

from org_node.trainers.base import TrainerError
from org_node.trainers.code import CodeError, load_object, split_ref
from org_node.trainers.flower_client import (
    MAX_NODE_POLLS,
    SERVER_TASK,
    Arrays,
    client_errors,
    describe,
    list_names,
    task_identity,
    to_numpy,
)

__all__ = ["ServerPlan", "legacy_plan", "load_app", "module_server_app", "run_main"]

# ------------------------------------------------------------------- the ServerApp


class _StopServerApp(BaseException):
    """Ends the ServerApp's main at its first train message (a BaseException, so that the
    app's own ``except Exception`` does not swallow it); ``reason`` when it went wrong."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = reason


class _CaptureGrid(Grid):
    """A Grid of ``participants`` nodes that captures the first train message; other
    messages (evaluate, query) get no reply.

    A legacy workflow (``DefaultWorkflow``, ``start_grid``) also polls the nodes from a
    thread of its own every few seconds, and stops that thread only when its training
    returns, which it never does here: once the app has stopped (``closed``), that
    thread's next poll tells it the run is over, and it ends quietly. Only the app's own
    polls count against :data:`MAX_NODE_POLLS`."""

    def __init__(self, run_id: int, participants: int) -> None:
        self._run, self._nodes = Run.create_empty(run_id), list(range(1, participants + 1))
        self._polls = 0
        self._owner = threading.get_ident()
        self.closed = False
        self.captured: Message | None = None

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
        if threading.get_ident() != self._owner:  # a legacy workflow's polling thread
            if self.closed:
                raise RunNotRunningException()
            return list(self._nodes)
        self._polls += 1
        if self._polls > MAX_NODE_POLLS:
            raise _StopServerApp(
                f"the ServerApp keeps waiting for more nodes than the run's {len(self._nodes)} "
                "participants (its strategy's min_available_nodes / min_train_nodes?)"
            )
        return list(self._nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        for message in messages:
            if message.metadata.message_type.split(".")[0] == MessageType.TRAIN:
                self.captured = message
                raise _StopServerApp()
        return []

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return []

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        self.push_messages(messages)
        return []


@dataclass(frozen=True)
class ServerPlan:
    """What the ServerApp fixes: the initial model, and each round's configs."""

    model: Arrays | None = None
    train_config: Mapping[str, Any] = field(default_factory=dict)
    fit_config_fn: Callable[[int], Mapping[str, Any]] | None = None
    evaluate_config_fn: Callable[[int], Mapping[str, Any]] | None = None
    arrays_key: str = "arrays"
    config_key: str = "config"
    train_type: str = MessageType.TRAIN


def run_main(server_app: ServerApp, context: Context, participants: int) -> ServerPlan:
    """Run a Message-API ServerApp up to its first train message; what that carries."""
    grid = _CaptureGrid(context.run_id, participants)
    try:
        with task_identity(context.run_id, SUPERLINK_NODE_ID, SERVER_TASK):
            server_app(grid, context)
    except _StopServerApp as stop:
        if stop.reason:
            raise TrainerError(stop.reason) from None
    except Exception as exc:
        raise TrainerError(f"the ServerApp failed: {describe(exc)}") from exc
    finally:
        grid.closed = True
    if grid.captured is None:
        raise TrainerError("the ServerApp's main sent no train message to take the model from")
    arrays, configs = grid.captured.content.array_records, grid.captured.content.config_records
    arrays_key = "arrays" if "arrays" in arrays else next(iter(arrays), None)
    if arrays_key is None:
        # a legacy workflow whose fit step sends no model first (SecAggPlusWorkflow's
        # setup stage): the model is the one the workflow keeps in the context's state
        model = _workflow_model(context)
        if model is None:
            raise TrainerError("the ServerApp's first train message carries no ArrayRecord")
        return ServerPlan(model=model, train_type=grid.captured.metadata.message_type)
    config_key = "config" if "config" in configs else next(iter(configs), "config")
    config = configs.get(config_key, ConfigRecord())
    return ServerPlan(
        model=to_numpy(arrays[arrays_key], "the ServerApp's model"),
        train_config={k: v for k, v in config.items() if k != "server-round"},
        arrays_key=arrays_key,
        config_key=config_key,
        train_type=grid.captured.metadata.message_type,
    )


def _workflow_model(context: Context) -> Arrays | None:
    """The model a legacy ``DefaultWorkflow`` keeps in the context's state, if any."""
    record = context.state.array_records.get(MAIN_PARAMS_RECORD)
    if record is None:
        return None
    with client_errors("the ServerApp's model: "):
        params = arrayrecord_to_parameters(record, keep_input=True)
        return list_names(parameters_to_ndarrays(params))


def legacy_plan(server_app: ServerApp, context: Context) -> ServerPlan:
    """A legacy ServerApp: its strategy's ``initial_parameters`` and config functions."""
    strategy = server_app._strategy
    if server_app._server_fn is not None:
        with client_errors("the ServerApp's server_fn failed: "):
            components = server_app._server_fn(context)
        strategy = components.strategy or getattr(components.server, "strategy", None)
    params = getattr(strategy, "initial_parameters", None)
    return ServerPlan(
        model=None if params is None else list_names(parameters_to_ndarrays(params)),
        fit_config_fn=getattr(strategy, "on_fit_config_fn", None),
        evaluate_config_fn=getattr(strategy, "on_evaluate_config_fn", None),
    )


def module_server_app(ref: str) -> ServerApp | None:
    """A ServerApp among the globals of the (already imported) module ``ref`` names."""
    target, _attr = split_ref(ref, "app")
    is_path = target.endswith(".py") or "/" in target or target.startswith(".")
    module = sys.modules.get(Path(target).stem if is_path else target)
    found = [v for v in vars(module).values() if isinstance(v, ServerApp)] if module else []
    named = getattr(module, "server_app", None)
    return named if isinstance(named, ServerApp) else next(iter(found), None)


def load_app(ref: str, what: str, app_root: Path | None = None) -> Any:
    try:
        return load_object(ref, "app", app_root=app_root)
    except CodeError:
        raise
    except Exception as exc:
        raise TrainerError(f"importing the {what} {ref}: {describe(exc)}") from exc
