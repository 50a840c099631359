"""A user's race: one Flower App under Flower's deployment engine and under fedweave.

Run ``python -m bench.vs_flower_deployment [--quick] [--json PATH]``. The app is
``bench/flower_deploy_app`` (a legacy ``client_fn`` ClientApp training a linear model of
``model-params`` float32 parameters on synthetic partitions, ``local-steps`` SGD steps a
round; a ServerApp with Flower's ``FedAvg`` in a ``DefaultWorkflow``, whose fit step is
``SecAggPlusWorkflow`` when ``secure-aggregation`` is set). For each model size the
benchmark writes one copy of the app with that size's config, and runs it, with n = 4
orgs and the same rounds and local steps:

* **Flower 1.42, deployed** (:mod:`bench.flower_deployment`): ``flower-superlink``, one
  ``flower-supernode`` per org (``partition-id`` = org index), ``flwr run`` of the app,
  once with ``secure-aggregation = true`` (SecAgg+: ``num_shares`` = 4, reconstruction
  threshold 3) and once without. Real processes on loopback, plain HTTP
  (``--insecure``). The SuperLink is the busiest node: every model goes to it and
  from it. Its bytes are those through a counting relay in front of its Fleet API
  (HTTP requests and responses with the SuperNodes, both ways).
* **fedweave:** four real ``fedweave run`` nodes over mutual TLS (the harness), each
  running the same ClientApp in its own worker and adding the updates by the
  pairwise-masked secure sum (threshold 3). Under fedweave the ServerApp gives only the
  initial model. fedweave has no unmasked sum, so its one run (masked) is set against
  both Flower runs. A node's bytes are the envelopes it sent and received during the
  run, from the signed egress logs (each entry names its recipient), TLS framing not
  counted; the busiest node is the one with the largest sum.

Wall time is the run's, from its start to its end, process start-up excluded: for
Flower the SuperLink's ``finished_at - pending_at`` (``pending_at`` is when ``flwr run``
submitted it; the ServerApp and ClientApp processes start inside it); for fedweave from
the run's agreed start (``start_at``, once every org has consented; the consent window
itself is not counted) to the last org's completion (its run row's ``updated_at``); the
org workers start inside it. Start-up (processes launched until every SuperNode is
online / every node is ready) is reported in separate rows.

Rows, per size: ``run_wall_vs_flower_secaggplus`` (fedweave / Flower with SecAgg+,
target ``<= 0.5``), ``busiest_node_bytes_vs_flower`` (fedweave's busiest node / the
SuperLink, with SecAgg+), the ``_plain`` pair against Flower without secure
aggregation (reference), ``fedweave_rounds_with_all_orgs`` (the rounds whose sum holds
all four updates, as Flower's FedAvg, which waits for all four, always has; target
every round) and the start-up rows (report).
"""

from __future__ import annotations

import contextlib
import math
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import Report, run_main

__all__ = ["APP", "Case", "FedweaveRun", "main", "prepare_app", "run_fedweave"]

APP = Path(__file__).resolve().parent / "flower_deploy_app"
ORGS = 4
THRESHOLD = 3


@dataclass(frozen=True)
class Case:
    """One model size: its label and the app's run config."""

    label: str
    params: int
    rounds: int
    local_steps: int = 2
    batch_size: int = 8

    def config(self, secure: bool) -> dict[str, Any]:
        return {
            "num-server-rounds": self.rounds,
            "num-orgs": ORGS,
            "model-params": self.params,
            "local-steps": self.local_steps,
            "batch-size": self.batch_size,
            "secure-aggregation": secure,
            "reconstruction-threshold": THRESHOLD,
        }


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, int | float) else f'"{value}"'


