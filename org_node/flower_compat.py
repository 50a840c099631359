"""Run a Flower client, unchanged, as an org's local trainer.

A team moving from Flower brings its client file and nothing else: any
``flwr.client.NumPyClient`` (``get_parameters`` / ``fit`` / ``evaluate``), any
``flwr.client.Client``, or a legacy ``flwr.client.ClientApp(client_fn=...)`` is
wrapped by :class:`FlowerTrainer` into the interface the org node drives:

* :meth:`FlowerTrainer.fit` ``(global_params, config) -> FitOutcome(update,
  num_examples, metrics)`` where ``update = local - global`` (float64), ready for
  :func:`org_node.strategies.pack_weighted`;
* :meth:`FlowerTrainer.evaluate` ``(params, config) -> EvalOutcome(loss,
  num_examples, metrics)``;
* :meth:`FlowerTrainer.get_parameters` for the initial model.

A ``ClientApp`` is driven through Flower's own legacy message path (a ``train`` or
``evaluate`` :class:`flwr.common.Message` carrying ``FitIns`` / ``EvaluateIns``), so
its mods and its ``client_fn(context)`` run exactly as under a Flower SuperNode; the
:class:`flwr.common.Context` is built here from the org's node id, node config and
run config, and its ``state`` persists across rounds as Flower promises.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
from flwr.client import Client, ClientApp, NumPyClient
from flwr.common import (
    Code,
    Context,
    EvaluateIns,
    EvaluateRes,
    FitIns,
    FitRes,
    GetParametersIns,
    Message,
    MessageType,
    Metadata,
    RecordDict,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.compat.common.recorddict_compat import (
    evaluateins_to_recorddict,
    fitins_to_recorddict,
    recorddict_to_evaluateres,
    recorddict_to_fitres,
)

__all__ = [
    "EvalOutcome",
    "FitOutcome",
    "FlowerClientError",
    "FlowerContextConfig",
    "FlowerTrainer",
    "LocalTrainer",
]

Scalar = bool | bytes | float | int | str
UserValue = bool | float | int | str
NDArrays = list[np.ndarray]


class FlowerClientError(RuntimeError):
    """The wrapped Flower client failed, or returned something malformed."""


@dataclass(frozen=True)
class FitOutcome:
    """What one round of local training hands to the node.

    update: ``local - global`` per tensor, float64 (the model delta).
    num_examples: examples seen, the org's weight (it travels only inside the
        secure sum).
    metrics: the client's own metrics, kept local unless the operator exports them.
    """

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
    """The org's local trainer interface, as the run engine calls it."""

    def fit(self, global_params: Sequence[np.ndarray], config: Mapping[str, Scalar]) -> FitOutcome:
        """Train from ``global_params``; return the delta and the weight."""
        ...

    def evaluate(self, params: Sequence[np.ndarray], config: Mapping[str, Scalar]) -> EvalOutcome:
        """Evaluate ``params`` on local data."""
        ...


@dataclass(frozen=True)
class FlowerContextConfig:
    """How the :class:`flwr.common.Context` given to a ``client_fn`` is built.

    node_id: the Flower node id the client sees (any int; fedweave derives it from
        the org's identity).
    run_id: the Flower run id.
    node_config: e.g. ``{"partition-id": 0, "num-partitions": 4}``.
    run_config: the run's user config (``[tool.flwr.app.config]`` in a Flower app).
    """

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
                if not isinstance(key, str) or not isinstance(
                    value, bool | bytes | float | int | str
                ):
                    raise ValueError(f"{name}[{key!r}] must map str to a scalar, got {value!r}")


def _check_arrays(what: str, arrays: Any) -> NDArrays:
    if not isinstance(arrays, list | tuple) or not all(isinstance(a, np.ndarray) for a in arrays):
        raise FlowerClientError(
            f"{what} must be a list of numpy arrays, got {type(arrays).__name__}"
        )
    return list(arrays)


