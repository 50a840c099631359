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
round's train config, as the strategy sends them); else a legacy ServerApp's
``initial_parameters`` (and ``on_fit_config_fn``); else the legacy client's
``get_parameters``. Arrays keep their ArrayRecord keys, a list is named ``p00000``, ...;
the node sees float32, the client its own dtypes (integer buffers round-trip).

Whatever the client gets wrong (it raised, replied with an error, returned wrong names,
shapes or types, NaN/Inf, no ``num-examples``) is a one-line
:class:`~org_node.trainers.base.TrainerError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
from flwr.app import (
    DEFAULT_TTL,
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    Metadata,
    RecordDict,
)
from flwr.client import Client, ClientApp, NumPyClient
from flwr.common import (
    Code,
    EvaluateIns,
    FitIns,
    GetParametersIns,
    MessageTypeLegacy,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.compat.client import client as legacy
from flwr.compat.common import recorddict_compat as rc
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from org_node.trainers.base import Model, TrainerError, TrainRequest, WorkerSpec
from org_node.trainers.code import CodeError, load_object, read_flower_app, split_ref
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

Scalar = bool | bytes | float | int | str
UserValue = bool | float | int | str
NDArrays = list[np.ndarray]
Arrays = dict[str, np.ndarray]
Metrics = dict[str, Scalar]
_NO_SERVER_APP = (
    "a Message-API ClientApp gets its initial model from the app's ServerApp; install the "
    "Flower App directory, or put the ServerApp in the same module"
)
_SERVER_TASK, _CLIENT_TASK = 1, 2  # Flower's task ids of this process's two apps
_MAX_NODE_POLLS = 5  # get_node_ids() calls before the first train message (FedAvg: 2)
_LEGACY: dict[str, tuple[Callable[[Any, Any], Any], Callable[[Any], Any], Callable[[Any], Any]]]
_LEGACY = {  # message type: (call on a Client, *Ins -> RecordDict, RecordDict -> *Res)
    MessageTypeLegacy.GET_PARAMETERS: (
        legacy.maybe_call_get_parameters,
        rc.getparametersins_to_recorddict,
        lambda content: rc.recorddict_to_getparametersres(content, keep_input=False),
    ),
    MessageType.TRAIN: (
        legacy.maybe_call_fit,
        lambda ins: rc.fitins_to_recorddict(ins, keep_input=True),
        lambda content: rc.recorddict_to_fitres(content, keep_input=False),
    ),
    MessageType.EVALUATE: (
        legacy.maybe_call_evaluate,
        lambda ins: rc.evaluateins_to_recorddict(ins, keep_input=True),
        rc.recorddict_to_evaluateres,
    ),
}


class FlowerClientError(TrainerError):
    """The wrapped Flower client failed, or returned something malformed (one line)."""


def _describe(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


@contextlib.contextmanager
def _client_errors(prefix: str = "") -> Iterator[None]:
    """The client's own exceptions as a one-line :class:`FlowerClientError`."""
    try:
        yield
    except TrainerError:
        raise
    except Exception as exc:
        raise FlowerClientError(f"{prefix}{_describe(exc)}") from exc


@contextlib.contextmanager
def _task_identity(run_id: int, node_id: int, task_id: int) -> Iterator[None]:
    """Flower's per-process task identity (messages that app code creates carry it), set
    as Flower's runtimes set it, and restored afterwards."""
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = task_id, run_id, node_id
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def flower_ids(org_id: str, run_key: str) -> tuple[int, int]:
    """``(node_id, run_id)``: the first 8 bytes of SHA-256 of the org and run (63 bits,
    so they fit a signed 64-bit integer too); every org of a run shares the run id."""

    def digest(*parts: str) -> int:
        data = "\x00".join(("fedweave/flower", *parts)).encode()
        return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") >> 1

    return digest("node", run_key, org_id), digest("run", run_key)


def seed_everything(seed: int) -> None:
    """Seed ``random``, ``numpy.random`` and (if importable) ``torch`` with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    with contextlib.suppress(ImportError):
        import torch

        torch.manual_seed(seed % 2**32)


# --------------------------------------------------------------------- legacy adapter


@dataclass(frozen=True)
class FitOutcome:
    """:meth:`FlowerTrainer.fit`: ``local - global`` per tensor (float64), the examples
    seen (the org's weight) and the client's own metrics."""

    update: NDArrays
    num_examples: int
    metrics: dict[str, Scalar] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalOutcome:
    """Local evaluation of a model: loss, examples evaluated and client metrics."""

    loss: float
    num_examples: int
    metrics: dict[str, Scalar] = field(default_factory=dict)


@runtime_checkable
class LocalTrainer(Protocol):
    """A local trainer as list-of-arrays code (the benchmarks) drives it."""

    def fit(self, global_params: Sequence[np.ndarray], config: Mapping[str, Scalar]) -> FitOutcome:
        """Train from ``global_params``; return the delta and the weight."""
        ...

    def evaluate(self, params: Sequence[np.ndarray], config: Mapping[str, Scalar]) -> EvalOutcome:
        """Evaluate ``params`` on local data."""
        ...


@dataclass(frozen=True)
class FlowerContextConfig:
    """The ids (ints >= 0) and configs (str -> scalar) of the client's Context."""

    node_id: int = 0
    run_id: int = 0
    node_config: Mapping[str, UserValue] = field(default_factory=dict)
    run_config: Mapping[str, UserValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("node_id", "run_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        for name in ("node_config", "run_config"):
            for key, value in getattr(self, name).items():
                if not isinstance(key, str) or not isinstance(value, Scalar):
                    raise ValueError(f"{name}[{key!r}] must map str to a scalar, got {value!r}")


def _check_count(what: str, n: Any, minimum: int = 0) -> int:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < minimum:
        raise FlowerClientError(f"{what} must be an int >= {minimum}, got {n!r}")
    return int(n)


class FlowerTrainer:
    """A Flower ``NumPyClient``, ``Client`` or ``ClientApp`` called as Flower calls it: a
    NumPyClient through ``to_client()`` (as a ``client_fn`` returning one is), a
    ClientApp through messages as a SuperNode delivers them. :attr:`context` persists."""

    def __init__(
        self,
        client: NumPyClient | Client | ClientApp,
        context: FlowerContextConfig | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(client, NumPyClient | Client | ClientApp):
            raise TypeError(
                "FlowerTrainer takes a flwr NumPyClient, Client or ClientApp, "
                f"got {type(client).__name__}"
            )
        self.client = client
        self._legacy = client.to_client() if isinstance(client, NumPyClient) else client
        self.context_config = cc = context or FlowerContextConfig()
        node, run = dict(cc.node_config), dict(cc.run_config)
        self.context = Context(cc.run_id, cc.node_id, node, RecordDict(), run)
        self._clock = clock
        self._message_ids = itertools.count(1)

    @property
    def message_api(self) -> bool:
        """A ``ClientApp()`` with registered functions (not ``client_fn``)."""
        return isinstance(self.client, ClientApp) and self.client._call is None

    def can_evaluate(self) -> bool:
        """Whether to ask for an evaluation (a ``client_fn``'s client may still have none)."""
        if isinstance(self._legacy, Client):
            return legacy.has_evaluate(self._legacy)
        return not self.message_api or "evaluate.default" in self._legacy._registered_funcs

    def _ask(self, message_type: str, ins: Any, what: str) -> Any:
        """The client's legacy ``*Res`` to ``ins``; None if it does not implement ``what``."""
        call, encode, decode = _LEGACY[message_type]
        with _client_errors(f"{what}: " if what == "evaluate" else ""):
            if isinstance(self._legacy, Client):
                res = call(self._legacy, ins)
            else:
                res = decode(self.call_app(encode(ins), message_type).content)
        if res.status.code.name.endswith("_NOT_IMPLEMENTED"):
            return None
        if res.status.code != Code.OK:
            raise FlowerClientError(f"client {what} failed: {res.status.message}")
        return res

    def get_parameters(self, config: Mapping[str, Scalar] | None = None) -> NDArrays:
        """A ``NumPyClient``'s or ``Client``'s initial parameters (not a ClientApp's)."""
        if isinstance(self.client, ClientApp):
            raise FlowerClientError(
                "a ClientApp does not expose initial parameters here; use initial_parameters()"
            )
        return self.initial_parameters(config)

    def initial_parameters(self, config: Mapping[str, Scalar] | None = None) -> NDArrays:
        """The client's ``get_parameters`` as Flower's legacy server asks one client for
        them (a ClientApp through a ``get_parameters`` legacy message)."""
        ins = GetParametersIns(dict(config or {}))
        res = self._ask(MessageTypeLegacy.GET_PARAMETERS, ins, "get_parameters")
        if res is None:
            raise FlowerClientError("the client does not implement get_parameters")
        with _client_errors():
            return parameters_to_ndarrays(res.parameters)

    def fit_raw(
        self, params: NDArrays, config: Mapping[str, Scalar]
    ) -> tuple[NDArrays, int, Metrics]:
        """The client's ``fit``: ``(local arrays, num_examples, metrics)``."""
        ins = FitIns(ndarrays_to_parameters(params), dict(config))
        res = self._ask(MessageType.TRAIN, ins, "fit")
        if res is None:
            raise FlowerClientError("the client does not implement fit")
        with _client_errors():
            return parameters_to_ndarrays(res.parameters), res.num_examples, dict(res.metrics)

    def evaluate_raw(
        self, params: NDArrays, config: Mapping[str, Scalar]
    ) -> tuple[float, int, Metrics] | None:
        """The client's ``evaluate``: ``(loss, num_examples, metrics)``; None if it has none."""
        ins = EvaluateIns(ndarrays_to_parameters(params), dict(config))
        res = self._ask(MessageType.EVALUATE, ins, "evaluate")
        if res is None:
            return None
        n = _check_count("evaluate num_examples", res.num_examples)
        return float(res.loss), n, dict(res.metrics)

    def fit(self, global_params: Sequence[np.ndarray], config: Mapping[str, Scalar]) -> FitOutcome:
        """Run the client's ``fit`` from ``global_params``; ``(delta float64, n, metrics)``."""
        params = [np.asarray(p) for p in global_params]
        local, n, metrics = self.fit_raw(params, config)
        if len(local) != len(params):
            raise FlowerClientError(f"client returned {len(local)} tensors, not {len(params)}")
        for i, (a, g) in enumerate(zip(local, params, strict=True)):
            if a.shape != g.shape:
                raise FlowerClientError(f"client tensor {i} has shape {a.shape}, not {g.shape}")
        update = [np.subtract(a, g, dtype=np.float64) for a, g in zip(local, params, strict=True)]
        if not all(np.all(np.isfinite(u)) for u in update):
            raise FlowerClientError("client returned non-finite parameters")
        return FitOutcome(update, _check_count("num_examples", n), metrics)

    def evaluate(self, params: Sequence[np.ndarray], config: Mapping[str, Scalar]) -> EvalOutcome:
        """Run the client's ``evaluate`` on ``params``."""
        out = self.evaluate_raw([np.asarray(p) for p in params], config)
        if out is None:
            raise FlowerClientError("the client does not implement evaluate")
        if math.isnan(out[0]):
            raise FlowerClientError("client returned a NaN loss")
        return EvalOutcome(*out)

    def call_app(self, content: RecordDict, message_type: str, group_id: str = "") -> Message:
        """Deliver a message to the ClientApp as a SuperNode does; its reply, checked."""
        assert isinstance(self.client, ClientApp)
        cc = self.context_config
        metadata = Metadata(
            run_id=cc.run_id,
            message_id=f"fedweave-{next(self._message_ids)}",
            src_node_id=SUPERLINK_NODE_ID,
            dst_node_id=cc.node_id,
            reply_to_message_id="",
            group_id=group_id,
            created_at=self._clock(),
            ttl=DEFAULT_TTL,
            message_type=message_type,
        )
        with _client_errors(), _task_identity(cc.run_id, cc.node_id, _CLIENT_TASK):
            # An incoming message carries its metadata, as the SuperNode delivers it;
            # Flower's public overloads only cover messages created by a ServerApp.
            message = Message(content=content, metadata=metadata)  # type: ignore[call-overload]
            reply = self.client(message, self.context)
        if not isinstance(reply, Message):
            raise FlowerClientError(f"the ClientApp returned a {type(reply).__name__}")
        if reply.has_error():
            raise FlowerClientError(f"the ClientApp replied with an error: {reply.error.reason}")
        return reply


# ------------------------------------------------------------------------ the model


def _list_names(arrays: Sequence[np.ndarray]) -> Arrays:
    """A list of arrays named ``p00000``, ``p00001``, ... (sorted names keep the order)."""
    width = max(5, len(str(len(arrays) - 1)))
    return {f"p{i:0{width}d}": a for i, a in enumerate(arrays)}


def _check_array(name: str, value: Any, what: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise TrainerError(f"{what}: array {name!r} is a {type(value).__name__}, not an ndarray")
    if value.dtype.kind not in "iuf":
        raise TrainerError(f"{what}: array {name!r} has dtype {value.dtype}, not real numbers")
    if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
        raise TrainerError(f"{what}: array {name!r} holds NaN or Inf")
    return value


@dataclass(frozen=True)
class _Layout:
    """The model's array names (in the client's order), original dtypes and shapes."""

    names: tuple[str, ...]
    dtypes: Mapping[str, np.dtype]
    shapes: Mapping[str, tuple[int, ...]]

    @classmethod
    def of(cls, arrays: Arrays, what: str) -> _Layout:
        if not arrays:
            raise TrainerError(f"{what} holds no arrays")
        checked = {k: _check_array(k, a, what) for k, a in arrays.items()}
        shapes = {k: a.shape for k, a in checked.items()}
        return cls(tuple(checked), {k: a.dtype for k, a in checked.items()}, shapes)

    def named(self, arrays: Sequence[np.ndarray]) -> Arrays:
        if len(arrays) != len(self.names):
            raise TrainerError(f"the client returned {len(arrays)} arrays, not {len(self.names)}")
        return dict(zip(self.names, arrays, strict=True))

    def check(self, arrays: Mapping[str, Any], what: str) -> Arrays:
        """``arrays`` with exactly this model's names and shapes, real numbers, finite."""
        if extra := sorted(set(arrays) - set(self.names)):
            raise TrainerError(f"{what} has arrays the model lacks: {', '.join(map(repr, extra))}")
        out: Arrays = {}
        for name in self.names:
            if name not in arrays:
                raise TrainerError(f"{what} lacks array {name!r}")
            out[name] = a = _check_array(name, arrays[name], what)
            if a.shape != self.shapes[name]:
                raise TrainerError(
                    f"{what}: array {name!r} has shape {a.shape}, the model {self.shapes[name]}"
                )
        return out

    def to_client(self, arrays: Arrays) -> Arrays:
        """``arrays`` in each array's original dtype (integers rounded)."""
        out: Arrays = {}
        for name in self.names:
            a, dtype = np.asarray(arrays[name]), self.dtypes[name]
            out[name] = np.asarray(np.rint(a) if dtype.kind in "iu" else a, dtype=dtype)
        return out


def _record(arrays: Arrays) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(a, order="C")) for k, a in arrays.items()})


def _numpy(record: ArrayRecord, what: str) -> Arrays:
    out: Arrays = {}
    for key, array in record.items():
        try:
            out[key] = array.numpy()
        except Exception as exc:
            raise TrainerError(f"{what}: array {key!r} cannot be read: {_describe(exc)}") from exc
    return out


def _pick(records: Mapping[str, Any], key: str, what: str) -> Any:
    """The record named ``key``, else the only one, else None (several: TrainerError)."""
    if key in records:
        return records[key]
    if len(records) > 1:
        raise TrainerError(f"the reply carries {len(records)} {what}s and none named {key!r}")
    return next(iter(records.values()), None)


def _metrics(values: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """Finite numeric scalars but ``num-examples``, as floats, named ``<prefix>key``."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if key == "num-examples" or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key if key.startswith(prefix) else f"{prefix}{key}"] = float(value)
    return out


def _num_examples(metrics: Mapping[str, Any] | None) -> int:
    if metrics is None or "num-examples" not in metrics:
        raise TrainerError("the train reply's MetricRecord has no 'num-examples' (its weight)")
    n = metrics["num-examples"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TrainerError(f"the train reply's 'num-examples' must be an int >= 1, got {n!r}")
    return n


# ------------------------------------------------------------------- the ServerApp


class _StopServerApp(BaseException):
    """Ends the ServerApp's main at its first train message (a BaseException, so that the
    app's own ``except Exception`` does not swallow it); ``reason`` when it went wrong."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = reason


class _CaptureGrid(Grid):
    """A Grid of ``participants`` nodes that captures the first train message; other
    messages (evaluate, query) get no reply."""

    def __init__(self, run_id: int, participants: int) -> None:
        self._run, self._nodes = Run.create_empty(run_id), list(range(1, participants + 1))
        self._polls = 0
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
        self._polls += 1
        if self._polls > _MAX_NODE_POLLS:
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
class _ServerPlan:
    """What the ServerApp fixes: the initial model, and each round's configs."""

    model: Arrays | None = None
    train_config: Mapping[str, Any] = field(default_factory=dict)
    fit_config_fn: Callable[[int], Mapping[str, Any]] | None = None
    evaluate_config_fn: Callable[[int], Mapping[str, Any]] | None = None
    arrays_key: str = "arrays"
    config_key: str = "config"
    train_type: str = MessageType.TRAIN


def _run_main(server_app: ServerApp, context: Context, participants: int) -> _ServerPlan:
    """Run a Message-API ServerApp up to its first train message; what that carries."""
    grid = _CaptureGrid(context.run_id, participants)
    try:
        with _task_identity(context.run_id, SUPERLINK_NODE_ID, _SERVER_TASK):
            server_app(grid, context)
    except _StopServerApp as stop:
        if stop.reason:
            raise TrainerError(stop.reason) from None
    except Exception as exc:
        raise TrainerError(f"the ServerApp failed: {_describe(exc)}") from exc
    if grid.captured is None:
        raise TrainerError("the ServerApp's main sent no train message to take the model from")
    arrays, configs = grid.captured.content.array_records, grid.captured.content.config_records
    arrays_key = "arrays" if "arrays" in arrays else next(iter(arrays), None)
    if arrays_key is None:
        raise TrainerError("the ServerApp's first train message carries no ArrayRecord")
    config_key = "config" if "config" in configs else next(iter(configs), "config")
    config = configs.get(config_key, ConfigRecord())
    return _ServerPlan(
        model=_numpy(arrays[arrays_key], "the ServerApp's model"),
        train_config={k: v for k, v in config.items() if k != "server-round"},
        arrays_key=arrays_key,
        config_key=config_key,
        train_type=grid.captured.metadata.message_type,
    )


def _legacy_plan(server_app: ServerApp, context: Context) -> _ServerPlan:
    """A legacy ServerApp: its strategy's ``initial_parameters`` and config functions."""
    strategy = server_app._strategy
    if server_app._server_fn is not None:
        with _client_errors("the ServerApp's server_fn failed: "):
            components = server_app._server_fn(context)
        strategy = components.strategy or getattr(components.server, "strategy", None)
    params = getattr(strategy, "initial_parameters", None)
    return _ServerPlan(
        model=None if params is None else _list_names(parameters_to_ndarrays(params)),
        fit_config_fn=getattr(strategy, "on_fit_config_fn", None),
        evaluate_config_fn=getattr(strategy, "on_evaluate_config_fn", None),
    )


def _module_server_app(ref: str) -> ServerApp | None:
    """A ServerApp among the globals of the (already imported) module ``ref`` names."""
    target, _attr = split_ref(ref, "app")
    is_path = target.endswith(".py") or "/" in target or target.startswith(".")
    module = sys.modules.get(Path(target).stem if is_path else target)
    found = [v for v in vars(module).values() if isinstance(v, ServerApp)] if module else []
    named = getattr(module, "server_app", None)
    return named if isinstance(named, ServerApp) else next(iter(found), None)


def _load(ref: str, what: str, app_root: Path | None = None) -> Any:
    try:
        return load_object(ref, "app", app_root=app_root)
    except CodeError:
        raise
    except Exception as exc:
        raise TrainerError(f"importing the {what} {ref}: {_describe(exc)}") from exc


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
        self._plan = _ServerPlan()
        self._layout: _Layout | None = None
        self._model: Model | None = None

    @classmethod
    def from_spec(cls, spec: WorkerSpec) -> FlowerExecutor:
        """Import the trainer ``spec`` names (``flower-clientapp`` or ``flower-app``)."""
        seed_everything(spec.model_seed)  # module-level models are the same at every org
        kind, ref, defaults = spec.trainer.kind, spec.trainer.ref, {}
        if kind == "flower-app":
            app = read_flower_app(Path(ref))
            client = _load(app.clientapp, "clientapp", app.root)
            server = _load(app.serverapp, "serverapp", app.root) if app.serverapp else None
            defaults = dict(app.config)
        elif kind == "flower-clientapp":
            client, server = _load(ref, "clientapp"), _module_server_app(ref)
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
            self._layout = _Layout.of(named, what)
            self._model = {k: a.astype(np.float32) for k, a in named.items()}
        return {k: a.copy() for k, a in self._model.items()}

    def _initial_arrays(self) -> tuple[Arrays, str]:
        app = self._server_app
        if app is not None:
            cc = self._client.context_config
            ctx = Context(cc.run_id, SUPERLINK_NODE_ID, {}, RecordDict(), dict(cc.run_config))
            main = app._main is not None
            self._plan = _run_main(app, ctx, self._participants) if main else _legacy_plan(app, ctx)
            if self._plan.model is not None:
                return self._plan.model, "the ServerApp's initial model"
        if self._client.message_api:
            raise TrainerError(
                _NO_SERVER_APP
                if app is None
                else "the legacy ServerApp's strategy has no initial_parameters, and a "
                "Message-API ClientApp has no get_parameters"
            )
        return _list_names(self._client.initial_parameters()), "get_parameters()"

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
            update[name] = _check_array(name, np.asarray(diff, np.float32), "the update")
        if self._evaluate and self._client.can_evaluate():
            metrics |= self._evaluate_local(layout.to_client(local), server_round)
        return LocalResult(update=update, num_examples=n, steps=1, metrics=metrics, losses=[])

    def _fit_config(self, server_round: int) -> dict[str, Any]:
        if (fn := self._plan.fit_config_fn) is None:
            return dict(self._plan.train_config)
        with _client_errors("the strategy's on_fit_config_fn failed: "):
            return dict(fn(server_round))

    def _content(self, arrays: Arrays, config: Mapping[str, Any]) -> RecordDict:
        plan = self._plan
        with _client_errors("the config: "):
            config_record = ConfigRecord(dict(config))
        return RecordDict({plan.arrays_key: _record(arrays), plan.config_key: config_record})

    def _train_message(
        self, sent: Arrays, config: dict[str, Any]
    ) -> tuple[Arrays, int, dict[str, float]]:
        assert self._layout is not None
        group = str(config["server-round"])
        reply = self._client.call_app(self._content(sent, config), self._plan.train_type, group)
        record = _pick(reply.content.array_records, self._plan.arrays_key, "ArrayRecord")
        if record is None:
            raise TrainerError("the train reply carries no ArrayRecord")
        local = self._layout.check(_numpy(record, "the trained model"), "the trained model")
        metrics = _pick(reply.content.metric_records, "metrics", "MetricRecord")
        return local, _num_examples(metrics), _metrics(metrics, "train_")

    def _train_legacy(
        self, sent: Arrays, config: dict[str, Any]
    ) -> tuple[Arrays, int, dict[str, float]]:
        assert self._layout is not None
        arrays, n, metrics = self._client.fit_raw(list(sent.values()), config)
        local = self._layout.check(self._layout.named(arrays), "the trained model")
        return local, _check_count("num_examples", n, 1), _metrics(metrics, "train_")

    def _evaluate_local(self, local: Arrays, server_round: int) -> dict[str, float]:
        """The client's evaluation of its trained model, as ``eval_*`` metrics."""
        fn = self._plan.evaluate_config_fn
        with _client_errors("the strategy's on_evaluate_config_fn failed: "):
            config = {**(dict(fn(server_round)) if fn else {}), "server-round": server_round}
        if not self._client.message_api:
            out = self._client.evaluate_raw(list(local.values()), config)
            return {} if out is None else _metrics({"loss": out[0], **out[2]}, "eval_")
        content = self._content(local, config)
        reply = self._client.call_app(content, MessageType.EVALUATE, str(server_round))
        metrics = _pick(reply.content.metric_records, "metrics", "MetricRecord")
        return _metrics(metrics or {}, "eval_")

    def close(self) -> None:
        """Nothing to release: the client's resources live as long as the process."""
