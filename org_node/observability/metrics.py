"""Prometheus metrics of the round engine's stages, in the text exposition format 0.0.4.

:class:`StageMetrics` folds :class:`~coordinator_free.rounds.RoundObservation` s into
counters and histograms and renders them as text (no client library: the format is
simple, https://prometheus.io/docs/instrumenting/exposition_formats/). The admin API's
``/metrics`` route appends :meth:`StageMetrics.render` to its own lines.

Families (every label value is escaped; peer org ids come from the manifest but are
still treated as untrusted text):

* ``fedweave_stage_duration_seconds{stage}`` — histogram of this node's stage times;
* ``fedweave_stage_bytes_sent_total{stage}`` — payload bytes this node sent per stage;
* ``fedweave_stage_retries_total{stage}`` — stages tried again (ready re-sends, ring
  attempts);
* ``fedweave_refusals_total{stage,peer}`` — messages refused, by stage and peer;
* ``fedweave_stale_messages_total{stage}`` — messages for a round already closed, or
  second copies of one (a peer finished first, a send retried: late, not wrong);
* ``fedweave_dropouts_total{peer}`` — rounds a peer was dropped from;
* ``fedweave_peer_timeouts_total{stage,peer}`` — messages that never arrived, sends
  that failed;
* ``fedweave_hash_mismatches_total{stage,peer}``;
* ``fedweave_peer_bytes_received_total{peer}`` — round-message payload bytes received;
* ``fedweave_rounds_total{outcome}`` — rounds completed or failed here;
* ``fedweave_rounds_masks_prepared_total`` — completed rounds whose masks were
  expanded before they started (while the update trained);
* ``fedweave_round_duration_seconds`` — histogram of completed rounds.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Iterable, Sequence

from coordinator_free.rounds import MASKS_PREPARED, RoundObservation

__all__ = ["DEFAULT_BUCKETS", "Histogram", "StageMetrics", "escape_label"]

DEFAULT_BUCKETS: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


def escape_label(value: str) -> str:
    """A label value as the text format wants it: ``\\``, ``"`` and newlines escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    inner = ",".join(f'{n}="{escape_label(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + inner + "}"


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return f"{value:.17g}"


class Histogram:
    """A Prometheus histogram with one label set per key (cumulative buckets)."""

    def __init__(self, buckets: Sequence[float] = DEFAULT_BUCKETS) -> None:
        if not buckets or list(buckets) != sorted(set(buckets)):
            raise ValueError("histogram buckets must be distinct and increasing")
        self.buckets = tuple(float(b) for b in buckets)
        self._counts: dict[tuple[str, ...], list[int]] = {}
        self._sums: dict[tuple[str, ...], float] = {}

    def observe(self, key: tuple[str, ...], value: float) -> None:
        counts = self._counts.setdefault(key, [0] * (len(self.buckets) + 1))
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                counts[i] += 1
        counts[-1] += 1
        self._sums[key] = self._sums.get(key, 0.0) + value

    def count(self, key: tuple[str, ...]) -> int:
        counts = self._counts.get(key)
        return counts[-1] if counts else 0

    def lines(self, name: str, label_names: Sequence[str]) -> list[str]:
        out: list[str] = []
        for key in sorted(self._counts):
            counts = self._counts[key]
            for bound, n in zip((*self.buckets, math.inf), counts, strict=True):
                labels = _labels([*label_names, "le"], [*key, _num(bound)])
                out.append(f"{name}_bucket{labels} {n}")
            plain = _labels(label_names, key)
            out.append(f"{name}_sum{plain} {_num(self._sums[key])}")
            out.append(f"{name}_count{plain} {counts[-1]}")
        return out


class StageMetrics:
    """Counters and histograms of the round engine's stages (see the module docstring).

    Thread-safe: observations come from the node's event loop, ``render`` from the
    API's worker threads.
    """

    def __init__(self, buckets: Sequence[float] = DEFAULT_BUCKETS) -> None:
        self._lock = threading.Lock()
        self.stage_seconds = Histogram(buckets)
        self.round_seconds = Histogram(buckets)
        self.bytes_sent: Counter[tuple[str, ...]] = Counter()
        self.retries: Counter[tuple[str, ...]] = Counter()
        self.refusals: Counter[tuple[str, ...]] = Counter()
        self.dropouts: Counter[tuple[str, ...]] = Counter()
        self.timeouts: Counter[tuple[str, ...]] = Counter()
        self.mismatches: Counter[tuple[str, ...]] = Counter()
        self.bytes_received: Counter[tuple[str, ...]] = Counter()
        self.rounds: Counter[tuple[str, ...]] = Counter()
        self.stale: Counter[tuple[str, ...]] = Counter()
        self.prepared: Counter[tuple[str, ...]] = Counter()

    def observe(self, obs: RoundObservation) -> None:
        """Count one observation."""
        with self._lock:
            kind = obs.kind
            if kind == "stage":
                self.stage_seconds.observe((obs.stage,), obs.seconds)
                self.bytes_sent[(obs.stage,)] += obs.bytes
            elif kind == "retry":
                self.retries[(obs.stage,)] += 1
            elif kind == "refused":
                self.refusals[(obs.stage, obs.peer)] += 1
            elif kind == "stale":
                self.stale[(obs.stage,)] += 1
            elif kind == "dropped":
                self.dropouts[(obs.peer,)] += 1
            elif kind in ("missing", "unreachable"):
                self.timeouts[(obs.stage, obs.peer)] += 1
            elif kind == "mismatch":
                self.mismatches[(obs.stage, obs.peer)] += 1
            elif kind == "arrival":
                self.bytes_received[(obs.peer,)] += obs.bytes
            elif kind == "completed":
                self.rounds[("completed",)] += 1
                self.round_seconds.observe((), obs.seconds)
                if obs.detail == MASKS_PREPARED:
                    self.prepared[()] += 1
            elif kind == "failed":
                self.rounds[("failed",)] += 1

    def peer_bytes_received(self) -> dict[str, int]:
        """Round-message payload bytes received, by peer."""
        with self._lock:
            return {k[0]: v for k, v in self.bytes_received.items()}

    def render(self) -> str:
        """Every family in the Prometheus text format (ends with a newline)."""
        with self._lock:
            lines: list[str] = []
            self._histogram(
                lines,
                "fedweave_stage_duration_seconds",
                "Seconds this node spent in each round stage.",
                self.stage_seconds,
                ("stage",),
            )
            self._histogram(
                lines,
                "fedweave_round_duration_seconds",
                "Seconds of each round completed here.",
                self.round_seconds,
                (),
            )
            counters: Iterable[tuple[str, str, Counter[tuple[str, ...]], tuple[str, ...]]] = (
                (
                    "fedweave_stage_bytes_sent_total",
                    "Payload bytes this node sent, by stage.",
                    self.bytes_sent,
                    ("stage",),
                ),
                (
                    "fedweave_stage_retries_total",
                    "Stages tried again (ready re-sends, ring attempts).",
                    self.retries,
                    ("stage",),
                ),
                (
                    "fedweave_refusals_total",
                    "Round messages refused, by stage and peer.",
                    self.refusals,
                    ("stage", "peer"),
                ),
                (
                    "fedweave_stale_messages_total",
                    "Round messages late (round closed) or repeated (retried): not wrong.",
                    self.stale,
                    ("stage",),
                ),
                (
                    "fedweave_dropouts_total",
                    "Rounds each peer was dropped from.",
                    self.dropouts,
                    ("peer",),
                ),
                (
                    "fedweave_peer_timeouts_total",
                    "Peer messages that never arrived and sends to peers that failed.",
                    self.timeouts,
                    ("stage", "peer"),
                ),
                (
                    "fedweave_hash_mismatches_total",
                    "Member-list or model hashes that differed from this node's.",
                    self.mismatches,
                    ("stage", "peer"),
                ),
                (
                    "fedweave_peer_bytes_received_total",
                    "Round-message payload bytes received, by peer.",
                    self.bytes_received,
                    ("peer",),
                ),
                (
                    "fedweave_rounds_total",
                    "Rounds this node took part in, by outcome.",
                    self.rounds,
                    ("outcome",),
                ),
                (
                    "fedweave_rounds_masks_prepared_total",
                    "Completed rounds whose masks were expanded before they started.",
                    self.prepared,
                    (),
                ),
            )
            for name, help_, counter, label_names in counters:
                lines.append(f"# HELP {name} {help_}")
                lines.append(f"# TYPE {name} counter")
                for key in sorted(counter):
                    lines.append(f"{name}{_labels(label_names, key)} {counter[key]}")
            return "\n".join(lines) + "\n"

    @staticmethod
    def _histogram(
        lines: list[str], name: str, help_: str, hist: Histogram, label_names: Sequence[str]
    ) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} histogram")
        lines.extend(hist.lines(name, label_names))
