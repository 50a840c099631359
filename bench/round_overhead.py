"""The fixed cost of a round: what a round costs beyond local training and the secure sum.

Run ``python -m bench.round_overhead [--quick] [--json PATH]``. Three orgs run real
``fedweave run`` processes on 127.0.0.1 over mutual TLS (the harness: SWIM, gossip,
egress log, erasure-coded checkpoints every round), training the bundled
``breast_cancer`` MLP (2.1k parameters, 3 local steps), once with each worker mode:

* ``persistent`` — one local worker per org for the whole run (the default);
* ``per-round`` — a fresh worker process every round: the baseline. Before the local
  worker, a world-size-1 job ran inside the node's process, which the node no longer
  allows (a trainer's code never runs there), and a multi-rank job started torchrun
  afresh every round; a contained job started each round is what that costs.

Each org's node records, per round, the round's wall time (``round_s``: training,
protection, the secure sum, the model-hash check, the state write and the checkpoint),
the worker's compute time (``local_compute_s``, timed inside the worker) and the secure
sum's time (``secure_sum_s``). The row is the median over orgs and rounds 2..R of
``round_s - local_compute_s - secure_sum_s``. Rows:

* ``round_overhead_s[worker=persistent]`` against ``[worker=per-round]``; target
  ``<= 0.3`` s;
* ``local_compute_s`` and ``secure_sum_s`` of each mode (report), for scale.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.common import Report, run_main

__all__ = ["main", "overheads"]

ORGS = 3
TARGET_S = 0.3


def overheads(metrics: dict[str, dict[int, dict[str, float]]]) -> dict[str, list[float]]:
    """Per round 2..R of every org: overhead, compute and secure-sum seconds."""
    out: dict[str, list[float]] = {"overhead": [], "compute": [], "sum": []}
    for per_round in metrics.values():
        for r, m in per_round.items():
            if r < 2 or not {"round_s", "local_compute_s", "secure_sum_s"} <= set(m):
                continue
            out["overhead"].append(m["round_s"] - m["local_compute_s"] - m["secure_sum_s"])
            out["compute"].append(m["local_compute_s"])
            out["sum"].append(m["secure_sum_s"])
    return out


def _measure(worker: str, rounds: int, out: Path) -> dict[str, float]:
    from org_node.harness.runner import run_harness
    from org_node.harness.scenario import Scenario

    scenario = Scenario(orgs=ORGS, rounds=rounds, worker=worker, seed=3)
    obs = run_harness(scenario, out / worker)
    if obs.errors or any(n.state != "completed" for n in obs.nodes.values()):
        raise RuntimeError(f"the {worker} run did not complete: {obs.errors or obs.states}")
    found = overheads(obs.metrics)
    if not found["overhead"]:
        raise RuntimeError(f"the {worker} run recorded no round timings")
    return {k: statistics.median(v) for k, v in found.items()}


def body(report: Report) -> None:
    rounds = 4 if report.quick else 10
    with tempfile.TemporaryDirectory(prefix="fw-overhead-") as tmp:
        fresh = _measure("per-round", rounds, Path(tmp))
        kept = _measure("persistent", rounds, Path(tmp))
    note = f"{ORGS} orgs over mutual TLS, breast_cancer MLP, median of rounds 2..{rounds}"
    report.add(
        "round_overhead_s[worker=persistent]",
        kept["overhead"],
        "s",
        fresh["overhead"],
        target=f"<= {TARGET_S}",
        target_is_absolute=True,
        note=f"{note}; baseline: a fresh worker every round",
    )
    for name, values in (("persistent", kept), ("per-round", fresh)):
        report.add(f"local_compute_s[worker={name}]", values["compute"], "s", note=note)
        report.add(f"secure_sum_s[worker={name}]", values["sum"], "s", note=note)


def main(argv: Sequence[str] | None = None) -> Report:
    """``python -m bench.round_overhead [--quick] [--json PATH]``."""
    return run_main("round_overhead", body, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    main()
