"""The harness's verdict: ``DIR/summary.json`` and the plaintext FedAvg check.

:func:`build_summary` reads what the nodes left on disk once they are stopped — each
org's engine state (the final global model), its egress log — and what the harness saw
while following the run (:class:`~org_node.harness.runner.Observation`), and returns the
summary: ``ok``, ``orgs``, ``rounds_completed``, ``backend``, ``final_model_sha256``
(per org; equal for every surviving org), ``metrics`` (per org: final loss and
accuracy), ``bytes_sent`` (per org, from its egress log), ``faults``, ``recoveries``,
``audit_verified`` (per org, :func:`org_node.audit.verify_path`, what
``fedweave audit verify`` runs), ``audit_reports``, ``harness_check`` and
``membership_converged`` (false when the nodes never all saw each other alive, so no
run was started: then that is the one ``reason``).

``harness_check`` (:func:`plaintext_fedavg`) recomputes the run in the clear: from the
round-0 model, for each round, the plain sum of the packed updates the survivors
exported in the harness-only debug mode (``FEDWEAVE_HARNESS_DEBUG_EXPORT``, refused by a
node whose config lacks ``[debug] harness = true``), unpacked and stepped exactly as
the run engine does (FedNova normalization, then the strategy); ``max_abs_diff`` is the
largest coordinate difference between that model and the federated one. The secure sum
differs from the plain one by its fixed-point rounding (masked) or its CKKS noise and
result grid (``org_node.engine.RESULT_GRID_BITS``) only, so the tolerance is small.
With a ``compression``, each org exports what its compressed vector carries (its own
decoding: the random-k support, q8's levels, the residual left out), so the check is
that the secure sum of the compressed vectors is their plain sum.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from coordinator_free.errors import CoordinatorFreeError
from coordinator_free.manifest import Manifest

from org_node.harness.nodes import Observation

__all__ = [
    "TOLERANCE",
    "VerdictError",
    "build_summary",
    "final_state",
    "finish",
    "plaintext_fedavg",
    "write_summary",
]

TOLERANCE: dict[str, float] = {"masked": 1e-4, "ckks": 5e-4}
"""Largest allowed ``|federated - plaintext|`` per coordinate, per backend."""


class VerdictError(Exception):
    """The exported updates or the engine state cannot be read (the message says why)."""


def final_state(data_dir: Path, run_key: str) -> Any:
    """The engine state the org in ``data_dir`` ended ``run_key`` with (None if it is
    missing or unreadable)."""
    from org_node.engine import STATE_FILE, EngineError, EngineState

    path = data_dir / "runs" / run_key / STATE_FILE
    try:
        return EngineState.from_bytes(path.read_bytes())
    except (OSError, EngineError):
        return None


def _export(obs: Observation, org: str, round0: int) -> np.ndarray:
    """The packed update ``org`` exported for 0-based round ``round0``. For an org that
    was wiped, a round before the one it recovered at comes from the copy taken at the
    wipe (summed before it); later rounds from what it exported after its restart (an
    update of a round the wipe interrupted never entered a sum; the round ran again)."""
    name = Path(obs.run_key) / f"round-{round0:06d}.npy"
    kept = obs.wiped_exports.get(org)
    recovered = max(
        (int(r.get("recovered_round", 0)) for r in obs.recoveries if r.get("org") == org),
        default=0,
    )
    bases = [obs.export_dir / org]
    if kept is not None:
        bases = [kept, *bases] if round0 < recovered else [*bases, kept]
    for base in bases:
        if (base / name).exists():
            return np.asarray(np.load(base / name), dtype=np.float64)
    raise VerdictError(f"no exported update of {org} for round {round0 + 1}")


def initial_model(obs: Observation) -> dict[str, np.ndarray]:
    """The round-0 model the orgs' trainers built (from the harness-only export; every
    org exported the same one, which the run's model-hash checks confirm)."""
    for org in obs.scenario.names:
        for base in (obs.wiped_exports.get(org), obs.export_dir / org):
            path = None if base is None else base / obs.run_key / "initial.npz"
            if path is not None and path.exists():
                with np.load(path, allow_pickle=False) as npz:
                    return {k: np.asarray(npz[k], dtype=np.float32) for k in npz.files}
    raise VerdictError("no org exported the round-0 model")


