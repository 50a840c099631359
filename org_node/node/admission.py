"""The runs peers may open rounds of at this node: :class:`RunAdmission`.

The round engine and the CKKS aggregator ask, for every message that would open or
fill a round, whether this org takes part in the message's run and who its
participants are (:data:`coordinator_free.rounds.state.Admission`). The answer is the
runs this org accepted and has not seen end (``accepted``, ``running``, ``paused``),
each with the participants of its spec and its backend: a run id this org never
accepted, a sender that is not among a run's participants, or a message of the
backend a run does not use is refused before anything of it is kept.

The answers live in memory, so the check on the event loop never reads the
database: :meth:`RunAdmission.load` fills them once at start (off the loop), and the
run hooks keep them current (accepted, launched, ended).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from coordinator_free.rounds.state import Admission
from sqlalchemy import Engine
from sqlmodel import Session, select

from org_node.db.models import Run
from org_node.run_config import EngineError, RunPlan
from org_node.runs import RunState

__all__ = ["ADMITTED_STATES", "RunAdmission"]

logger = logging.getLogger(__name__)

ADMITTED_STATES = (RunState.ACCEPTED.value, RunState.RUNNING.value, RunState.PAUSED.value)
"""The states of a run whose rounds peers may open here."""


class RunAdmission:
    """Run key → (participants, backend) of the runs this org takes part in."""

    def __init__(self) -> None:
        self._runs: dict[str, tuple[frozenset[str], str]] = {}
        self._lock = threading.Lock()

    def admit(self, run_key: str, participants: Iterable[str], backend: str) -> None:
        """Let the participants of ``run_key`` open its rounds (sums of ``backend``)."""
        with self._lock:
            self._runs[run_key] = (frozenset(participants), backend)

    def admit_spec(self, name: str, spec: Mapping[str, Any]) -> str:
        """:meth:`admit` the run ``name`` of ``spec`` (all of its participants); its key."""
        plan = RunPlan.from_spec(name, spec)
        self.admit(plan.run_key, spec["participants"], plan.backend)
        return plan.run_key

    def forget(self, run_key: str) -> None:
        """The run ended here: its rounds are refused from now on."""
        with self._lock:
            self._runs.pop(run_key, None)

    def participants(self, run: str, backend: str) -> Collection[str] | None:
        """The participants of the round engine's run id ``run`` (a run key, or a run key
        and a suffix such as ``:stats``) when its run is admitted with ``backend``."""
        entry = self._runs.get(run.partition(":")[0])
        if entry is None or entry[1] != backend:
            return None
        return entry[0]

    def for_backend(self, backend: str) -> Admission:
        """The admission rule of the sums of ``backend`` (``masked`` or ``ckks``)."""

        def admit(run: str) -> Collection[str] | None:
            return self.participants(run, backend)

        return admit

    def load(self, db: Engine) -> None:
        """Admit every run the database holds as accepted, running or paused (blocking:
        call it off the event loop)."""
        with Session(db) as session:
            rows = session.exec(
                select(Run).where(Run.state.in_(ADMITTED_STATES))  # type: ignore[attr-defined]
            ).all()
            for row in rows:
                try:
                    self.admit_spec(row.name, row.spec)
                except (EngineError, KeyError, TypeError, ValueError) as exc:
                    logger.warning("run %s is not admitted: unreadable spec (%s)", row.id, exc)

    def runs(self) -> dict[str, tuple[frozenset[str], str]]:
        """A copy of what is admitted (for tests and diagnostics)."""
        with self._lock:
            return dict(self._runs)
