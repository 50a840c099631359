"""A run's life around its engine: members removed mid-run, how a failure is kept (and
whether an admin may resume it), the checkpoint set and stores of each run, and the
rows of recovered runs.

* :func:`leave_out_removed` — members a new manifest removed leave a run's plan, so
  its next round neither waits for them nor sends them anything of the run.
* :class:`Failure` — why a run failed here and whether that failure is recoverable,
  written next to the run's saved state (``failure.json``) so that it outlives a
  restart; ``fedweave runs resume`` (``POST /v1/runs/{id}/resume``) resumes a failed
  run only when it is.
* :func:`state_set` — the id of a run's checkpoint set (``state.<run key>``), so that
  each run's checkpoints live and die with the run and recovery finds every run's.
* :func:`run_row` — the local row of a saved engine state; after a recovery, a new row
  for every run the org was in (running, or in the state it ended in).
* :func:`engine_activity` — what a run's engine does now, for ``fedweave runs show``
  and the dashboard: its stage and whom it waits for, or the quorum its round lacks.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from coordinator_free.checkpoints import (
    GLOBAL_OWNER,
    GLOBAL_SET,
    CheckpointReplicator,
    GlobalHistoryStore,
)
from coordinator_free.erasure import CodeParams
from coordinator_free.files import atomic_write
from coordinator_free.rounds import ModelHashMismatch, RoundEngine
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from org_node.db.models import Run
from org_node.db.repo import append_audit_event
from org_node.engine import ATTEMPTS, EngineState, RunEngine, RunPlan
from org_node.node.context import NodeContext
from org_node.privacy import PrivacyError
from org_node.runs import RunState
from org_node.services import RunActivity

__all__ = [
    "FAILURE_FILE",
    "STATE_SET_PREFIX",
    "Failure",
    "clear_failure",
    "engine_activity",
    "fresh_run_stores",
    "leave_out_removed",
    "read_failure",
    "run_row",
    "state_set",
    "write_failure",
]

FAILURE_FILE = "failure.json"
"""Next to a run's ``engine-state.bin``: why the run failed here, and whether it may resume."""

STATE_SET_PREFIX = "state."
"""Checkpoint sets of a run's private state are named ``state.<run key>``."""

REMOVED = "removed from the federation"
"""The start of the reason of a run stopped because this org left the manifest."""


def leave_out_removed(engine: RunEngine, members: tuple[str, ...]) -> tuple[str, ...]:
    """Take the participants the manifest's ``members`` no longer list (and those the
    saved state says were removed before) out of the engine's plan; the participants
    that remain. The codec keeps the size the run began with, so every org still
    decodes alike; the state keeps the removed set (``plan["removed"]``) for a restart."""
    removed = set(engine.state.plan.get("removed", ())) | (
        set(engine.plan.participants) - set(members)
    )
    keep = tuple(p for p in engine.plan.participants if p not in removed)
    if removed:
        engine.plan = replace(engine.plan, participants=keep)
        engine.state.plan["removed"] = sorted(removed)
    return keep


def state_set(run_key: str) -> str:
    """The checkpoint set id of the private state of run ``run_key``."""
    return f"{STATE_SET_PREFIX}{run_key}"


@dataclass(frozen=True)
class Failure:
    """Why a run failed at this org, and whether an admin may resume it.

    Unrecoverable: the models of the members diverged (a resumed run would sum updates
    of different models), the privacy budget or its accounting refused the round, this
    org was removed from the federation, or too few members remain for the threshold.
    Everything else (a round that could not reach its quorum, a node that fell too far
    behind, the local trainer or worker crashing, an update the trainer got wrong) is
    recoverable: the run continues from its last saved state and catches up.
    """

    reason: str
    recoverable: bool

    @classmethod
    def of(cls, exc: BaseException, reason: str) -> Failure:
        """The failure an engine exception means."""
        return cls(reason, not isinstance(exc, ModelHashMismatch | PrivacyError))

    def to_json(self) -> bytes:
        return json.dumps({"reason": self.reason, "recoverable": self.recoverable}).encode()


