"""Observability of one org node: structured logs, Prometheus stage metrics and fault
localization, all fed by the round engine's observations
(:class:`~coordinator_free.rounds.RoundObservation`).

* :mod:`org_node.observability.logging` — JSON-lines logs and cross-org correlation ids;
* :mod:`org_node.observability.metrics` — per-stage durations, bytes, retries,
  refusals and dropouts in the Prometheus text format;
* :mod:`org_node.observability.faults` — :class:`PeerScorer`, which names the likely
  culprit of a slow or failed round with its evidence;
* :class:`Observability` — the three together, plus the round timeline the dashboard
  draws.

It imports ``coordinator_free`` (the round engine's observations, the config checks)
and nothing else of ``org_node``.
"""

from __future__ import annotations

from org_node.observability.faults import FaultConfig, PeerScorer, Suspect
from org_node.observability.hub import Observability, RoundTimeline
from org_node.observability.logging import (
    ContextAdapter,
    JsonFormatter,
    configure_json_logging,
    correlation_id,
)
from org_node.observability.metrics import StageMetrics

__all__ = [
    "ContextAdapter",
    "FaultConfig",
    "JsonFormatter",
    "Observability",
    "PeerScorer",
    "RoundTimeline",
    "StageMetrics",
    "Suspect",
    "configure_json_logging",
    "correlation_id",
]
