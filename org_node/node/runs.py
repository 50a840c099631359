"""The runs side of the org node: consent hooks, launching a run's engine with its
trainer in a worker process, driving it round after round, writing each outcome to
the run's row, resuming a run after a restart or a recovery (and waiting, with the
reason on the run's row, while its trainer or dataset is not back); the global model's
history and catching up with a federation that is ahead are its
:mod:`~org_node.node.model_history` part.

:class:`Runs` is one part of :class:`~org_node.node.OrgNode`: it owns the active run
and what waits to resume, and the loop owns both (the admin API's threads reach them
only through the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator_free.rounds import ModelHashMismatch
from sqlalchemy import update
from sqlmodel import Session

from org_node.audit import AuditError
from org_node.audit.facts import record_round
from org_node.consent import ConsentRefused, RunBinding, binding_of
from org_node.db.models import Run, RunMetric, utcnow
from org_node.db.repo import append_audit_event, update_versioned
from org_node.dp_spec import dp_disagreement
from org_node.engine import (
    STATE_FILE,
    EngineError,
    EngineState,
    LocalTrainer,
    RoundReport,
    RunEngine,
    RunFailed,
    RunPlan,
    UpdateRejected,
)
from org_node.node.admission import RunAdmission
from org_node.node.context import NodeContext
from org_node.node.lifecycle import (
    REMOVED,
    Failure,
    clear_failure,
    engine_activity,
    fresh_run_stores,
    leave_out_removed,
    read_failure,
    run_row,
    write_failure,
)
from org_node.node.model_history import ModelHistory
from org_node.node.workers import worker_trainer
from org_node.privacy import PrivacyError
from org_node.runs import InvalidTransition, RunAction, RunState, next_state
from org_node.services import RunActivity, ServiceRefused
from org_node.trainers.local import TrainerFailed

__all__ = ["RESUME_RETRY_S", "Runs", "TrainerFactory"]

logger = logging.getLogger("org_node.node")

RESUME_RETRY_S = 2.0
"""How often a run that could not resume (its trainer or dataset missing) is tried again."""


TrainerFactory = Callable[[RunPlan, Path, RunBinding], LocalTrainer]
"""``factory(plan, work_dir, binding)``: the local trainer of a run (by default a
:class:`~org_node.trainers.local.WorkerTrainer` over a worker process)."""


@dataclass
class _ActiveRun:
    run_id: str
    engine: RunEngine
    paused: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class Runs:
    """Runs at this node (see the module docstring).

    The admin API calls the ``on_run_*`` hooks, :meth:`run_activity` and
    :meth:`active_run_id` from its worker threads (or, for reads, from the loop): each
    hands its work to the node's loop (:meth:`NodeContext.on_loop`,
    :meth:`NodeContext.read`), so no API thread ever reads or changes the state below,
    which the loop owns.
    """

    def __init__(
        self,
        ctx: NodeContext,
        trainer_factory: TrainerFactory | None = None,
        debug_export: Path | None = None,
    ) -> None:
        self.ctx = ctx
        self.trainer_factory: TrainerFactory = trainer_factory or self._worker_trainer
        self.debug_export = debug_export
        self.on_round_done: Callable[[str, int], Awaitable[None]] = _nothing_for
        """Awaited after each completed round (the node signs and sends its log head)."""
        self.settle_heads: Callable[[], Awaitable[None]] = _nothing
        """Awaited before a run's end is recorded (the last round's head is sent)."""
        self.active: _ActiveRun | None = None
        self.participants: tuple[str, ...] = ()
        """The members of the active run's rounds (the round engine's ``peers``)."""
        self.finished: dict[str, str] = {}
        """Run id -> how it ended here (``completed``, ``failed: ...``)."""
        self._history_run = ""
        self._retry: asyncio.Task[None] | None = None
        self._waiting: dict[str, tuple[str, Mapping[str, Any], tuple[str, ...] | None]] = {}
        """Runs left running that cannot resume yet (run id -> name, spec, members)."""
        self._reasons: dict[str, str] = {}
        self.admission = RunAdmission()
        """The runs whose rounds peers may open here (the round engine's ``admit``)."""
        self._background: set[asyncio.Task[None]] = set()
        """Work started from a hook on the loop (a stop, a model placed again), kept alive."""
        self.model_history = ModelHistory(ctx)
        """The global model's history: shared each round, placed again, caught up from."""

    def _worker_trainer(self, plan: RunPlan, work_dir: Path, binding: RunBinding) -> LocalTrainer:
        """The run's trainer, in a worker process of its own (never in this one)."""
        return worker_trainer(self.ctx, plan, work_dir, binding)

    # -- runs -------------------------------------------------------------------------

    def _check_spec(self, spec: Mapping[str, Any]) -> RunPlan:
        m = self.ctx.require_manifest()
        name = "check"
        try:
            plan = RunPlan.from_spec(name, spec)
        except (KeyError, TypeError, ValueError) as exc:
            raise ServiceRefused(f"unreadable run spec: {exc}") from None
        me = self.ctx.me
        if me not in plan.participants:
            raise ServiceRefused(f"{me} is not among the run's participants")
        strangers = sorted(set(plan.participants) - set(m.member_ids))
        if strangers:
            raise ServiceRefused(f"participants {strangers} are not federation members")
        if plan.backend == "ckks" and plan.epsilon is not None:
            raise ServiceRefused("DP (epsilon) needs the masked backend, not ckks")
        if plan.threshold < 2:
            raise ServiceRefused("threshold must be at least 2 for a secure sum")
        disagreement = dp_disagreement(spec, self.ctx.config.engine)
        if disagreement is not None:
            raise ServiceRefused(disagreement)
        return plan

    def on_run_accepted(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._check_spec(spec)
        self.admission.admit_spec(self._run_name(run_id), spec)

    def on_run_declined(self, run_id: str, spec: Mapping[str, Any]) -> None:
        del run_id, spec

    def on_run_started(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._check_spec(spec)
        name = self._run_name(run_id)
        self.ctx.on_loop(self.launch(run_id, name, spec))

    def on_run_paused(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self.ctx.read(lambda: self._require_active(run_id).paused.set())

    def on_run_resumed(self, run_id: str, spec: Mapping[str, Any]) -> None:
        """Resume a paused run, or relaunch a failed one from its last saved state when
        its failure is recoverable (:class:`~org_node.node.lifecycle.Failure`)."""
        self.ctx.on_loop(self._resume_run(run_id, spec))

    async def _resume_run(self, run_id: str, spec: Mapping[str, Any]) -> None:
        active = self.active
        running = active is not None and active.task is not None and not active.task.done()
        if active is not None and active.run_id == run_id and running:
            active.paused.clear()
            return
        name = await asyncio.to_thread(self._run_name, run_id)
        try:
            run_dir = self.ctx.paths.run_dir(RunPlan.from_spec(name, spec).run_key)
        except (EngineError, KeyError, TypeError, ValueError) as exc:
            raise ServiceRefused(f"unreadable run spec: {exc}") from None
        failure = await asyncio.to_thread(read_failure, run_dir)
        if failure is not None and not failure.recoverable:
            raise ServiceRefused(f"the run cannot resume: {failure.reason}")
        state_file = run_dir / STATE_FILE
        if not state_file.exists():
            raise ServiceRefused("this node holds no saved state of the run to resume from")
        state = EngineState.from_bytes(await asyncio.to_thread(state_file.read_bytes))
        members = state.plan.get("members")
        if self.ctx.rounds is not None:  # its rounds start afresh, wherever it catches up to
            for run in (state.run_key, f"{state.run_key}:stats"):
                self.ctx.rounds.close_run(run)
        ended = self.finished.pop(run_id, None)
        await asyncio.to_thread(clear_failure, run_dir)  # before a new failure may be kept
        try:
            await self.launch(run_id, name, spec, None if members is None else tuple(members))
        except ServiceRefused:  # the run stays failed, as it was
            if ended is not None:
                self.finished[run_id] = ended
            if failure is not None:
                await asyncio.to_thread(write_failure, run_dir, failure)
            raise
        logger.info("%s: run %s resumed at round %d", self.ctx.me, run_id, state.round)

    def on_manifest(self, members: tuple[str, ...], version: int) -> None:
        """A new manifest version is installed (on the loop): members it removed are out
        of the next round of the run under way (a run waiting to resume leaves them out
        when it launches); when this org itself is removed, or too few members remain for
        the threshold, the run stops here, failed for good."""
        active = self.active
        if active is None or active.task is None:
            return
        if active.task.done():
            if self.ctx.me not in members and self.finished.get(active.run_id, "").startswith(
                "failed"
            ):  # a failed run here cannot be resumed once this org is out
                self._stop_later(active, f"{REMOVED} by manifest version {version}")
            return
        before = active.engine.plan.participants
        self.participants = leave_out_removed(active.engine, members)
        removed = sorted(set(before) - set(self.participants))
        if not removed:
            return
        logger.info(
            "%s: manifest v%d removed %s from run %s", self.ctx.me, version, removed, active.run_id
        )
        # a CKKS round under way stops waiting for them: their messages are refused now
        if self.ctx.ckks is not None:
            self.ctx.ckks.members_removed()
        self.ctx.events.publish(active.run_id, "members", {"removed": removed, "version": version})
        why = ""
        if self.ctx.me in removed:
            why = f"{REMOVED} by manifest version {version}"
        elif len(self.participants) < active.engine.plan.threshold:
            why = (
                f"manifest version {version} leaves {len(self.participants)} members, "
                f"fewer than the threshold {active.engine.plan.threshold}"
            )
        if why:
            self._stop_later(active, why)
        else:
            work = self.model_history.place_again(
                set(removed), active.engine.state.round, active.engine.state.model
            )
            self._later(work, f"history:{active.run_id}")

    def _stop_later(self, active: _ActiveRun, reason: str) -> None:
        self._later(self._stop_for(active, reason), f"stop:{active.run_id}")

    def _later(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _stop_for(self, active: _ActiveRun, reason: str) -> None:
        if active.task is not None:
            active.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await active.task
        logger.warning("%s: run %s stopped: %s", self.ctx.me, active.run_id, reason)
        await self._fail(active, Failure(reason, False))

    def on_run_aborted(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self.ctx.read(lambda: self._abort(run_id))

    def _abort(self, run_id: str) -> None:
        self._waiting.pop(run_id, None)
        active = self.active
        if active is not None and active.run_id == run_id and active.task is not None:
            active.task.cancel()

    def active_run_id(self) -> str:
        """The local id of the run whose engine runs here ("" when none does)."""
        return self.ctx.read(lambda: self.active.run_id if self.active is not None else "")

    def engine_status(self) -> str:
        """``idle`` (no run's engine here), ``running`` or ``stopped`` (it ended)."""

        def read() -> str:
            active = self.active
            if active is None or active.task is None:
                return "idle"
            return "stopped" if active.task.done() else "running"

        return self.ctx.read(read)

    def run_activity(self, run_id: str) -> RunActivity | None:
        """What ``run_id`` does now here (read on the node's loop): its round, the
        stage, and whose messages the stage waits for."""
        try:
            return self.ctx.read(lambda: self._activity(run_id), timeout=2.0)
        except Exception:  # the node is not running, or stopping: nothing to say
            return None

    def _activity(self, run_id: str) -> RunActivity | None:
        active = self.active
        if active is None or active.run_id != run_id:
            return None
        return engine_activity(active.engine, self.ctx.rounds)

    def active_key(self) -> str:
        """The run key of the active run's engine ("" when none)."""
        return self.active.engine.plan.run_key if self.active is not None else ""

    def _require_active(self, run_id: str) -> _ActiveRun:
        active = self.active
        if active is None or active.run_id != run_id:
            raise ServiceRefused("the run is not active on this node")
        return active

    def run_key_of(self, run_id: str) -> str:
        """The federation-wide key of the local run ``run_id`` ("" when unknown)."""
        with Session(self.ctx.db) as session:
            row = session.get(Run, run_id)
            if row is None:
                return ""
            return row.run_key or RunPlan.from_spec(row.name, row.spec).run_key

    def _run_name(self, run_id: str) -> str:
        with Session(self.ctx.db) as session:
            row = session.get(Run, run_id)
            if row is None:
                raise ServiceRefused(f"no run {run_id}")
            return row.name

    async def launch(
        self,
        run_id: str,
        name: str,
        spec: Mapping[str, Any],
        members: tuple[str, ...] | None = None,
    ) -> None:
        """Start the engine of the run (``members``: those taking part, when the run
        started at its quorum without every participant)."""
        if self.ctx.rounds is None:
            raise ServiceRefused("the node has not joined a federation")
        previous = self.active
        if previous is not None and previous.task is not None and not previous.task.done():
            if previous.run_id in self.finished:  # it ended here; its worker is closing
                await asyncio.wait([previous.task], timeout=30.0)
            if not previous.task.done():
                raise ServiceRefused(f"run {previous.run_id} is still active on this node")
        try:
            plan = RunPlan.from_spec(name, spec, members)
        except EngineError as exc:
            raise ServiceRefused(str(exc)) from None
        self.admission.admit(plan.run_key, spec["participants"], plan.backend)
        run_dir = self.ctx.paths.run_dir(plan.run_key)
        rounds = self.ctx.rounds
        if self._history_run != plan.run_key:
            replaced = fresh_run_stores(self.ctx, plan.run_key)
            if replaced is not None:
                await replaced.close()
            self._history_run = plan.run_key

        binding = await asyncio.to_thread(self._binding, run_id)

        def build() -> RunEngine:
            engine = RunEngine(
                plan,
                self.ctx.config.engine,
                rounds=rounds,
                trainer=self.trainer_factory(plan, run_dir / "worker", binding),
                state_dir=run_dir,
                checkpoint=self._checkpoint,
                on_round=lambda report: self._on_round(run_id, report),
                debug_export=self.debug_export,
                catch_up=self._catch_up,
                ckks=self.ctx.ckks,
            )
            if engine.resume():
                logger.info(
                    "%s: resuming %s at round %d", rounds.org_id, run_id, engine.state.round
                )
            engine.state.plan["binding"] = _portable(binding)
            return engine

        try:
            engine = await asyncio.to_thread(build)
        except EngineError as exc:
            raise ServiceRefused(str(exc)) from None
        # members removed from the manifest since the run began take no further part
        self.participants = leave_out_removed(engine, self.ctx.require_manifest().member_ids)
        self.model_history.forget()
        active = _ActiveRun(run_id, engine)
        active.task = asyncio.create_task(self._drive(active), name=f"run:{run_id}")
        self.active = active
        self.ctx.events.publish(
            run_id, "engine", {"run_key": plan.run_key, "round": engine.state.round}
        )

    def _binding(self, run_id: str) -> RunBinding:
        """The trainer and dataset this org bound to the run, checked again now."""
        with Session(self.ctx.db) as session:
            row = session.get(Run, run_id)
            if row is None:
                raise ServiceRefused(f"no run {run_id}")
            try:
                return binding_of(session, self.ctx.catalog, row)
            except ConsentRefused as exc:
                raise ServiceRefused(str(exc)) from None

    async def _drive(self, active: _ActiveRun) -> None:
        try:
            await self._drive_engine(active)
        finally:
            # the run ended here (or the node stops): peers open no more of its rounds
            self.admission.forget(active.engine.plan.run_key)
            if self.active is active:
                self.participants = ()  # the next run's rounds are sized by their own plan
            self._close_rounds_later(active.engine.plan.run_key)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(active.engine.close)

    def _close_rounds_later(self, run_key: str) -> None:
        """Once members that lag have had a stage's time to fetch this node's last sums,
        drop what the round engine holds for the ended run (unless it runs again)."""
        rounds = self.ctx.rounds
        if rounds is None:
            return

        def close() -> None:
            task = self.active.task if self.active is not None else None
            if task is not None and not task.done() and self.active_key() == run_key:
                return
            for run in (run_key, f"{run_key}:stats"):
                rounds.close_run(run)

        asyncio.get_running_loop().call_later(rounds.config.stage_timeout, close)

    async def _drive_engine(self, active: _ActiveRun) -> None:
        run_id = active.run_id
        me = self.ctx.me
        try:
            outcome = await active.engine.run(paused=active.paused)
        except asyncio.CancelledError:
            logger.info("%s: run %s stopped between stages", me, run_id)
            raise
        except (
            RunFailed,
            UpdateRejected,
            ModelHashMismatch,
            EngineError,
            PrivacyError,
            TrainerFailed,
        ) as exc:
            reason = f"round {active.engine.state.round + 1} at {me}: {exc}"
            logger.warning("%s: run %s failed: %s", me, run_id, reason)
            self.ctx.events.publish(run_id, "error", {"message": reason})
            await self._fail(active, Failure.of(exc, reason))
            return
        except Exception as exc:  # any other failure fails the run loudly, never silently
            logger.exception("%s: run %s failed", self.ctx.me, run_id)
            await self._fail(active, Failure.of(exc, f"{type(exc).__name__}: {exc}"))
            return
        await self.settle_heads()
        # the row first: whoever learns the outcome (the event, ``finished``) and then
        # reads the run over the API finds it in its final state
        await asyncio.to_thread(self._set_state, run_id, RunAction.COMPLETE, outcome.reason)
        self.finished[run_id] = outcome.status
        self.ctx.events.publish(
            run_id,
            "outcome",
            {
                "status": outcome.status,
                "rounds": outcome.rounds_done,
                "model_hash": outcome.model_hash,
            },
        )

    async def _fail(self, active: _ActiveRun, failure: Failure) -> None:
        """The run failed here: keep why (and whether an admin may resume it) next to its
        saved state, and mark its row ``failed``."""
        run_dir = self.ctx.paths.run_dir(active.engine.plan.run_key)
        again = self.finished.get(active.run_id, "").startswith("failed")
        self.finished[active.run_id] = f"failed: {failure.reason}"
        await asyncio.to_thread(write_failure, run_dir, failure)
        then = "it can be resumed" if failure.recoverable else "it cannot be resumed"
        reason = f"{failure.reason} ({then})"
        if again:  # failed already (e.g. a removal made it final): the row says why now
            await asyncio.to_thread(self._note_reason, active.run_id, reason)
        else:
            await asyncio.to_thread(self._set_state, active.run_id, RunAction.FAIL, reason)

    def _set_state(self, run_id: str, action: RunAction, reason: str = "") -> None:
        """Apply an engine outcome to the run's row (waits for the API's own commit)."""
        deadline = time.monotonic() + 30.0
        while True:
            with Session(self.ctx.db) as session:
                row = session.get(Run, run_id)
                if row is None:
                    return
                try:
                    new = next_state(row.state, action)
                except InvalidTransition:
                    if row.state == RunState.ACCEPTED and time.monotonic() < deadline:
                        time.sleep(0.05)  # the start is not committed yet
                        continue
                    return
                values = {"state": new.value, "updated_at": utcnow()}
                if reason:
                    values["state_reason"] = reason[:2000]
                if update_versioned(
                    session, Run, run_id, row.version, values, where={"state": row.state}
                ):
                    append_audit_event(
                        session,
                        stage="control",
                        kind=f"run.{action.value}",
                        run=run_id,
                        privacy_class="internal",
                    )
                    session.commit()
                    version = row.version + 1
                    break
                session.rollback()
        self.ctx.events.publish(
            run_id, "state", {"state": new.value, "version": version, "reason": reason}
        )

    async def _on_round(self, run_id: str, report: RoundReport) -> None:
        """Record a completed round: its metrics and the run's round (the database), its
        log head (signed, sent to every member), the round log, this node's shards of the
        new global model; every write off the loop."""
        values: dict[str, float] = dict(report.metrics)
        values |= {
            "examples": float(report.examples),
            "local_steps": float(report.local_steps),
            "survivors": float(len(report.survivors)),
            "attempts": float(report.attempts),
            "bytes_sent": float(report.bytes_sent),
        }
        if report.epsilon_spent is not None:
            values["epsilon_spent"] = report.epsilon_spent
        await asyncio.to_thread(self._record_round, run_id, report, values)
        await self.on_round_done(report.run_key, report.round)
        await self._share_model(report)
        self.ctx.events.publish(
            run_id,
            "round",
            {
                "round": report.round,
                "model_hash": report.model_hash,
                "survivors": list(report.survivors),
                "dropped": list(report.dropped),
            },
        )
        self.ctx.events.publish(run_id, "metric", {"round": report.round, **values})

    def _record_round(self, run_id: str, report: RoundReport, values: Mapping[str, float]) -> None:
        with Session(self.ctx.db) as session:
            for name, value in sorted(values.items()):
                session.add(
                    RunMetric(run_id=run_id, round=report.round, name=name[:100], value=value)
                )
            session.execute(
                update(Run).where(Run.id == run_id).values(current_round=report.round)  # type: ignore[arg-type]
            )
            session.commit()
        try:
            record_round(self.ctx.paths.run_dir(report.run_key), report, self.participants)
        except (OSError, AuditError) as exc:
            logger.warning("%s: round %d not added to the round log: %s", run_id, report.round, exc)

    async def _share_model(self, report: RoundReport) -> None:
        active = self.active
        if active is not None:
            model = active.engine.state.model
            await self.model_history.share(report.run_key, report.round, model, report.survivors)

    async def _catch_up(self, run_key: str, round: int) -> tuple[int, dict[str, Any]] | None:
        return await self.model_history.catch_up(run_key, round, self.participants)

    async def _checkpoint(self, state: bytes, version: int) -> None:
        if self.ctx.replicator is None:
            return
        await self.ctx.replicator.checkpoint(state, version)

    async def stop(self) -> None:
        """Abandon the active run's current round (its state stays at the last finished
        round) and stop retrying the runs that wait to resume."""
        active = self.active
        if active is not None and active.task is not None:
            active.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await active.task
        if self._retry is not None:
            self._retry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._retry

    async def resume(self) -> None:
        """Restart the engine of every run left running (a restart, or a recovered disk);
        a recovered run that had ended gets its row back (:func:`run_row`)."""
        if not self.ctx.paths.runs.exists():
            return
        for state_file in sorted(self.ctx.paths.runs.glob(f"*/{STATE_FILE}")):
            try:
                state = EngineState.from_bytes(state_file.read_bytes())
            except EngineError as exc:
                logger.warning("%s: unreadable %s: %s", self.ctx.me, state_file, exc)
                continue
            if not state.plan:
                continue
            run_id = await asyncio.to_thread(run_row, self.ctx.db, state)
            if run_id is None or state.status != "running":
                continue
            members = state.plan.get("members")
            self._waiting[run_id] = (
                state.plan["name"],
                state.plan["spec"],
                None if members is None else tuple(members),
            )
        await self._resume_waiting()
        self._retry = asyncio.create_task(self._retry_waiting(), name="resume-waiting-runs")

    async def _resume_waiting(self) -> None:
        """Resume each run left running whose trainer and data are in place; note on the
        run's row why the others wait (e.g. a wiped node's dataset is not registered yet:
        its admin registers it again, and the run resumes)."""
        for run_id, (name, spec, members) in list(self._waiting.items()):
            try:
                await self.launch(run_id, name, spec, members)
            except ServiceRefused as exc:
                reason = f"waiting to resume at {self.ctx.me}: {exc}"
                if self._reasons.get(run_id) != reason:
                    logger.warning("%s: run %s %s", self.ctx.me, run_id, reason)
                    self._reasons[run_id] = reason
                    await asyncio.to_thread(self._note_reason, run_id, reason)
                continue
            del self._waiting[run_id]
            if self._reasons.pop(run_id, None) is not None:
                await asyncio.to_thread(self._note_reason, run_id, None)

    async def _retry_waiting(self) -> None:
        while True:
            await asyncio.sleep(RESUME_RETRY_S)
            if self._waiting:
                await self._resume_waiting()

    def _note_reason(self, run_id: str, reason: str | None) -> None:
        with Session(self.ctx.db) as session:
            session.execute(
                update(Run).where(Run.id == run_id).values(state_reason=reason)  # type: ignore[arg-type]
            )
            session.commit()


async def _nothing() -> None:
    return None


async def _nothing_for(run_key: str, round: int) -> None:
    del run_key, round


def _portable(binding: RunBinding) -> dict[str, Any]:
    """What a rebuilt node needs to find its binding again (no local path or row id)."""
    values = binding.row_values()
    values.pop("dataset_id")
    return values