def write_failure(run_dir: Path, failure: Failure) -> None:
    """Keep ``failure`` next to the run's saved state (atomically; call it off the loop)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / FAILURE_FILE, failure.to_json())


def read_failure(run_dir: Path) -> Failure | None:
    """The failure kept for the run, or None; an unreadable record counts as unrecoverable
    (an admin looks at it before anything resumes)."""
    path = run_dir / FAILURE_FILE
    try:
        raw = json.loads(path.read_bytes())
        return Failure(str(raw["reason"]), bool(raw["recoverable"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return Failure(f"unreadable {FAILURE_FILE}: {exc}", False)


def clear_failure(run_dir: Path) -> None:
    """The run resumed: its failure is history."""
    (run_dir / FAILURE_FILE).unlink(missing_ok=True)


def fresh_run_stores(ctx: NodeContext, run_key: str) -> CheckpointReplicator | None:
    """Give run ``run_key`` stores of its own: a global-model history that starts afresh
    (the history numbers versions by round; the previous run's versions are dropped)
    and a checkpoint replicator of its own set (:func:`state_set`), so that the previous
    run's checkpoints neither crowd this run's out of the retention nor win a recovery.
    Returns the previous replicator, for the caller to close on the loop."""
    store, endpoint, membership = ctx.store, ctx.endpoint, ctx.membership
    if store is None or endpoint is None or membership is None:
        return None
    old = [s.manifest.version for s in store.list(GLOBAL_OWNER, GLOBAL_SET)]
    if old:
        store.delete(GLOBAL_OWNER, GLOBAL_SET, sorted(set(old)))
    params = CodeParams(ctx.config.checkpoint.k, ctx.config.checkpoint.m)
    ctx.history = GlobalHistoryStore(endpoint, store, membership.live, params=params)
    previous = ctx.replicator
    if previous is not None and previous.set_id == state_set(run_key):
        return None
    ctx.replicator = CheckpointReplicator(
        endpoint,
        ctx.secret,
        membership.live,
        params=params,
        set_id=state_set(run_key),
        retention=ctx.config.checkpoint.retention,
    )
    return previous


def run_row(db: Engine, state: EngineState) -> str | None:
    """The local row of a saved engine state: the id of its running row (None when the
    row is in another state). After a recovery, when no row names the run, a new one:
    ``running`` for the run in progress (its id returned, to resume it), or
    ``completed`` for a run that had ended (None), so the org knows every run it was in.
    Call it off the loop (it commits)."""
    name, spec = state.plan["name"], state.plan["spec"]
    with Session(db) as session:
        for row in session.exec(select(Run).where(Run.name == name)).all():
            if RunPlan.from_spec(row.name, row.spec).run_key == state.run_key:
                return row.id if row.state == RunState.RUNNING else None
        ended = state.status != "running"
        bound = dict(state.plan.get("binding") or {})
        row = Run(
            id=uuid.uuid4().hex,
            name=name,
            spec=dict(spec),
            state=(RunState.COMPLETED if ended else RunState.RUNNING).value,
            state_reason=f"recovered from the peers' checkpoints ({state.status})"
            if ended
            else None,
            current_round=state.round,
            proposed_by="recovery",
            decided_by="recovery",
            run_key=state.run_key,
            trainer_hash=bound.get("trainer_hash"),
            dataset_name=bound.get("dataset_name"),
            dataset_hash=bound.get("dataset_hash"),
            dataset_rows=bound.get("dataset_rows"),
        )
        session.add(row)
        append_audit_event(
            session, stage="control", kind="run.recover", run=row.id, privacy_class="internal"
        )
        session.commit()
        return None if ended else row.id


def engine_activity(engine: RunEngine, rounds: RoundEngine | None) -> RunActivity:
    """What ``engine`` does now (read on the node's loop): its round, the stage, whose
    messages the stage waits for, or the quorum its round waits for."""
    doing, since = engine.activity
    # the round counter moves on once a round's model is agreed, before its checkpoint
    done = engine.state.round - (doing == "checkpointing")
    now = RunActivity(done + 1, doing, since)
    wait = engine.quorum
    if doing == "quorum" and wait is not None:
        return RunActivity(
            wait.round,
            doing,
            wait.since,
            attempt=wait.attempt,
            orgs=wait.missing,
            failures=wait.failures,
            threshold=wait.threshold,
            next_attempt=wait.next_at,
            deadline=wait.since + engine.plan.quorum_wait_s,
        )
    if doing != "aggregating" or rounds is None:
        return now
    progress = rounds.progress(engine.plan.run_key)
    if progress is None or progress.round // ATTEMPTS != engine.state.round:
        return now
    return RunActivity(
        now.round,
        doing,
        progress.since,
        stage=progress.stage,
        attempt=progress.round % ATTEMPTS + 1,
        orgs=progress.waiting_for,
    )
