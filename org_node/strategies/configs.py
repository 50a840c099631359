"""The configuration of each strategy: one frozen dataclass per strategy, every value
checked when it is built (:class:`StrategyConfigError` names the field), and
:func:`config_from_mapping`, which builds one from the options of a run's config."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from org_node.strategies.errors import StrategyConfigError

__all__ = [
    "DiLoCoConfig",
    "FedAdagradConfig",
    "FedAdamConfig",
    "FedAvgConfig",
    "FedAvgMConfig",
    "FedProxConfig",
    "FedYogiConfig",
    "config_from_mapping",
]


def _check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise StrategyConfigError(f"{name} must be finite and {bound}, got {value!r}")


def _check_unit(name: str, value: float) -> None:
    if not (math.isfinite(value) and 0.0 <= value < 1.0):
        raise StrategyConfigError(f"{name} must be in [0, 1), got {value!r}")


def _check_adaptive(config: FedAdamConfig | FedYogiConfig) -> None:
    """The checks of FedAdam's and FedYogi's common fields, in field order."""
    _check_positive("eta", config.eta)
    _check_unit("beta_1", config.beta_1)
    _check_unit("beta_2", config.beta_2)
    _check_positive("tau", config.tau)


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
        _check_adaptive(self)


@dataclass(frozen=True)
class FedYogiConfig:
    """FedYogi (Reddi et al. 2021, Algorithm 2): fields as :class:`FedAdamConfig`."""

    eta: float = 0.01
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3

    def __post_init__(self) -> None:
        _check_adaptive(self)


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


def config_from_mapping(cls: type[Any], values: Mapping[str, Any]) -> Any:
    """``cls(**values)``; an unknown key or a value of the wrong type is a
    :class:`StrategyConfigError`."""
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