def prepare_app(dest: Path, config: dict[str, Any]) -> Path:
    """A copy of the app in ``dest`` with ``config`` in its ``[tool.flwr.app.config]``."""
    shutil.copytree(APP, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pyproject = dest / "pyproject.toml"
    text = pyproject.read_text()
    for key, value in config.items():
        text, count = re.subn(
            rf"^{re.escape(key)} = .*$", f"{key} = {_toml(value)}", text, flags=re.MULTILINE
        )
        if count != 1:
            raise ValueError(f"the app's pyproject has no single {key!r} setting")
    pyproject.write_text(text)
    return dest


# --------------------------------------------------------------------------- fedweave


@dataclass(frozen=True)
class FedweaveRun:
    """One fedweave run: wall seconds, start-up seconds, states, bytes per org."""

    wall_s: float
    startup_s: float
    states: dict[str, str]
    node_bytes: dict[str, int]
    errors: list[str]
    survivors: dict[int, int] = field(default_factory=dict)
    """1-based round -> orgs whose updates are in its sum."""
    stages: dict[str, float] = field(default_factory=dict)
    """Median over orgs and rounds of ``round_s``, ``secure_sum_s``, ``local_compute_s``."""

    def describe(self) -> str:
        """The rounds' survivors and the median stage times, as one line."""
        short = {r: k for r, k in sorted(self.survivors.items()) if k < ORGS}
        every = "every round with all orgs" if not short else f"rounds short of orgs: {short}"
        times = ", ".join(f"{k} {v:.1f}" for k, v in self.stages.items())
        return f"fedweave {every}; median s/round: {times}"

    @property
    def completed(self) -> bool:
        return not self.errors and all(s == "completed" for s in self.states.values())

    @property
    def busiest(self) -> tuple[str, int]:
        org = max(self.node_bytes, key=lambda o: self.node_bytes[o])
        return org, self.node_bytes[org]


def _when(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def node_bytes(logs: dict[str, Path], since: datetime, until: datetime) -> dict[str, int]:
    """Bytes each org sent plus received in ``[since, until]``, from every org's egress
    log (an entry is the sender's; its ``peer`` is the recipient)."""
    from org_node.audit import read_log

    total: Counter[str] = Counter({org: 0 for org in logs})
    for org, path in logs.items():
        for entry in read_log(path).entries():
            if since <= _when(entry.time) <= until:
                total[org] += entry.bytes
                total[entry.peer] += entry.bytes
    return {org: total[org] for org in logs}


def run_fedweave(app: Path, rounds: int, workdir: Path, timeout: float = 600.0) -> FedweaveRun:
    """Run ``app`` on four fedweave nodes (the harness); what it took."""
    import httpx

    from org_node.harness.nodes import Observation
    from org_node.harness.runner import run_harness
    from org_node.harness.scenario import Scenario

    scenario = Scenario(orgs=ORGS, rounds=rounds, flower_app=str(app), threshold=THRESHOLD)
    t0 = time.perf_counter()
    marks: dict[str, Any] = {}

    def started(obs: Observation, pids: list[int]) -> None:
        marks["startup_s"] = time.perf_counter() - t0

    def progress(obs: Observation) -> None:
        nodes = obs.nodes.values()
        if "rows" in marks or not all(n.state in ("completed", "failed", "aborted") for n in nodes):
            return
        rows = {}
        with contextlib.suppress(httpx.HTTPError, ValueError):  # asked again next time
            for node in nodes:
                with node.client(timeout=10.0) as c:
                    rows[node.org] = c.get(f"/v1/runs/{obs.run_key}").raise_for_status().json()
            marks["rows"] = rows

    obs = run_harness(scenario, workdir, timeout=timeout, on_started=started, progress=progress)
    rows: dict[str, dict[str, Any]] = marks.get("rows", {})
    errors = list(obs.errors)
    if not rows:
        return FedweaveRun(0.0, marks.get("startup_s", 0.0), obs.states, {}, errors or ["no end"])
    start = min(_when(r["start_at"]) for r in rows.values())
    end = max(_when(r["updated_at"]) for r in rows.values())
    logs = {org: n.data_dir / "audit" / "egress.jsonl" for org, n in obs.nodes.items()}
    stages = {}
    for name in ("round_s", "secure_sum_s", "local_compute_s"):
        values = [m[name] for per in obs.metrics.values() for m in per.values() if name in m]
        if values:
            stages[name] = statistics.median(values)
    return FedweaveRun(
        (end - start).total_seconds(),
        marks["startup_s"],
        {org: str(r["state"]) for org, r in rows.items()},
        node_bytes(logs, start, end),
        errors,
        {r: len(orgs) for r, orgs in obs.survivors.items()},
        stages,
    )


# --------------------------------------------------------------------------- the race


def _cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("100k", 100_000, rounds=2)]
    return [Case("1M", 1_000_000, rounds=3), Case("25M", 25_000_000, rounds=2)]


def _timeout(case: Case) -> float:
    return 300.0 + 60.0 * case.rounds * math.sqrt(max(1, case.params // 1_000_000))


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def race(case: Case, tmp: Path) -> dict[str, Any]:
    """The three runs of one case: Flower with and without SecAgg+, fedweave."""
    from bench.flower_deployment import FlowerDeployment

    secure_app = prepare_app(tmp / "app-secure", case.config(True))
    plain_app = prepare_app(tmp / "app-plain", case.config(False))
    with FlowerDeployment(tmp / "flower", ORGS) as flower:
        flower_startup = flower.startup_s
        secagg = flower.run(secure_app, _timeout(case))
        _say(f"{case.label}: Flower with SecAgg+ {secagg}")
        plain = flower.run(plain_app, _timeout(case))
        _say(f"{case.label}: Flower without secure aggregation {plain}")
    fed = run_fedweave(secure_app, case.rounds, tmp / "fedweave", _timeout(case))
    _say(f"{case.label}: fedweave {fed}")
    return {
        "secagg": secagg,
        "plain": plain,
        "fedweave": fed,
        "flower_startup_s": flower_startup,
    }


def _add_rows(report: Report, case: Case, out: dict[str, Any]) -> None:
    fed: FedweaveRun = out["fedweave"]
    tag = f"params={case.label},n={ORGS}"
    where = f"{ORGS} orgs, {case.rounds} rounds, {case.local_steps} local steps"
    runs = {"secaggplus": out["secagg"], "plain": out["plain"]}
    for name, flower in runs.items():
        status = f"Flower {flower.status}; fedweave {'completed' if fed.completed else fed.states}"
        if not (flower.completed and fed.completed):
            report.add(f"run_failed_{name}[{tag}]", 1, "bool", note=f"{status}; {fed.errors}")
            continue
        kind = "SecAgg+" if name == "secaggplus" else "no secure aggregation"
        report.add(
            f"run_wall_vs_flower_{name}[{tag}]",
            fed.wall_s,
            "s",
            flower.wall_s,
            target="<= 0.5" if name == "secaggplus" else None,
            note=f"{where}; fedweave masked sum vs Flower {kind}; run start to end; "
            f"{fed.describe()}",
        )
        org, busiest = fed.busiest
        report.add(
            f"busiest_node_bytes_vs_flower{'' if name == 'secaggplus' else '_plain'}[{tag}]",
            busiest,
            "B",
            flower.fleet_bytes,
            note=f"fedweave {org} (egress logs, sent+received) vs Flower's SuperLink (Fleet "
            f"API bytes both ways; Flower's own count {flower.flower_bytes} B)",
        )
    if fed.completed:
        full = sum(1 for k in fed.survivors.values() if k == ORGS)
        report.add(
            f"fedweave_rounds_with_all_orgs[{tag}]",
            full,
            "rounds",
            case.rounds,
            target=">= 1.0",
            note="rounds whose masked sum holds every org's update (Flower's FedAvg waits "
            "for all 4); fewer means an org dropped out of a round and caught up",
        )
    report.add(
        f"startup_s[fedweave,{tag}]",
        fed.startup_s,
        "s",
        out["flower_startup_s"],
        note="fedweave: create the federation, start 4 nodes until ready; Flower: start the "
        "SuperLink and 4 SuperNodes until online (report)",
    )


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds, so every process started is stopped


def body(report: Report) -> None:
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None
    try:
        for case in _cases(report.quick):
            with tempfile.TemporaryDirectory(prefix="fw-vs-flower-") as tmp:
                out = race(case, Path(tmp))
            _add_rows(report, case, out)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> Report:
    """``python -m bench.vs_flower_deployment [--quick] [--json PATH]``."""
    return run_main("vs_flower_deployment", body, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    main()
