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

What it owns, a module each: the errors (``errors``), the packed secure vector
(``packing``), the strategies' configurations (``configs``), the step contract and its
state (``base``), the update rules and the registry (``algorithms``), the state's bytes
(``state``) and what the local job takes from a strategy (``local``).

What it may import: numpy, and torch in ``local`` on use only; nothing else of
``org_node``, nor ``coordinator_free``, ``secure_agg`` or ``api``. Inside the package the
modules form layers (``pyproject.toml`` holds the import-linter contract): ``algorithms``;
``base``; ``local`` and ``state``; ``configs``; ``packing``; ``errors``.
"""

from __future__ import annotations

from org_node.strategies.algorithms import (
    STRATEGIES,
    DiLoCo,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedProx,
    FedYogi,
    make_strategy,
)
from org_node.strategies.base import Strategy
from org_node.strategies.configs import (
    DiLoCoConfig,
    FedAdagradConfig,
    FedAdamConfig,
    FedAvgConfig,
    FedAvgMConfig,
    FedProxConfig,
    FedYogiConfig,
)
from org_node.strategies.errors import (
    EmptyAggregateError,
    ShapeMismatchError,
    StateMismatchError,
    StrategyConfigError,
    StrategyError,
)
from org_node.strategies.local import build_inner_optimizer, proximal_term
from org_node.strategies.packing import pack_weighted, params_shapes, unpack_weighted
from org_node.strategies.state import state_from_bytes, state_to_bytes

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