def plaintext_fedavg(
    obs: Observation, survivors: Mapping[int, Sequence[str]], rounds: int
) -> dict[str, np.ndarray]:
    """The model after ``rounds`` rounds of plain (unprotected) aggregation of the
    exported updates of each round's ``survivors`` (1-based round -> orgs)."""
    from org_node.engine import EngineConfig
    from org_node.strategies import make_strategy
    from org_node.update_packing import unpack_sum

    s = obs.scenario
    config = EngineConfig(
        strategy=s.strategy, strategy_options=s.strategy_options, model_seed=s.seed
    )
    model = initial_model(obs)
    strategy = make_strategy(config.strategy, config.strategy_options)
    names = sorted(model)
    for r in range(rounds):
        orgs = survivors.get(r + 1)
        if not orgs:
            raise VerdictError(f"the survivors of round {r + 1} were not observed")
        total = np.sum([_export(obs, org, r) for org in sorted(orgs)], axis=0)
        summed, weight = unpack_sum(total, model, fednova=True)
        new = strategy.step([model[k] for k in names], summed, weight)
        model = dict(zip(names, (np.asarray(p) for p in new), strict=True))
    return model


def _max_abs_diff(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    if set(a) != set(b):
        return math.inf
    worst = 0.0
    for k in a:
        x, y = np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)
        if x.shape != y.shape:
            return math.inf
        if x.size:
            worst = max(worst, float(np.max(np.abs(x - y))))
    return worst


def _egress(data_dir: Path) -> tuple[Path, int]:
    from org_node.audit import LogFormatError, read_log

    path = data_dir / "audit" / "egress.jsonl"
    try:
        records = read_log(path)
    except (OSError, LogFormatError):
        return path, 0
    return path, sum(int(e.bytes) for e in records.entries())


def _audit_report(obs: Observation, org: str, survivors: Mapping[int, Sequence[str]]) -> str:
    """Write org's signed privacy audit report of the run into ``DIR/audit/ORG``; the
    facts are assembled as the node assembles them (:func:`org_node.audit.facts.org_run_facts`:
    its consent and policies from its database, its rounds from its round log), with the
    survivors the harness observed filling only what the node did not record."""
    from coordinator_free.identity import OrgIdentity

    from org_node.audit import AuditError, EgressLog, build_report, save_report
    from org_node.audit.facts import observed_rounds, org_run_facts
    from org_node.policy import RunSpec

    node = obs.nodes[org]
    s = obs.scenario
    try:
        identity = OrgIdentity.load(node.data_dir / "identity")
        log = EgressLog(identity, node.data_dir / "audit" / "egress.jsonl")
    except (CoordinatorFreeError, AuditError, OSError) as exc:
        return f"not written: {exc}"
    try:
        spec = RunSpec.from_dict(obs.spec)
        rounds = observed_rounds(s.names, survivors, obs.metrics.get(org, {}))
        facts = org_run_facts(node.data_dir, obs.run_key, spec, org_id=org, observed=rounds)
        if log.entries and (not log.heads or log.heads[-1].index < log.entries[-1].index):
            # the node signs its head after each round; traffic after its last round
            # (catching up, shard repair) is closed by a head signed now, as the org
            # does when it writes a report of a stopped node
            log.sign_head(obs.run_key, max(survivors, default=0))
        json_path, _html = save_report(build_report(log, facts), obs.out / "audit" / org)
        return str(json_path)
    except (AuditError, ValueError) as exc:
        return f"not written: {exc}"
    finally:
        log.close()


def _audit(obs: Observation, org: str) -> dict[str, Any]:
    from org_node.audit import verify_path

    node = obs.nodes[org]
    path = node.data_dir / "audit" / "egress.jsonl"
    wiped = any(r["org"] == org for r in obs.recoveries)
    peers = (
        []
        if wiped
        else [
            n.data_dir / "audit" / "egress.jsonl"
            for o, n in obs.nodes.items()
            if o != org and (n.data_dir / "audit" / "egress.jsonl").exists()
        ]
    )
    keys: dict[str, bytes] | None = None
    with contextlib.suppress(OSError, ValueError, CoordinatorFreeError):
        keys = Manifest.from_json((obs.out / "manifest.json").read_bytes()).public_keys()
    result = verify_path(path, peer_logs=peers, trusted_keys=keys)
    out: dict[str, Any] = {"ok": result.ok, "summary": result.summary}
    if wiped:
        out["note"] = (
            "the log restarted with the wiped disk; peer-held heads of the old one not checked"
        )
    return out


