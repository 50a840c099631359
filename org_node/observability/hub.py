"""One node's observability: the round engine's observations, fanned out to the stage
metrics, the fault scorer, the structured log and the round timeline the dashboard
draws.

``Observability.attach(round_engine)`` registers :meth:`Observability.observe` as an
observer of :class:`~coordinator_free.rounds.RoundEngine`; everything else reads.
Thread-safe: observations arrive on the node's event loop, reads come from the admin
API's worker threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from coordinator_free.rounds import RoundEngine, RoundObservation

from org_node.observability.faults import FaultConfig, PeerScorer, Suspect
from org_node.observability.logging import correlation_id
from org_node.observability.metrics import StageMetrics

__all__ = ["Observability", "RoundTimeline"]

_LEVELS: dict[str, int] = {
    "round": logging.INFO,
    "completed": logging.INFO,
    "failed": logging.WARNING,
    "missing": logging.INFO,
    "unreachable": logging.INFO,
    "dropped": logging.INFO,
    "left": logging.INFO,
    "retry": logging.INFO,
    "refused": logging.WARNING,
    "mismatch": logging.WARNING,
    "suspect": logging.WARNING,
}
_PEER_STATUS: dict[str, str] = {
    "missing": "missing",
    "unreachable": "unreachable",
    "refused": "refused",
    "mismatch": "mismatch",
    "suspect": "suspect",
    "dropped": "dropped",
    "left": "left",
}


@dataclass
class RoundTimeline:
    """What this node saw of one round: its own stages, and each peer per stage."""

    run: str
    round: int
    started_at: float
    state: str = "running"
    seconds: float | None = None
    bytes_sent: int = 0
    failure: str = ""
    stages: list[dict[str, Any]] = field(default_factory=list)
    peers: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)

    def peer_stage(self, peer: str, stage: str) -> dict[str, Any]:
        return self.peers.setdefault(peer, {}).setdefault(stage, {"status": "ok"})

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "round": self.round,
            "started_at": self.started_at,
            "state": self.state,
            "seconds": self.seconds,
            "bytes_sent": self.bytes_sent,
            "failure": self.failure,
            "stages": [dict(s) for s in self.stages],
            "peers": {p: {s: dict(v) for s, v in st.items()} for p, st in self.peers.items()},
            "dropped": list(self.dropped),
        }


class Observability:
    """Metrics, fault scores, structured logs and the round timeline of one node.

    org_id: this node's org. federation: the federation's name (part of every
    correlation id). rounds_kept: how many rounds the timeline keeps. logger: where the
    observations are logged (``fedweave.rounds``); clock: wall time for ``started_at``.
    attempts_per_round: how many protocol rounds the run engine reserves per training
    round (``org_node.engine.ATTEMPTS``: protocol round ``r * ATTEMPTS + attempt`` is
    attempt ``attempt`` of training round ``r + 1``); 1 labels protocol rounds as is.
    """

    def __init__(
        self,
        org_id: str,
        federation: str = "",
        *,
        faults: FaultConfig | None = None,
        rounds_kept: int = 32,
        logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.time,
        attempts_per_round: int = 1,
    ) -> None:
        if rounds_kept < 1:
            raise ValueError("rounds_kept must be at least 1")
        if attempts_per_round < 1:
            raise ValueError("attempts_per_round must be at least 1")
        self.attempts_per_round = attempts_per_round
        self.org_id = org_id
        self.federation = federation
        self.metrics = StageMetrics()
        self.scorer = PeerScorer(org_id, faults)
        self.rounds_kept = rounds_kept
        self.logger = logger or logging.getLogger("fedweave.rounds")
        self.clock = clock
        self._lock = threading.Lock()
        self._timeline: dict[tuple[str, int], RoundTimeline] = {}
        self._attached: list[RoundEngine] = []

    def attach(self, engine: RoundEngine) -> None:
        """Observe ``engine``'s rounds from now on (once per engine)."""
        if any(e is engine for e in self._attached):
            return
        engine.add_observer(self.observe)
        self._attached.append(engine)
        if not self.federation:
            self.federation = engine.endpoint.federation

    def observe(self, obs: RoundObservation) -> None:
        """Take one observation: count it, score it, log it, draw it."""
        self.metrics.observe(obs)
        with self._lock:
            self.scorer.observe(obs)
            if obs.round >= 0:
                self._draw(obs)
        self._log(obs)

    def _draw(self, obs: RoundObservation) -> None:
        key = (obs.run, obs.round)
        line = self._timeline.get(key)
        if line is None:
            line = self._timeline[key] = RoundTimeline(obs.run, obs.round, self.clock())
            while len(self._timeline) > self.rounds_kept:
                del self._timeline[min(self._timeline, key=lambda k: (k[1], k[0]))]
        kind = obs.kind
        if kind == "round":
            line.started_at = self.clock()
        elif kind == "stage":
            line.stages.append(
                {"stage": obs.stage, "seconds": round(obs.seconds, 6), "bytes": obs.bytes}
            )
        elif kind == "arrival":
            cell = line.peer_stage(obs.peer, obs.stage)
            cell.setdefault("at", round(obs.seconds, 6))
            cell["bytes"] = cell.get("bytes", 0) + obs.bytes
        elif kind == "completed":
            line.state, line.seconds, line.bytes_sent = "completed", obs.seconds, obs.bytes
        elif kind == "failed":
            line.state, line.failure = "failed", f"{obs.stage}: {obs.detail}"
        elif kind in _PEER_STATUS and obs.peer:
            cell = line.peer_stage(obs.peer, obs.stage)
            cell["status"] = _PEER_STATUS[kind]
            if obs.detail:
                cell["detail"] = obs.detail
            if kind == "dropped" and obs.peer not in line.dropped:
                line.dropped.append(obs.peer)

    def _log(self, obs: RoundObservation) -> None:
        level = _LEVELS.get(obs.kind, logging.DEBUG)
        if not self.logger.isEnabledFor(level):
            return
        cid = (
            correlation_id(self.federation, obs.run, obs.round, obs.stage)
            if obs.round >= 0
            else None
        )
        self.logger.log(
            level,
            "%s %s%s",
            obs.kind,
            obs.stage,
            f" {obs.peer}" if obs.peer else "",
            extra={
                "org": self.org_id,
                "federation": self.federation,
                "run": obs.run,
                "round": obs.round,
                "stage": obs.stage,
                "peer": obs.peer or None,
                "event": obs.kind,
                "seconds": round(obs.seconds, 6),
                "bytes": obs.bytes,
                "detail": obs.detail or None,
                "correlation_id": cid,
            },
        )

    # -- reads ----------------------------------------------------------------------------

    def timeline(self, limit: int = 10) -> list[dict[str, Any]]:
        """The newest ``limit`` rounds, oldest first, each with its culprit (or None)."""
        with self._lock:
            keys = sorted(self._timeline, key=lambda k: (k[1], k[0]))[-limit:]
            out = []
            for key in keys:
                item = self._timeline[key].to_dict()
                item["label"] = self.label(key[1])
                suspect = self.scorer.culprit(key[1], key[0])
                item["culprit"] = (
                    None if suspect is None else {**suspect.to_dict(), "label": item["label"]}
                )
                out.append(item)
            return out

    def label(self, round: int) -> str:
        """A protocol round as an operator reads it: the training round, and the attempt
        when it is not the first."""
        per = self.attempts_per_round
        if per == 1:
            return str(round)
        attempt = round % per
        return f"{round // per + 1}" + (f" (attempt {attempt + 1})" if attempt else "")

    def culprit(self) -> Suspect | None:
        """The culprit of the newest round that has one."""
        with self._lock:
            return self.scorer.latest()

    def peer_scores(self, last: int = 8) -> dict[str, float]:
        """Each peer's summed evidence over the newest ``last`` rounds."""
        with self._lock:
            total: dict[str, float] = {}
            for run, rnd in self.scorer.rounds()[-last:]:
                for peer, score in self.scorer.scores(run, rnd).items():
                    total[peer] = total.get(peer, 0.0) + score
            return total

    def render_metrics(self) -> str:
        """The stage metrics in the Prometheus text format."""
        return self.metrics.render()