def _check_count(what: str, n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise FlowerClientError(f"{what} must be an int >= 0, got {n!r}")
    return int(n)


def _delta(local: NDArrays, global_params: Sequence[np.ndarray]) -> NDArrays:
    if len(local) != len(global_params):
        raise FlowerClientError(
            f"client returned {len(local)} tensors, the global model has {len(global_params)}"
        )
    out: NDArrays = []
    for i, (a, g) in enumerate(zip(local, global_params, strict=True)):
        if a.shape != np.shape(g):
            raise FlowerClientError(
                f"client tensor {i} has shape {a.shape}, the global model {np.shape(g)}"
            )
        out.append(np.asarray(a, dtype=np.float64) - np.asarray(g, dtype=np.float64))
    return out


def _check_status(what: str, res: FitRes | EvaluateRes) -> None:
    if res.status.code != Code.OK:
        raise FlowerClientError(f"client {what} failed: {res.status.message}")


class FlowerTrainer:
    """Adapt a Flower ``NumPyClient``, ``Client`` or legacy ``ClientApp`` to
    :class:`LocalTrainer`.

    ``client`` is used as given: its methods are called with the global parameters and
    the round's config (``dict`` of scalars), exactly as a Flower server would.
    """

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
        self.context_config = context or FlowerContextConfig()
        cc = self.context_config
        self.context = Context(
            run_id=cc.run_id,
            node_id=cc.node_id,
            node_config=dict(cc.node_config),
            state=RecordDict(),
            run_config=dict(cc.run_config),
        )
        self._clock = clock
        self._message_ids = itertools.count(1)

    # -- the LocalTrainer interface ----------------------------------------------------

    def get_parameters(self, config: Mapping[str, Scalar] | None = None) -> NDArrays:
        """The client's initial parameters (``NumPyClient.get_parameters``)."""
        cfg = dict(config or {})
        if isinstance(self.client, NumPyClient):
            return _check_arrays("get_parameters()", self.client.get_parameters(cfg))
        if isinstance(self.client, Client):
            res = self.client.get_parameters(GetParametersIns(cfg))
            return parameters_to_ndarrays(res.parameters)
        raise FlowerClientError(
            "a ClientApp does not expose initial parameters; give them in the run's config"
        )

    def fit(self, global_params: Sequence[np.ndarray], config: Mapping[str, Scalar]) -> FitOutcome:
        """Run the client's ``fit`` from ``global_params``; return ``(delta, n, metrics)``."""
        params = [np.asarray(p) for p in global_params]
        cfg = dict(config)
        if isinstance(self.client, NumPyClient):
            out = self.client.fit(params, cfg)
            if not isinstance(out, tuple) or len(out) != 3:
                raise FlowerClientError(
                    "NumPyClient.fit must return (parameters, num_examples, metrics)"
                )
            local, n, metrics = out
            local = _check_arrays("fit() parameters", local)
        else:
            res = self._fit_res(params, cfg)
            _check_status("fit", res)
            local, n, metrics = (
                parameters_to_ndarrays(res.parameters),
                res.num_examples,
                res.metrics,
            )
        n = _check_count("num_examples", n)
        update = _delta(local, params)
        if not all(np.all(np.isfinite(u)) for u in update):
            raise FlowerClientError("client returned non-finite parameters")
        return FitOutcome(update=update, num_examples=n, metrics=dict(metrics or {}))

    def evaluate(self, params: Sequence[np.ndarray], config: Mapping[str, Scalar]) -> EvalOutcome:
        """Run the client's ``evaluate`` on ``params``."""
        arrays = [np.asarray(p) for p in params]
        cfg = dict(config)
        if isinstance(self.client, NumPyClient):
            out = self.client.evaluate(arrays, cfg)
            if not isinstance(out, tuple) or len(out) != 3:
                raise FlowerClientError(
                    "NumPyClient.evaluate must return (loss, num_examples, metrics)"
                )
            loss, n, metrics = out
        else:
            res = self._evaluate_res(arrays, cfg)
            _check_status("evaluate", res)
            loss, n, metrics = res.loss, res.num_examples, res.metrics
        loss = float(loss)
        if math.isnan(loss):
            raise FlowerClientError("client returned a NaN loss")
        return EvalOutcome(
            loss=loss, num_examples=_check_count("num_examples", n), metrics=dict(metrics or {})
        )

    # -- Client and ClientApp paths ----------------------------------------------------

    def _fit_res(self, params: NDArrays, cfg: dict[str, Scalar]) -> FitRes:
        ins = FitIns(ndarrays_to_parameters(params), cfg)
        if isinstance(self.client, Client):
            return self.client.fit(ins)
        reply = self._call_app(fitins_to_recorddict(ins, keep_input=True), MessageType.TRAIN)
        return recorddict_to_fitres(reply.content, keep_input=False)

    def _evaluate_res(self, params: NDArrays, cfg: dict[str, Scalar]) -> EvaluateRes:
        ins = EvaluateIns(ndarrays_to_parameters(params), cfg)
        if isinstance(self.client, Client):
            return self.client.evaluate(ins)
        reply = self._call_app(
            evaluateins_to_recorddict(ins, keep_input=True), MessageType.EVALUATE
        )
        return recorddict_to_evaluateres(reply.content)

    def _call_app(self, content: RecordDict, message_type: str) -> Message:
        assert isinstance(self.client, ClientApp)
        cc = self.context_config
        metadata = Metadata(
            run_id=cc.run_id,
            message_id=f"fedweave-{next(self._message_ids)}",
            src_node_id=0,
            dst_node_id=cc.node_id,
            reply_to_message_id="",
            group_id=str(cc.run_id),
            created_at=self._clock(),
            ttl=24 * 3600.0,
            message_type=message_type,
        )
        try:
            # An incoming message carries its metadata, as the SuperNode delivers it;
            # Flower's public overloads only cover messages created by a ServerApp.
            message = Message(content=content, metadata=metadata)  # type: ignore[call-overload]
            reply = self.client(message, self.context)
        except FlowerClientError:
            raise
        except Exception as exc:  # the app's own failure, reported with its cause
            raise FlowerClientError(f"ClientApp failed on {message_type}: {exc!r}") from exc
        if reply.has_error():
            raise FlowerClientError(f"ClientApp replied with an error: {reply.error.reason}")
        return reply