def _metrics(obs: Observation, org: str, model: Mapping[str, np.ndarray] | None) -> dict[str, Any]:
    """The org's final loss and accuracy: those its node recorded for its last round
    (its local model on the task's held-out split), and those of the final global model
    it holds, evaluated by the harness on the same split. An org that rejoined by
    adopting the federation's model (after a wipe) recorded no round of its own since:
    its ``loss`` and ``accuracy`` are then the global model's."""
    from org_node.tasks import TaskError, evaluate

    per = obs.metrics.get(org, {})
    last = per[max(per)] if per else {}
    out: dict[str, Any] = {
        "loss": last.get("eval_loss", last.get("train_loss")),
        "accuracy": last.get("eval_accuracy", last.get("eval_acc")),
        "round": max(per) if per else None,
        "final_model_loss": None,
        "final_model_accuracy": None,
    }
    if model is not None and obs.scenario.demo_task:
        with contextlib.suppress(TaskError, ValueError, RuntimeError):
            result = evaluate(obs.scenario.task_ref, {k: np.asarray(v) for k, v in model.items()})
            out["final_model_loss"] = result.get("loss")
            out["final_model_accuracy"] = result.get("accuracy")
    if out["loss"] is None:
        out["loss"], out["accuracy"] = out["final_model_loss"], out["final_model_accuracy"]
        out["source"] = "final global model (no local round recorded)"
    return out


def _final_models(
    obs: Observation,
) -> tuple[dict[str, str | None], dict[str, int], dict[str, Any]]:
    """Per org, from its engine state on disk: the final model's SHA-256, the rounds it
    completed and the model itself (orgs without a state hold none)."""
    from org_node.engine import model_to_bytes

    shas: dict[str, str | None] = {}
    rounds_done: dict[str, int] = {}
    models: dict[str, Any] = {}
    for org in obs.scenario.names:
        state = final_state(obs.nodes[org].data_dir, obs.run_key) if obs.run_key else None
        if state is None:
            shas[org] = None
            rounds_done[org] = 0
            continue
        models[org] = state.model
        shas[org] = hashlib.sha256(model_to_bytes(state.model)).hexdigest()
        rounds_done[org] = int(state.round)
    return shas, rounds_done, models


def _harness_check(
    obs: Observation,
    surviving: Sequence[str],
    models: Mapping[str, Any],
    rounds_done: Mapping[str, int],
    reasons: list[str],
) -> dict[str, Any]:
    """Compare the first surviving org's final model with plaintext FedAvg of the
    exported updates (``harness_check``); a failure is appended to ``reasons``."""
    tolerance = TOLERANCE[obs.scenario.backend]
    check: dict[str, Any] = {"max_abs_diff": None, "tolerance": tolerance, "ok": False}
    try:
        ref_org = next((o for o in surviving if o in models), None)
        if ref_org is None:
            raise VerdictError("no surviving org holds a final model")
        reference = models[ref_org]
        plain = plaintext_fedavg(obs, obs.survivors, rounds_done[ref_org])
        diff = _max_abs_diff(plain, reference)
        check = {
            "max_abs_diff": diff if math.isfinite(diff) else None,
            "tolerance": tolerance,
            "ok": bool(diff <= tolerance),
            "rounds": rounds_done[ref_org],
            "compared_with": ref_org,
        }
        if not check["ok"]:
            reasons.append(
                f"harness_check: the federated model differs from plaintext FedAvg by {diff:.3g}"
                f" > {tolerance:g}"
            )
    except (VerdictError, KeyError, IndexError, ValueError) as exc:
        check["error"] = str(exc)
        reasons.append(f"harness_check: {exc}")
    return check


def _check_recoveries(
    obs: Observation, states: Mapping[str, str], rounds_done: Mapping[str, int]
) -> list[str]:
    """Mark each restarted org's recovery finished or not (in ``obs.recoveries``); the
    reasons of the recoveries that did not restart."""
    reasons = []
    for rec in obs.recoveries:
        if rec.get("outcome") != "restarted":
            reasons.append(f"recovery of {rec['org']}: {rec.get('outcome', 'did not finish')}")
        else:
            rec["finished"] = states.get(rec["org"]) == "completed"
            rec["final_round"] = rounds_done.get(rec["org"], 0)
    return reasons


