"""The contract every strategy keeps (:class:`Strategy`): a pure, deterministic step from
the secure sum to the next global model, and a state that round-trips exactly.

:meth:`Strategy.step` checks the layout, divides the summed update by the summed
weight and hands the weighted mean delta, in float64, to the subclass's ``_apply``;
:meth:`Strategy.state_dict` and :meth:`Strategy.load_state_dict` carry the round
counter and the subclass's buffers.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from org_node.strategies.configs import config_from_mapping
from org_node.strategies.errors import (
    EmptyAggregateError,
    ShapeMismatchError,
    StateMismatchError,
    StrategyConfigError,
)
from org_node.strategies.packing import NDArrays, params_shapes, unpack_weighted

__all__ = ["Strategy"]


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
        config = config_from_mapping(self.config_cls, dict(state.get("config", {})))
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
