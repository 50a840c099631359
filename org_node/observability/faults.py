"""Fault localization: each node scores its peers from what its own round engine saw.

A decentralized round has no coordinator that could say who made it slow or failed
it; every node can only reason from its own observations
(:class:`~coordinator_free.rounds.RoundObservation`). :class:`PeerScorer` turns them
into evidence against peers, per round:

* **timeouts** — a peer's message of a stage never arrived (``missing``), or a send to
  it failed (``unreachable``);
* **late stage arrivals** — a peer's message of a stage that every participant sends
  at once (``ready``, ``share``, ``unmask``) arrived well after the others' (compared
  with the median of the peers' arrivals and this node's own sending time, so a slow
  network makes nobody late);
* **refused messages** — this node refused the peer's message (replayed, stale,
  malformed, or rejected by the masked-sum session);
* **hash disagreements** — the peer announced another member list or model hash;
* **ring blame and dropouts** — the ring broke and blamed the peer, or the round's
  survivors left it out;
* **throughput drift** — the ring from the peer carried bytes markedly slower than the
  same link did in earlier rounds.

:meth:`PeerScorer.culprit` names the peer with the most weighted evidence in a round
(when it reaches ``min_score`` and leads the next peer), with that evidence as text.
The scorer is pure: no clock, no I/O; feeding it the same observations gives the same
answer, which is what the unit tests and the simulator tests rely on.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from coordinator_free.rounds import RoundObservation
from coordinator_free.validate import check_integer, check_number, field_error

__all__ = ["FaultConfig", "PeerScorer", "Suspect"]

# stages every participant broadcasts at the same point of its round: arrival times
# are comparable across peers (ring, token and model messages arrive in ring order or
# after local work, so they are not)
_SIMULTANEOUS = frozenset({"ready", "share", "unmask"})

# weights of one piece of evidence, by observation kind
_WEIGHTS: dict[str, float] = {
    "missing": 3.0,
    "unreachable": 2.0,
    "refused": 2.0,
    "mismatch": 4.0,
    "suspect": 3.0,
    "dropped": 2.0,
    "left": 0.5,
}


_bad = field_error(ValueError)


@dataclass(frozen=True)
class FaultConfig:
    """How evidence is weighed.

    min_score: the least score that names a culprit.
    lead: how much more than the runner-up the culprit must score (else no culprit:
        the evidence does not single out one peer).
    late_s: an arrival this many seconds after its stage's median is late.
    late_weight: the weight of a late arrival that is ``late_s`` late (it grows with
        the delay, up to three times this).
    drift_factor: a link whose throughput falls below its own history's median
        divided by this has drifted.
    drift_weight: the weight of one drifted link.
    history: how many past throughputs of a link are kept; how many rounds are kept.
    """

    min_score: float = 2.0
    lead: float = 1.0
    late_s: float = 1.0
    late_weight: float = 1.5
    drift_factor: float = 3.0
    drift_weight: float = 1.0
    history: int = 16
    rounds: int = 64

    def __post_init__(self) -> None:
        # an infinite bound is one that never binds (e.g. min_score: never name a culprit)
        for name in ("min_score", "late_s", "late_weight", "drift_factor", "drift_weight"):
            check_number(f"FaultConfig.{name}", getattr(self, name), _bad, allow_inf=True)
        check_number("FaultConfig.lead", self.lead, _bad, open_low=False, allow_inf=True)
        if self.drift_factor <= 1:
            raise ValueError("FaultConfig.drift_factor must exceed 1")
        for name in ("history", "rounds"):
            check_integer(f"FaultConfig.{name}", getattr(self, name), _bad, low=2)


@dataclass(frozen=True)
class Suspect:
    """The likely culprit of a round: the org, its score and the evidence, as text."""

    org: str
    score: float
    evidence: list[str]
    round: int = -1
    run: str = ""

    def to_dict(self) -> dict[str, object]:
        return {
            "org": self.org,
            "score": round(self.score, 3),
            "evidence": list(self.evidence),
            "round": self.round,
            "run": self.run,
        }


@dataclass
class _Round:
    run: str
    round: int
    evidence: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    arrivals: dict[str, dict[str, float]] = field(default_factory=dict)
    begun: dict[str, float] = field(default_factory=dict)
    elapsed: float = 0.0
    failed: str = ""
    completed: bool = False

    def add(self, peer: str, weight: float, text: str) -> None:
        self.evidence.setdefault(peer, []).append((weight, text))


class PeerScorer:
    """Scores peers per round from :class:`RoundObservation` s (see the module docstring).

    ``me`` is this node's org id: observations never make it its own culprit.
    Rounds are keyed by the round number the engine observed (the protocol round).
    """

    def __init__(self, me: str, config: FaultConfig | None = None) -> None:
        self.me = me
        self.config = config or FaultConfig()
        self._rounds: dict[tuple[str, int], _Round] = {}
        self._links: dict[str, deque[float]] = {}

    def _round(self, run: str, round: int) -> _Round:
        key = (run, round)
        found = self._rounds.get(key)
        if found is None:
            found = self._rounds[key] = _Round(run, round)
            while len(self._rounds) > self.config.rounds:
                del self._rounds[min(self._rounds, key=lambda k: (k[1], k[0]))]
        return found

    def observe(self, obs: RoundObservation) -> None:
        """Take one observation into account."""
        if obs.round < 0:
            return
        rnd = self._round(obs.run, obs.round)
        if obs.kind == "failed":
            rnd.failed = f"{obs.stage}: {obs.detail}"
            return
        if obs.kind == "completed":
            rnd.completed = True
            return
        if obs.kind == "stage":
            # when this node began each stage: when it sent that stage's broadcast
            rnd.begun.setdefault(obs.stage, rnd.elapsed)
            rnd.elapsed += max(0.0, obs.seconds)
            return
        peer = obs.peer
        if not peer or peer == self.me:
            return
        if obs.kind == "arrival":
            stage = rnd.arrivals.setdefault(obs.stage, {})
            stage.setdefault(peer, obs.seconds)
            return
        if obs.kind == "link":
            self._link(rnd, peer, obs)
            return
        weight = _WEIGHTS.get(obs.kind)
        if weight is None:
            return
        rnd.add(peer, weight, _describe(obs))

    def _link(self, rnd: _Round, peer: str, obs: RoundObservation) -> None:
        if obs.seconds <= 0 or obs.bytes <= 0:
            return
        rate = obs.bytes / obs.seconds
        past = self._links.setdefault(peer, deque(maxlen=self.config.history))
        if len(past) >= 3:
            typical = statistics.median(past)
            if rate < typical / self.config.drift_factor:
                rnd.add(
                    peer,
                    self.config.drift_weight,
                    f"ring link from {peer} ran at {_rate(rate)}, its usual {_rate(typical)}",
                )
        past.append(rate)

    def _late(self, rnd: _Round) -> dict[str, list[tuple[float, str]]]:
        found: dict[str, list[tuple[float, str]]] = {}
        cfg = self.config
        for stage, seen in sorted(rnd.arrivals.items()):
            if stage not in _SIMULTANEOUS:
                continue
            samples = list(seen.values())
            if stage in rnd.begun:
                samples.append(rnd.begun[stage])
            if len(samples) < 3:
                continue
            median = statistics.median(samples)
            for peer, at in sorted(seen.items()):
                late = at - median
                if late > cfg.late_s:
                    weight = cfg.late_weight * min(3.0, late / cfg.late_s)
                    found.setdefault(peer, []).append(
                        (weight, f"its {stage} arrived {late:.2f}s after the others' (median)")
                    )
        return found

    def scores(self, run: str, round: int) -> dict[str, float]:
        """Each peer's weighted evidence in ``round`` of ``run`` (peers without any left out)."""
        rnd = self._rounds.get((run, round))
        if rnd is None:
            return {}
        return {peer: sum(w for w, _ in items) for peer, items in self._evidence(rnd).items()}

    def _evidence(self, rnd: _Round) -> dict[str, list[tuple[float, str]]]:
        merged: dict[str, list[tuple[float, str]]] = {p: list(e) for p, e in rnd.evidence.items()}
        for peer, items in self._late(rnd).items():
            merged.setdefault(peer, []).extend(items)
        return merged

    def culprit(self, round: int, run: str | None = None) -> Suspect | None:
        """The likely culprit of ``round`` (of ``run``; the newest such round of any run
        when None), or None when no peer's evidence reaches ``min_score`` and leads."""
        keys = [k for k in self._rounds if k[1] == round and (run is None or k[0] == run)]
        if not keys:
            return None
        rnd = self._rounds[keys[-1]]
        evidence = self._evidence(rnd)
        ranked = sorted(
            ((sum(w for w, _ in items), peer) for peer, items in evidence.items()),
            key=lambda x: (-x[0], x[1]),
        )
        if not ranked:
            return None
        score, peer = ranked[0]
        runner_up = ranked[1][0] if len(ranked) > 1 else 0.0
        if score < self.config.min_score or score - runner_up < self.config.lead:
            return None
        texts = _dedupe(text for _, text in sorted(evidence[peer], key=lambda x: -x[0]))
        if rnd.failed:
            texts.append(f"the round failed here at {rnd.failed}")
        return Suspect(peer, score, texts, rnd.round, rnd.run)

    def latest(self) -> Suspect | None:
        """The culprit of the newest round that has one."""
        for run, round in sorted(self._rounds, key=lambda k: (k[1], k[0]), reverse=True):
            found = self.culprit(round, run)
            if found is not None:
                return found
        return None

    def rounds(self) -> list[tuple[str, int]]:
        """The ``(run, round)`` pairs with observations, oldest first."""
        return sorted(self._rounds, key=lambda k: (k[1], k[0]))

    def failure(self, run: str, round: int) -> str:
        """Where and why ``round`` failed at this node ("" when it did not)."""
        rnd = self._rounds.get((run, round))
        return rnd.failed if rnd is not None else ""


def _describe(obs: RoundObservation) -> str:
    detail = f" ({obs.detail})" if obs.detail else ""
    what = {
        "missing": f"no {obs.stage} message from {obs.peer} in time",
        "unreachable": f"a {obs.stage} send to {obs.peer} failed",
        "refused": f"its {obs.stage} message was refused",
        "mismatch": f"it disagreed on the {obs.stage} hash",
        "suspect": f"the {obs.stage} ring broke and blamed it",
        "dropped": "it was dropped from the round's survivors",
        "left": "it left the round",
    }[obs.kind]
    return what + detail


def _rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e6:.2f} MB/s" if bytes_per_s >= 1e5 else f"{bytes_per_s:.0f} B/s"


def _dedupe(texts: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for text in texts:
        seen.setdefault(text, None)
    return list(seen)