def _run_reasons(
    obs: Observation,
    surviving: Sequence[str],
    states: Mapping[str, str],
    rounds_done: Mapping[str, int],
    shas: Mapping[str, str | None],
) -> tuple[int, list[str]]:
    """The rounds every surviving org completed, and what failed of the run itself: a
    surviving org not completed, rounds missing, final models that differ."""
    reasons = [
        f"{org} ended in state {states[org]!r}, not completed"
        for org in surviving
        if states[org] != "completed"
    ]
    completed = min((rounds_done[o] for o in surviving), default=0)
    if completed < obs.scenario.rounds:
        reasons.append(
            f"only {completed} of {obs.scenario.rounds} rounds completed at every surviving org"
        )
    surviving_shas = {shas[o] for o in surviving}
    if len(surviving_shas) != 1 or None in surviving_shas:
        reasons.append("the surviving orgs' final models differ")
    return completed, reasons


def build_summary(obs: Observation) -> dict[str, Any]:
    """The verdict (see the module docstring); ``reason`` says what failed, if anything."""
    s = obs.scenario
    killed = {f["org"] for f in obs.faults if f["kind"] == "kill"}
    surviving = [o for o in s.names if o not in killed]
    states = {o: obs.states.get(o, "unknown") for o in s.names}
    shas, rounds_done, models = _final_models(obs)
    completed, run_reasons = _run_reasons(obs, surviving, states, rounds_done, shas)
    reasons: list[str] = [*obs.errors, *run_reasons]
    metrics = {org: _metrics(obs, org, models.get(org)) for org in s.names}
    # reports first (each may close its log with a signed head), then verify the logs
    reports = {
        org: _audit_report(obs, org, obs.survivors)
        for org in surviving
        if obs.survivors and obs.nodes[org].data_dir.exists()
    }
    audit = {org: _audit(obs, org) for org in s.names}
    bytes_sent = {org: _egress(obs.nodes[org].data_dir)[1] for org in s.names}
    for org, result in audit.items():
        if org in surviving and not result["ok"]:
            reasons.append(f"audit verify failed at {org}: {result['summary']}")
    check = _harness_check(obs, surviving, models, rounds_done, reasons)
    reasons.extend(_check_recoveries(obs, states, rounds_done))
    if obs.membership_converged is False:  # no run was started: its own reasons would mislead
        reasons = list(obs.errors)
    return {
        "ok": not reasons,
        "orgs": list(s.names),
        "rounds": s.rounds,
        "rounds_completed": completed,
        "rounds_completed_per_org": rounds_done,
        "backend": s.backend,
        "strategy": s.strategy,
        "task": s.task,
        "trainer": s.trainer,
        "run_key": obs.run_key,
        "states": states,
        "surviving": surviving,
        "final_model_sha256": {o: shas[o] for o in s.names},
        "metrics": metrics,
        "history": {
            org: {str(r): v for r, v in sorted(per.items())} for org, per in obs.metrics.items()
        },
        "survivors": {str(r): sorted(v) for r, v in sorted(obs.survivors.items())},
        "bytes_sent": bytes_sent,
        "faults": obs.faults,
        "recoveries": obs.recoveries,
        "audit_verified": audit,
        "audit_reports": reports,
        "harness_check": check,
        "scenario": s.to_dict(),
        "membership_converged": obs.membership_converged,
        "elapsed_s": obs.elapsed_s,
        "reason": "; ".join(reasons) if reasons else "",
    }


def write_summary(summary: Mapping[str, Any], out: Path) -> Path:
    """Write ``out/summary.json`` (sorted keys, indented); returns its path."""
    path = Path(out) / "summary.json"
    path.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    return path


def finish(obs: Observation) -> dict[str, Any]:
    """Write ``summary.json`` and ``progress.png`` into the harness directory; the summary."""
    from org_node.harness.plot import plot_progress

    summary = build_summary(obs)
    summary["plot"] = str(plot_progress(obs.metrics, obs.scenario.rounds, obs.out / "progress.png"))
    write_summary(summary, obs.out)
    return summary
