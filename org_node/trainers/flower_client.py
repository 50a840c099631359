"""Flower clients as the worker calls them: the ids, errors and seeding a Flower
runtime provides, the adapter over a ``NumPyClient`` / ``Client`` / ``ClientApp``
(:class:`FlowerTrainer`, legacy and Message API alike), and the checks of the arrays
a client hands back (:class:`Layout`): names, shapes, real numeric dtypes, finiteness.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
from flwr.app import (
    DEFAULT_TTL,
    Array,
    ArrayRecord,
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
from flwr.supercore.task_identity import TaskIdentity

from org_node.trainers.base import TrainerError

__all__ = [
    "EvalOutcome",
    "FitOutcome",
    "FlowerClientError",
    "FlowerContextConfig",
    "FlowerTrainer",
    "Layout",
    "LocalTrainer",
    "flower_ids",
    "seed_everything",
]

Scalar = bool | bytes | float | int | str
UserValue = bool | float | int | str
NDArrays = list[np.ndarray]
Arrays = dict[str, np.ndarray]
Metrics = dict[str, Scalar]
NO_SERVER_APP = (
    "a Message-API ClientApp gets its initial model from the app's ServerApp; install the "
    "Flower App directory, or put the ServerApp in the same module"
)
SERVER_TASK, _CLIENT_TASK = 1, 2  # Flower's task ids of this process's two apps
MAX_NODE_POLLS = 5  # get_node_ids() calls before the first train message (FedAvg: 2)
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


def describe(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


@contextlib.contextmanager
def client_errors(prefix: str = "") -> Iterator[None]:
    """The client's own exceptions as a one-line :class:`FlowerClientError`."""
    try:
        yield
    except TrainerError:
        raise
    except Exception as exc:
        raise FlowerClientError(f"{prefix}{describe(exc)}") from exc


@contextlib.contextmanager
def task_identity(run_id: int, node_id: int, task_id: int) -> Iterator[None]:
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


def check_count(what: str, n: Any, minimum: int = 0) -> int:
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
        with client_errors(f"{what}: " if what == "evaluate" else ""):
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
        with client_errors():
            return parameters_to_ndarrays(res.parameters)

    def fit_raw(
        self, params: NDArrays, config: Mapping[str, Scalar]
    ) -> tuple[NDArrays, int, Metrics]:
        """The client's ``fit``: ``(local arrays, num_examples, metrics)``."""
        ins = FitIns(ndarrays_to_parameters(params), dict(config))
        res = self._ask(MessageType.TRAIN, ins, "fit")
        if res is None:
            raise FlowerClientError("the client does not implement fit")
        with client_errors():
            return parameters_to_ndarrays(res.parameters), res.num_examples, dict(res.metrics)

    def evaluate_raw(
        self, params: NDArrays, config: Mapping[str, Scalar]
    ) -> tuple[float, int, Metrics] | None:
        """The client's ``evaluate``: ``(loss, num_examples, metrics)``; None if it has none."""
        ins = EvaluateIns(ndarrays_to_parameters(params), dict(config))
        res = self._ask(MessageType.EVALUATE, ins, "evaluate")
        if res is None:
            return None
        n = check_count("evaluate num_examples", res.num_examples)
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
        return FitOutcome(update, check_count("num_examples", n), metrics)

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
        with client_errors(), task_identity(cc.run_id, cc.node_id, _CLIENT_TASK):
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


def list_names(arrays: Sequence[np.ndarray]) -> Arrays:
    """A list of arrays named ``p00000``, ``p00001``, ... (sorted names keep the order)."""
    width = max(5, len(str(len(arrays) - 1)))
    return {f"p{i:0{width}d}": a for i, a in enumerate(arrays)}


def check_array(name: str, value: Any, what: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise TrainerError(f"{what}: array {name!r} is a {type(value).__name__}, not an ndarray")
    if value.dtype.kind not in "iuf":
        raise TrainerError(f"{what}: array {name!r} has dtype {value.dtype}, not real numbers")
    if value.dtype.kind == "f" and not np.all(np.isfinite(value)):
        raise TrainerError(f"{what}: array {name!r} holds NaN or Inf")
    return value


@dataclass(frozen=True)
class Layout:
    """The model's array names (in the client's order), original dtypes and shapes."""

    names: tuple[str, ...]
    dtypes: Mapping[str, np.dtype]
    shapes: Mapping[str, tuple[int, ...]]

    @classmethod
    def of(cls, arrays: Arrays, what: str) -> Layout:
        if not arrays:
            raise TrainerError(f"{what} holds no arrays")
        checked = {k: check_array(k, a, what) for k, a in arrays.items()}
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
            out[name] = a = check_array(name, arrays[name], what)
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


def to_record(arrays: Arrays) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(a, order="C")) for k, a in arrays.items()})


def to_numpy(record: ArrayRecord, what: str) -> Arrays:
    out: Arrays = {}
    for key, array in record.items():
        try:
            out[key] = array.numpy()
        except Exception as exc:
            raise TrainerError(f"{what}: array {key!r} cannot be read: {describe(exc)}") from exc
    return out


def pick(records: Mapping[str, Any], key: str, what: str) -> Any:
    """The record named ``key``, else the only one, else None (several: TrainerError)."""
    if key in records:
        return records[key]
    if len(records) > 1:
        raise TrainerError(f"the reply carries {len(records)} {what}s and none named {key!r}")
    return next(iter(records.values()), None)


def metrics_of(values: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """Finite numeric scalars but ``num-examples``, as floats, named ``<prefix>key``."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if key == "num-examples" or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key if key.startswith(prefix) else f"{prefix}{key}"] = float(value)
    return out


def num_examples_of(metrics: Mapping[str, Any] | None) -> int:
    if metrics is None or "num-examples" not in metrics:
        raise TrainerError("the train reply's MetricRecord has no 'num-examples' (its weight)")
    n = metrics["num-examples"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TrainerError(f"the train reply's 'num-examples' must be an int >= 1, got {n!r}")
    return n
