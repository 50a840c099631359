"""The update rules: one :class:`~org_node.strategies.base.Strategy` subclass per
federated strategy, the registry :data:`STRATEGIES` and :func:`make_strategy`.

Three families share their step: plain averaging (FedAvg, FedProx: ``x + lr * delta``),
the adaptive server optimizers of Reddi et al. 2021 (FedAdam, FedYogi, FedAdagrad:
first moment, a second moment of their own, ``x + eta * m / (sqrt(v) + tau)``) and
outer SGD with momentum on the pseudo-gradient ``-delta`` (FedAvgM, DiLoCo).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from org_node.strategies import configs
from org_node.strategies.base import Strategy
from org_node.strategies.errors import ShapeMismatchError, StrategyConfigError
from org_node.strategies.packing import NDArrays

__all__ = [
    "STRATEGIES",
    "DiLoCo",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedProx",
    "FedYogi",
    "make_strategy",
]


def _zeros_like(arrays: NDArrays) -> NDArrays:
    return [np.zeros_like(a) for a in arrays]


def _check_buffer(name: str, buf: NDArrays, like: NDArrays) -> None:
    if [b.shape for b in buf] != [a.shape for a in like]:
        raise ShapeMismatchError(f"{name} buffer layout differs from the model's")


class _Averaging(Strategy):
    """The server step of weighted averaging: ``x + server_lr * delta``."""

    def _apply(self, x: NDArrays, delta: NDArrays) -> NDArrays:
        lr = self.config.server_lr
        return [p + lr * d for p, d in zip(x, delta, strict=True)]


class FedAvg(_Averaging):
    """Weighted averaging (McMahan et al. 2017, Algorithm 1): ``x + server_lr * delta``."""

    name = "fedavg"
    config_cls = configs.FedAvgConfig
    config: configs.FedAvgConfig


class FedProx(_Averaging):
    """FedProx (Li et al. 2020): FedAvg aggregation; the proximal term acts locally."""

    name = "fedprox"
    config_cls = configs.FedProxConfig
    config: configs.FedProxConfig

    def local_config(self) -> dict[str, Any]:
        return {"prox_mu": self.config.mu}


class _FedOpt(Strategy):
    """Shared state and step of the adaptive server optimizers (Reddi et al. 2021,
    Algorithm 2): ``m = b1 m + (1-b1) d``, the subclass's second moment ``v``, then
    ``x + eta m / (sqrt(v) + tau)``."""

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

    def _second_moment(self, v: NDArrays, delta: NDArrays) -> NDArrays:
        """The new second moment from the previous one and the mean delta."""
        raise NotImplementedError

    def _eta(self) -> float:
        """The server learning rate of this round."""
        eta: float = self.config.eta
        return eta

    def _apply(self, x: NDArrays, delta: NDArrays) -> NDArrays:
        c = self.config
        m, v = self._moments(delta, c.beta_1)
        self.v = v = self._second_moment(v, delta)
        eta = self._eta()
        return [p + eta * mm / (np.sqrt(vv) + c.tau) for p, mm, vv in zip(x, m, v, strict=True)]

    def _arrays(self) -> dict[str, NDArrays | None]:
        return {"m": self.m, "v": self.v}

    def _set_arrays(self, arrays: Mapping[str, NDArrays | None]) -> None:
        self.m = arrays["m"]
        self.v = arrays["v"]


class FedAdam(_FedOpt):
    """FedAdam: ``m = b1 m + (1-b1) d``, ``v = b2 v + (1-b2) d^2``,
    ``x + eta_t m / (sqrt(v) + tau)`` (Reddi et al. 2021, Algorithm 2)."""

    name = "fedadam"
    config_cls = configs.FedAdamConfig
    config: configs.FedAdamConfig

    def _second_moment(self, v: NDArrays, delta: NDArrays) -> NDArrays:
        b2 = self.config.beta_2
        return [b2 * vv + (1.0 - b2) * d * d for vv, d in zip(v, delta, strict=True)]

    def _eta(self) -> float:
        c = self.config
        if not c.bias_correction:
            return c.eta
        t = float(self.round)
        eta: float = c.eta * math.sqrt(1.0 - c.beta_2**t) / (1.0 - c.beta_1**t)
        return eta


class FedYogi(_FedOpt):
    """FedYogi: ``v = v - (1-b2) d^2 sign(v - d^2)`` (Reddi et al. 2021, Algorithm 2;
    Zaheer et al. 2018)."""

    name = "fedyogi"
    config_cls = configs.FedYogiConfig
    config: configs.FedYogiConfig

    def _second_moment(self, v: NDArrays, delta: NDArrays) -> NDArrays:
        b2 = self.config.beta_2
        return [
            vv - (1.0 - b2) * d * d * np.sign(vv - d * d) for vv, d in zip(v, delta, strict=True)
        ]


class FedAdagrad(_FedOpt):
    """FedAdagrad: ``v = v + d^2`` (Reddi et al. 2021, Algorithm 2)."""

    name = "fedadagrad"
    config_cls = configs.FedAdagradConfig
    config: configs.FedAdagradConfig

    def _second_moment(self, v: NDArrays, delta: NDArrays) -> NDArrays:
        return [vv + d * d for vv, d in zip(v, delta, strict=True)]


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
    """Outer SGD with momentum on the pseudo-gradient ``-delta``, with the
    ``(lr, momentum, nesterov)`` the subclass's :meth:`_outer` gives."""

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.momentum_buffer: NDArrays | None = None

    def _outer(self) -> tuple[float, float, bool]:
        """The outer step's learning rate, momentum and whether it is Nesterov's."""
        raise NotImplementedError

    def _apply(self, x: NDArrays, delta: NDArrays) -> NDArrays:
        lr, momentum, nesterov = self._outer()
        grad = [-d for d in delta]
        new, self.momentum_buffer = _momentum_sgd(
            x, grad, self.momentum_buffer, lr, momentum, nesterov
        )
        return new

    def _arrays(self) -> dict[str, NDArrays | None]:
        return {"momentum_buffer": self.momentum_buffer}

    def _set_arrays(self, arrays: Mapping[str, NDArrays | None]) -> None:
        self.momentum_buffer = arrays["momentum_buffer"]


class FedAvgM(_OuterMomentum):
    """FedAvgM (Hsu et al. 2019): momentum SGD on the pseudo-gradient ``-delta``,
    as Flower's FedAvgM with ``server_momentum > 0``."""

    name = "fedavgm"
    config_cls = configs.FedAvgMConfig
    config: configs.FedAvgMConfig

    def _outer(self) -> tuple[float, float, bool]:
        c = self.config
        return c.server_lr, c.momentum, c.nesterov


class DiLoCo(_OuterMomentum):
    """DiLoCo (Douillard et al. 2023, Algorithm 1): the outer step is SGD with
    Nesterov momentum on the outer gradient ``x - mean(local) = -delta``; the inner
    optimizer (AdamW for ``inner_steps`` steps) is given to the local job by
    :meth:`local_config` and :func:`~org_node.strategies.local.build_inner_optimizer`."""

    name = "diloco"
    config_cls = configs.DiLoCoConfig
    config: configs.DiLoCoConfig

    def _outer(self) -> tuple[float, float, bool]:
        c = self.config
        return c.outer_lr, c.outer_momentum, True

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
    return cls(configs.config_from_mapping(cls.config_cls, dict(options or {})))
