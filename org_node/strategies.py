"""Federated strategies that every node executes identically after the secure sum.

There is no server in fedweave, so there is no one to run a strategy and broadcast its
result. Instead every surviving node receives the *same* secure sum and runs the same
pure, deterministic :meth:`Strategy.step` on it; the new global model's hash is then
gossiped and compared. Two things make that work:

* **Only sums are needed.** Each org ``i`` contributes ``w_i * delta_i`` and ``w_i``,
  where ``delta_i = local_i - global`` is its model delta and ``w_i`` its weight
  (examples seen, or any other positive weight). Both travel inside the secure sum:
  the weight is one extra coordinate of the secure vector (:func:`pack_weighted`),
  so no org reveals its dataset size; after unmasking, :func:`unpack_weighted` gives
  ``sum_i w_i delta_i`` and ``sum_i w_i``.
* **Steps are pure.** A step is a function of ``(global_params, summed_update,
  summed_weight)`` and of the strategy's state; it accumulates in float64 and never
  draws randomness. The state (round counter, moments, momentum buffers) is returned
  by :meth:`Strategy.state_dict` and restored by :meth:`Strategy.load_state_dict`;
  :func:`state_to_bytes` gives a canonical byte encoding, so a node that rebuilds
  itself from checkpoint shards continues bit-identically.

Strategies (``delta = sum_i w_i delta_i / sum_i w_i`` is the weighted mean delta):

* :class:`FedAvg` — McMahan et al. 2017, "Communication-Efficient Learning of Deep
  Networks from Decentralized Data": ``x <- x + eta * delta`` (``eta = 1``: the
  example-weighted average of the local models, as Flower's ``aggregate``).
* :class:`FedProx` — Li et al. 2020, "Federated Optimization in Heterogeneous
  Networks": FedAvg on the server side plus the proximal term
  ``mu/2 ||w - x||^2`` in local training (:func:`proximal_term`, ``local_config``).
* :class:`FedAdam`, :class:`FedYogi`, :class:`FedAdagrad` — Reddi et al. 2021,
  "Adaptive Federated Optimization", Algorithm 2, with the pseudo-gradient
  ``delta`` (the same update rules as Flower's ``FedOpt`` family).
* :class:`FedAvgM` — Hsu et al. 2019, "Measuring the Effects of Non-Identical Data
  Distribution": server SGD with momentum on the pseudo-gradient ``-delta``.
* :class:`DiLoCo` — Douillard et al. 2023, "DiLoCo: Distributed Low-Communication
  Training of Language Models": inner AdamW for ``H`` local steps, outer SGD with
  Nesterov momentum on the averaged pseudo-gradient ``x - mean(local)``, i.e.
  ``-delta`` (Algorithm 1).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "STRATEGIES",
    "DiLoCo",
    "DiLoCoConfig",
    "EmptyAggregateError",
    "FedAdagrad",
    "FedAdagradConfig",
    "FedAdam",
    "FedAdamConfig",
    "FedAvg",
    "FedAvgConfig",
    "FedAvgM",
    "FedAvgMConfig",
    "FedProx",
    "FedProxConfig",
    "FedYogi",
    "FedYogiConfig",
    "ShapeMismatchError",
    "StateMismatchError",
    "Strategy",
    "StrategyConfigError",
    "StrategyError",
    "build_inner_optimizer",
    "make_strategy",
    "pack_weighted",
    "params_shapes",
    "proximal_term",
    "state_from_bytes",
    "state_to_bytes",
    "unpack_weighted",
]

NDArrays = list[np.ndarray]


class StrategyError(ValueError):
    """Base class of the errors raised by strategies and their helpers."""


class StrategyConfigError(StrategyError):
    """A strategy configuration has an unknown key or an invalid value."""


class ShapeMismatchError(StrategyError):
    """Parameters, updates or packed vectors disagree in layout."""


class EmptyAggregateError(StrategyError):
    """The summed weight is not positive: no org contributed to the round."""


class StateMismatchError(StrategyError):
    """A state dict belongs to another strategy or another configuration."""


# --------------------------------------------------------------------------- packing


def params_shapes(params: Sequence[np.ndarray]) -> list[tuple[int, ...]]:
    """The shape of every tensor of ``params``, the layout that unpacking needs."""
    return [tuple(int(d) for d in np.shape(p)) for p in params]


def pack_weighted(update: Sequence[np.ndarray], weight: float) -> np.ndarray:
    """Flatten ``weight * update`` and append ``weight``: one org's secure vector.

    The result is float64 of length ``sum(p.size) + 1``. Summing these vectors over
    orgs (by the secure sum) yields ``[sum_i w_i delta_i, sum_i w_i]``, so the
    weighted mean is computed without any org revealing its own weight.

    Raises :class:`StrategyConfigError` for a negative or non-finite weight.
    """
    w = float(weight)
    if not math.isfinite(w) or w < 0:
        raise StrategyConfigError(f"weight must be finite and >= 0, got {weight!r}")
    parts = [np.asarray(u, dtype=np.float64).ravel() * w for u in update]
    parts.append(np.array([w], dtype=np.float64))
    return np.concatenate(parts)


def unpack_weighted(vec: np.ndarray, shapes: Sequence[Sequence[int]]) -> tuple[NDArrays, float]:
    """Split a (summed) packed vector into ``(updates, total_weight)``.

    ``shapes`` is the layout of the model (:func:`params_shapes`); raises
    :class:`ShapeMismatchError` when ``vec`` does not have ``sum(sizes) + 1`` entries.
    """
    flat = np.asarray(vec, dtype=np.float64).ravel()
    sizes = [math.prod(s) for s in shapes]
    expected = sum(sizes) + 1
    if flat.size != expected:
        raise ShapeMismatchError(
            f"packed vector has {flat.size} entries, the layout needs {expected}"
        )
    out: NDArrays = []
    offset = 0
    for shape, size in zip(shapes, sizes, strict=True):
        out.append(flat[offset : offset + size].reshape(tuple(shape)).copy())
        offset += size
    return out, float(flat[-1])


# --------------------------------------------------------------------------- configs


def _check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise StrategyConfigError(f"{name} must be finite and {bound}, got {value!r}")


def _check_unit(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0.0 <= value < 1.0):
        raise StrategyConfigError(f"{name} must be in [0, 1), got {value!r}")


@dataclass(frozen=True)
class FedAvgConfig:
    """FedAvg (McMahan et al. 2017).

    server_lr: step size on the weighted mean delta; 1.0 gives the weighted average
        of the local models.
    """

    server_lr: float = 1.0

    def __post_init__(self) -> None:
        _check_positive("server_lr", self.server_lr)


@dataclass(frozen=True)
class FedProxConfig:
    """FedProx (Li et al. 2020, eq. 2).

    mu: proximal coefficient of ``mu/2 ||w - w_global||^2`` added to every local loss.
    server_lr: as in :class:`FedAvgConfig`.
    """

    mu: float = 0.01
    server_lr: float = 1.0

    def __post_init__(self) -> None:
        _check_positive("mu", self.mu, allow_zero=True)
        _check_positive("server_lr", self.server_lr)


@dataclass(frozen=True)
class FedAdamConfig:
    """FedAdam (Reddi et al. 2021, Algorithm 2).

    eta: server learning rate. beta_1, beta_2: moment decays. tau: adaptivity
    (added to ``sqrt(v)``). bias_correction: scale ``eta`` by
    ``sqrt(1 - beta_2^t) / (1 - beta_1^t)`` at round ``t`` (Kingma & Ba 2015,
    Section 2), as Flower's FedAdam does.
    """

    eta: float = 0.1
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-9
    bias_correction: bool = True

    def __post_init__(self) -> None:
        _check_positive("eta", self.eta)
        _check_unit("beta_1", self.beta_1)
        _check_unit("beta_2", self.beta_2)
        _check_positive("tau", self.tau)


@dataclass(frozen=True)
class FedYogiConfig:
    """FedYogi (Reddi et al. 2021, Algorithm 2): fields as :class:`FedAdamConfig`."""

    eta: float = 0.01
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3

    def __post_init__(self) -> None:
        _check_positive("eta", self.eta)
        _check_unit("beta_1", self.beta_1)
        _check_unit("beta_2", self.beta_2)
        _check_positive("tau", self.tau)


@dataclass(frozen=True)
class FedAdagradConfig:
    """FedAdagrad (Reddi et al. 2021, Algorithm 2).

    eta: server learning rate. beta_1: momentum of the first moment (0.0 as in
    Flower's FedAdagrad). tau: adaptivity.
    """

    eta: float = 0.1
    beta_1: float = 0.0
    tau: float = 1e-9

    def __post_init__(self) -> None:
        _check_positive("eta", self.eta)
        _check_unit("beta_1", self.beta_1)
        _check_positive("tau", self.tau)


@dataclass(frozen=True)
class FedAvgMConfig:
    """FedAvgM (Hsu et al. 2019): server SGD with momentum on ``-delta``.

    server_lr: server step size. momentum: server momentum ``beta``.
    nesterov: use Nesterov's look-ahead (torch.optim.SGD convention).
    """

    server_lr: float = 1.0
    momentum: float = 0.9
    nesterov: bool = False

    def __post_init__(self) -> None:
        _check_positive("server_lr", self.server_lr)
        _check_unit("momentum", self.momentum)


@dataclass(frozen=True)
class DiLoCoConfig:
    """DiLoCo (Douillard et al. 2023, Algorithm 1).

    outer_lr: outer learning rate (0.7 in the paper). outer_momentum: Nesterov
    momentum (0.9 in the paper). inner_steps: ``H``, local AdamW steps per round.
    inner_lr, inner_weight_decay: the inner AdamW's hyper-parameters (betas are
    torch's defaults, as in the local job).
    """

    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    inner_steps: int = 500
    inner_lr: float = 4e-4
    inner_weight_decay: float = 0.1

    def __post_init__(self) -> None:
        _check_positive("outer_lr", self.outer_lr)
        _check_unit("outer_momentum", self.outer_momentum)
        if isinstance(self.inner_steps, bool) or not (
            isinstance(self.inner_steps, int) and self.inner_steps >= 1
        ):
            raise StrategyConfigError(f"inner_steps must be an int >= 1, got {self.inner_steps!r}")
        _check_positive("inner_lr", self.inner_lr)
        _check_positive("inner_weight_decay", self.inner_weight_decay, allow_zero=True)


def _config_from_mapping(cls: type[Any], values: Mapping[str, Any]) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise StrategyConfigError(
            f"unknown {cls.__name__} keys {unknown}; known keys are {sorted(names)}"
        )
    try:
        return cls(**values)
    except TypeError as exc:  # wrong value types reaching arithmetic checks
        raise StrategyConfigError(f"invalid {cls.__name__}: {exc}") from exc


# --------------------------------------------------------------------------- strategies


def _as_f64(arrays: Iterable[np.ndarray]) -> NDArrays:
    return [np.asarray(a, dtype=np.float64) for a in arrays]


class Strategy(ABC):
    """A federated strategy: a pure step from the secure sum to the next global model.

    Subclasses set :attr:`name` and :attr:`config_cls`, and implement
    :meth:`_apply` on the weighted mean delta. Every node holding the same state and
    the same sum computes bit-identical parameters.
    """

    name: ClassVar[str]
    config_cls: ClassVar[type[Any]]

    def __init__(self, config: Any = None) -> None:
        if config is None:
            config = self.config_cls()
        if not isinstance(config, self.config_cls):
            raise StrategyConfigError(
                f"{type(self).__name__} takes a {self.config_cls.__name__}, "
                f"got {type(config).__name__}"
            )
        self.config = config
        self.round = 0

    # -- the step ------------------------------------------------------------------

    def step(
        self,
        global_params: Sequence[np.ndarray],
        summed_update: Sequence[np.ndarray],
        summed_weight: float,
    ) -> NDArrays:
        """Next global parameters from ``sum_i w_i delta_i`` and ``sum_i w_i``.

        ``global_params`` is the model every node held at the start of the round;
        ``summed_update`` and ``summed_weight`` come out of the secure sum. The result
        has the dtypes of ``global_params``; inputs are never modified.
        """
        if len(global_params) != len(summed_update):
            raise ShapeMismatchError(
                f"{len(global_params)} parameter tensors but {len(summed_update)} update tensors"
            )
        for i, (p, u) in enumerate(zip(global_params, summed_update, strict=True)):
            if np.shape(p) != np.shape(u):
                raise ShapeMismatchError(
                    f"tensor {i}: parameters {np.shape(p)} but update {np.shape(u)}"
                )
        w = float(summed_weight)
        if not (math.isfinite(w) and w > 0):
            raise EmptyAggregateError(
                f"summed weight is {summed_weight!r}; no contribution to average"
            )
        x = _as_f64(global_params)
        delta = [u / w for u in _as_f64(summed_update)]
        self.round += 1
        new = self._apply(x, delta)
        return [
            n.astype(np.asarray(p).dtype, copy=False)
            for n, p in zip(new, global_params, strict=True)
        ]

    def step_packed(self, global_params: Sequence[np.ndarray], summed_vec: np.ndarray) -> NDArrays:
        """:meth:`step` on the decoded secure sum of :func:`pack_weighted` vectors."""
        summed, weight = unpack_weighted(summed_vec, params_shapes(global_params))
        return self.step(global_params, summed, weight)

    @abstractmethod
    def _apply(self, x: NDArrays, delta: NDArrays) -> NDArrays:
        """New float64 parameters from float64 ``x`` and mean delta (round already counted)."""

    # -- what the local job needs ---------------------------------------------------

    def local_config(self) -> dict[str, Any]:
        """Settings the local job must apply, named as ``LocalJobSpec`` fields
        (``prox_mu`` for FedProx; ``optimizer``, ``local_steps``, ``lr``,
        ``weight_decay`` for DiLoCo's inner loop)."""
        return {}

    # -- state ----------------------------------------------------------------------

    def _arrays(self) -> dict[str, NDArrays | None]:
        return {}

    def _set_arrays(self, arrays: Mapping[str, NDArrays | None]) -> None:
        del arrays

    def state_dict(self) -> dict[str, Any]:
        """The strategy's complete state: name, config, round and float64 buffers."""
        return {
            "name": self.name,
            "config": dataclasses.asdict(self.config),
            "round": self.round,
            "arrays": {
                k: None if v is None else [a.copy() for a in v] for k, v in self._arrays().items()
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; refuses another strategy or config."""
        if state.get("name") != self.name:
            raise StateMismatchError(f"state of {state.get('name')!r} given to {self.name!r}")
        config = _config_from_mapping(self.config_cls, dict(state.get("config", {})))
        if config != self.config:
            raise StateMismatchError(
                f"state was saved with config {config!r}, this strategy has {self.config!r}"
            )
        rnd = state.get("round")
        if not isinstance(rnd, int) or rnd < 0:
            raise StateMismatchError(f"invalid round {rnd!r} in state")
        arrays = dict(state.get("arrays", {}))
        expected = set(self._arrays())
        if set(arrays) != expected:
            raise StateMismatchError(
                f"state buffers {sorted(arrays)} do not match {sorted(expected)}"
            )
        self.round = rnd
        self._set_arrays(
            {
                k: None if v is None else _as_f64(np.array(a, copy=True) for a in v)
                for k, v in arrays.items()
            }
        )


def _zeros_like(arrays: NDArrays) -> NDArrays:
    return [np.zeros_like(a) for a in arrays]


def _check_buffer(name: str, buf: NDArrays, like: NDArrays) -> None:
    if [b.shape for b in buf] != [a.shape for a in like]:
        raise ShapeMismatchError(f"{name} buffer layout differs from the model's")


class FedAvg(Strategy):
    """Weighted averaging (McMahan et al. 2017, Algorithm 1): ``x + server_lr * delta``."""

    name = "fedavg"
    config_cls = FedAvgConfig
    config: FedAvgConfig

    def _apply(self, x: NDArrays, delta: NDArrays) -> NDArrays:
        lr = self.config.server_lr
        return [p + lr * d for p, d in zip(x, delta, strict=True)]


class FedProx(Strategy):
    """FedProx (Li et al. 2020): FedAvg aggregation; the proximal term acts locally."""

    name = "fedprox"
    config_cls = FedProxConfig
    config: FedProxConfig

    def _apply(self, x: NDArrays, delta: NDArrays) -> NDArrays:
        lr = self.config.server_lr
        return [p + lr * d for p, d in zip(x, delta, strict=True)]

    def local_config(self) -> dict[str, Any]:
        return {"prox_mu": self.config.mu}


class _FedOpt(Strategy):
    """Shared state of the adaptive server optimizers (Reddi et al. 2021, Algorithm 2)."""

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.m: NDArrays | None = None
        self.v: NDArrays | None = None

    def _moments(self, delta: NDArrays, beta_1: float) -> tuple[NDArrays, NDArrays]:
        if self.m is None:
            self.m = _zeros_like(delta)
        if self.v is None:
            self.v = _zeros_like(delta)
        _check_buffer("m", self.m, delta)
        _check_buffer("v", self.v, delta)
        self.m = [beta_1 * m + (1.0 - beta_1) * d for m, d in zip(self.m, delta, strict=True)]
        return self.m, self.v

    def _arrays(self) -> dict[str, NDArrays | None]:
        return {"m": self.m, "v": self.v}

    def _set_arrays(self, arrays: Mapping[str, NDArrays | None]) -> None:
        self.m = arrays["m"]
        self.v = arrays["v"]


class FedAdam(_FedOpt):
    """FedAdam: ``m = b1 m + (1-b1) d``, ``v = b2 v + (1-b2) d^2``,
    ``x + eta_t m / (sqrt(v) + tau)`` (Reddi et al. 2021, Algorithm 2)."""

    name = "fedadam"
    config_cls = FedAdamConfig
    config: FedAdamConfig

    def _apply(self, x: NDArrays, delta: NDArrays) -> NDArrays:
        c = self.config
        m, v = self._moments(delta, c.beta_1)
        self.v = v = [
            c.beta_2 * vv + (1.0 - c.beta_2) * d * d for vv, d in zip(v, delta, strict=True)
        ]
        eta = c.eta
        if c.bias_correction:
            t = float(self.round)
            eta = c.eta * math.sqrt(1.0 - c.beta_2**t) / (1.0 - c.beta_1**t)
        return [p + eta * mm / (np.sqrt(vv) + c.tau) for p, mm, vv in zip(x, m, v, strict=True)]


class FedYogi(_FedOpt):
    """FedYogi: ``v = v - (1-b2) d^2 sign(v - d^2)`` (Reddi et al. 2021, Algorithm 2;
    Zaheer et al. 2018)."""

    name = "fedyogi"
    config_cls = FedYogiConfig
    config: FedYogiConfig

    def _apply(self, x: NDArrays, delta: NDArrays) -> NDArrays:
        c = self.config
        m, v = self._moments(delta, c.beta_1)
        self.v = v = [
            vv - (1.0 - c.beta_2) * d * d * np.sign(vv - d * d)
            for vv, d in zip(v, delta, strict=True)
        ]
        return [p + c.eta * mm / (np.sqrt(vv) + c.tau) for p, mm, vv in zip(x, m, v, strict=True)]


class FedAdagrad(_FedOpt):
    """FedAdagrad: ``v = v + d^2`` (Reddi et al. 2021, Algorithm 2)."""

    name = "fedadagrad"
    config_cls = FedAdagradConfig
    config: FedAdagradConfig

    def _apply(self, x: NDArrays, delta: NDArrays) -> NDArrays:
        c = self.config
        m, v = self._moments(delta, c.beta_1)
        self.v = v = [vv + d * d for vv, d in zip(v, delta, strict=True)]
        return [p + c.eta * mm / (np.sqrt(vv) + c.tau) for p, mm, vv in zip(x, m, v, strict=True)]


def _momentum_sgd(
    x: NDArrays,
    grad: NDArrays,
    buf: NDArrays | None,
    lr: float,
    momentum: float,
    nesterov: bool,
) -> tuple[NDArrays, NDArrays]:
    """One step of SGD with momentum in torch.optim.SGD's convention (dampening 0):
    ``b = mu b + g`` (``b = g`` at the first step), direction ``g + mu b`` with
    Nesterov else ``b``, and ``x - lr * direction``."""
    if buf is None:
        new_buf = [g.copy() for g in grad]
    else:
        _check_buffer("momentum", buf, grad)
        new_buf = [momentum * b + g for b, g in zip(buf, grad, strict=True)]
    if nesterov:
        direction = [g + momentum * b for g, b in zip(grad, new_buf, strict=True)]
    else:
        direction = new_buf
    return [p - lr * d for p, d in zip(x, direction, strict=True)], new_buf


class _OuterMomentum(Strategy):
    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.momentum_buffer: NDArrays | None = None

    def _arrays(self) -> dict[str, NDArrays | None]:
        return {"momentum_buffer": self.momentum_buffer}

    def _set_arrays(self, arrays: Mapping[str, NDArrays | None]) -> None:
        self.momentum_buffer = arrays["momentum_buffer"]


class FedAvgM(_OuterMomentum):
    """FedAvgM (Hsu et al. 2019): momentum SGD on the pseudo-gradient ``-delta``,
    as Flower's FedAvgM with ``server_momentum > 0``."""

    name = "fedavgm"
    config_cls = FedAvgMConfig
    config: FedAvgMConfig

    def _apply(self, x: NDArrays, delta: NDArrays) -> NDArrays:
        c = self.config
        grad = [-d for d in delta]
        new, self.momentum_buffer = _momentum_sgd(
            x, grad, self.momentum_buffer, c.server_lr, c.momentum, c.nesterov
        )
        return new


class DiLoCo(_OuterMomentum):
    """DiLoCo (Douillard et al. 2023, Algorithm 1): the outer step is SGD with
    Nesterov momentum on the outer gradient ``x - mean(local) = -delta``; the inner
    optimizer (AdamW for ``inner_steps`` steps) is given to the local job by
    :meth:`local_config` and :func:`build_inner_optimizer`."""

    name = "diloco"
    config_cls = DiLoCoConfig
    config: DiLoCoConfig

    def _apply(self, x: NDArrays, delta: NDArrays) -> NDArrays:
        c = self.config
        grad = [-d for d in delta]
        new, self.momentum_buffer = _momentum_sgd(
            x, grad, self.momentum_buffer, c.outer_lr, c.outer_momentum, True
        )
        return new

    def local_config(self) -> dict[str, Any]:
        c = self.config
        return {
            "optimizer": "adamw",
            "local_steps": c.inner_steps,
            "lr": c.inner_lr,
            "weight_decay": c.inner_weight_decay,
        }


STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (FedAvg, FedProx, FedAdam, FedYogi, FedAdagrad, FedAvgM, DiLoCo)
}


def make_strategy(name: str, options: Mapping[str, Any] | None = None) -> Strategy:
    """Build a strategy by name (``fedavg``, ``fedprox``, ``fedadam``, ``fedyogi``,
    ``fedadagrad``, ``fedavgm``, ``diloco``); unknown names or option keys are errors."""
    try:
        cls = STRATEGIES[name.lower()]
    except KeyError:
        raise StrategyConfigError(
            f"unknown strategy {name!r}; choose one of {sorted(STRATEGIES)}"
        ) from None
    return cls(_config_from_mapping(cls.config_cls, dict(options or {})))


# --------------------------------------------------------------------------- state bytes


def state_to_bytes(state: Mapping[str, Any]) -> bytes:
    """Canonical bytes of a :meth:`Strategy.state_dict`: an ``.npz`` archive (no pickle)
    with the JSON header under ``header`` and every buffer tensor as ``NAME/i``."""
    header = {k: v for k, v in state.items() if k != "arrays"}
    layout: dict[str, int | None] = {}
    tensors: dict[str, Any] = {}
    for key, arrays in dict(state.get("arrays", {})).items():
        layout[key] = None if arrays is None else len(arrays)
        for i, a in enumerate(arrays or []):
            tensors[f"{key}/{i}"] = np.asarray(a, dtype=np.float64)
    header["layout"] = layout
    blob = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    buf = io.BytesIO()
    tensors["header"] = np.frombuffer(blob, dtype=np.uint8)
    np.savez(buf, **tensors)
    return buf.getvalue()


def state_from_bytes(data: bytes) -> dict[str, Any]:
    """Inverse of :func:`state_to_bytes`; raises :class:`StateMismatchError` on bad input."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            header = json.loads(bytes(z["header"]).decode())
            layout = header.pop("layout")
            arrays: dict[str, NDArrays | None] = {}
            for key, count in layout.items():
                arrays[key] = None if count is None else [z[f"{key}/{i}"] for i in range(count)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StateMismatchError(f"not a strategy state: {exc}") from exc
    header["arrays"] = arrays
    return dict(header)


# --------------------------------------------------------------------------- local-job helpers


def proximal_term(
    model_params: Iterable[torch.Tensor],
    global_params: Iterable[torch.Tensor],
    mu: float,
) -> torch.Tensor:
    """FedProx's proximal term ``mu/2 * sum ||w - w_global||^2`` (Li et al. 2020, eq. 2).

    Add it to the local loss; ``global_params`` are detached from the graph.
    """
    import torch

    model_list = list(model_params)
    global_list = list(global_params)
    if len(model_list) != len(global_list):
        raise ShapeMismatchError(
            f"{len(model_list)} model tensors but {len(global_list)} global tensors"
        )
    if not model_list:
        return torch.zeros(())
    total = torch.zeros((), dtype=model_list[0].dtype, device=model_list[0].device)
    for w, g in zip(model_list, global_list, strict=True):
        total = total + torch.sum((w - g.detach().to(w.dtype)) ** 2)
    return (mu / 2.0) * total


def build_inner_optimizer(
    parameters: Iterable[torch.nn.Parameter], config: DiLoCoConfig
) -> torch.optim.Optimizer:
    """DiLoCo's inner optimizer: AdamW with the configured lr, betas and weight decay."""
    import torch

    return torch.optim.AdamW(parameters, lr=config.inner_lr, weight_decay=config.inner_weight_decay)
