"""The runs as this org's database holds them, shared by the admin API and the node.

* :func:`resolve_run`: one name for a run everywhere. A run is found by its
  federation run key, its name (unique in the federation), a unique prefix of its
  key (at least 4 characters), or its local id.
* :func:`policy_violations`: every enabled policy a spec breaks (checked at consent
  and again at start, by whoever starts the run).
* :func:`store_consent` / :func:`consents_of`: the participants' signed decisions, by
  run key (a consent may arrive before its proposal).
* :func:`proposal_of`, :func:`outcome_of` and :func:`waiting_of`: what the run's
  proposal and the known consents mean now (:func:`org_node.proposals.decide`), and
  what the run waits for, as the API and ``fedweave runs show`` report it.
* :func:`apply_action`: one state change of the pure table, as a conditional update
  with its audit event (the caller commits).
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, or_, select

from org_node.db.models import PolicyRecord, Run, RunConsent, RunWaiting, utcnow
from org_node.db.repo import append_audit_event, update_versioned
from org_node.policy import Policy, RunSpec, Violation, check_run_against_policy
from org_node.proposals import Consent, Outcome, Proposal, ProposalError, decide, from_ms
from org_node.runs import InvalidTransition, RunAction, RunState, next_state
from org_node.services import RunActivities

__all__ = [
    "AmbiguousRun",
    "RunNotFound",
    "apply_action",
    "as_policy",
    "consents_of",
    "now_ms",
    "outcome_of",
    "policy_violations",
    "proposal_of",
    "resolve_run",
    "store_consent",
    "waiting_of",
]

_HEX = re.compile(r"^[0-9a-f]{4,32}$")
PENDING_STATES = (RunState.PROPOSED.value, RunState.ACCEPTED.value)


class RunNotFound(LookupError):
    """No run answers to the reference."""


class AmbiguousRun(LookupError):
    """A key prefix that more than one run starts with (the message lists them)."""


def now_ms() -> int:
    return int(time.time() * 1000)


def resolve_run(session: Session, ref: str) -> Run:
    """The run ``ref`` names: run key, name, local id, or a unique key/id prefix."""
    if not 0 < len(ref) <= 100:
        raise RunNotFound(ref)
    exact = session.exec(
        select(Run).where(or_(Run.run_key == ref, Run.name == ref, Run.id == ref))
    ).all()
    if len(exact) == 1:
        return exact[0]
    if len(exact) > 1:  # a name equal to another run's key or id: the key wins
        for row in exact:
            if row.run_key == ref:
                return row
        return sorted(exact, key=lambda r: r.created_at)[-1]
    if not _HEX.match(ref):
        raise RunNotFound(ref)
    like = f"{ref}%"
    rows = session.exec(
        select(Run).where(or_(col(Run.run_key).like(like), col(Run.id).like(like)))
    ).all()
    if len(rows) == 1:
        return rows[0]
    if rows:
        names = ", ".join(sorted(f"{r.name} ({r.run_key or r.id})" for r in rows))
        raise AmbiguousRun(f"{ref!r} is the start of several runs: {names}")
    raise RunNotFound(ref)


def as_policy(row: PolicyRecord) -> Policy:
    return Policy(
        min_participants=row.min_participants,
        required_backend=row.required_backend,
        min_threshold=row.min_threshold,
        max_epsilon=row.max_epsilon,
        allowed_trainers=None if row.allowed_trainers is None else tuple(row.allowed_trainers),
        allowed_peers=None if row.allowed_peers is None else tuple(row.allowed_peers),
    )


def policy_violations(session: Session, spec: RunSpec) -> list[tuple[str, Violation]]:
    """Every requirement of every enabled policy that ``spec`` breaks, as (policy, v)."""
    rows = session.exec(
        select(PolicyRecord).where(col(PolicyRecord.enabled)).order_by(col(PolicyRecord.id))
    ).all()
    return [(row.name, v) for row in rows for v in check_run_against_policy(spec, as_policy(row))]


def store_consent(session: Session, consent: Consent, signature: str) -> bool:
    """Record a participant's decision; False if one is recorded already (the first
    signed decision stands). The caller commits."""
    if session.get(RunConsent, (consent.run_key, consent.org)) is not None:
        return False
    session.add(
        RunConsent(
            run_key=consent.run_key,
            org_id=consent.org,
            decision=consent.decision,
            reason=consent.reason,
            decided_at=from_ms(consent.at_ms),
            signature=signature,
        )
    )
    try:
        session.flush()
    except IntegrityError:  # recorded concurrently
        session.rollback()
        return False
    return True


def _ms(value: datetime) -> int:
    return round(value.timestamp() * 1000)


def consents_of(session: Session, run_key: str) -> list[RunConsent]:
    """The decisions recorded for ``run_key``, by org."""
    rows = session.exec(select(RunConsent).where(RunConsent.run_key == run_key)).all()
    return sorted(rows, key=lambda r: r.org_id)


def _as_consents(rows: list[RunConsent]) -> dict[str, Consent]:
    return {
        r.org_id: Consent(r.run_key, r.org_id, r.decision, r.reason, _ms(r.decided_at))  # type: ignore[arg-type]
        for r in rows
    }


def proposal_of(row: Run) -> Proposal | None:
    """The signed proposal the run was recorded from (None for a run without one)."""
    if not row.proposal:
        return None
    try:
        return Proposal.from_dict({k: v for k, v in row.proposal.items() if k != "signature"})
    except ProposalError:
        return None


def outcome_of(row: Run, consents: list[RunConsent], at_ms: int | None = None) -> Outcome | None:
    """What the run's proposal and ``consents`` mean at ``at_ms`` (default: now)."""
    proposal = proposal_of(row)
    if proposal is None:
        return None
    return decide(proposal, _as_consents(consents), at_ms or now_ms())


def waiting_of(row: Run, consents: list[RunConsent], node: object = None) -> RunWaiting | None:
    """What the run waits for at this org now (None when it waits for nothing): the
    consents or the agreed start of a pending run, the trainer or dataset a run to
    resume needs, or, from ``node`` (a :class:`~org_node.services.RunActivities`), what
    the round under way does and whose messages it waits for."""
    state = RunState(row.state)
    if state is RunState.RUNNING and row.state_reason and row.state_reason.startswith("waiting"):
        return RunWaiting(what="resume", since=row.updated_at, detail=row.state_reason)
    if state in (RunState.RUNNING, RunState.PAUSED):
        return _activity(row, node)
    if row.state not in PENDING_STATES:
        return None
    outcome = outcome_of(row, consents)
    if outcome is None:
        return None
    if outcome.kind == "waiting":
        return RunWaiting(
            what="consent",
            orgs=list(outcome.waiting_for),
            since=row.created_at,
            until=row.consent_by,
            detail="waiting for the consent of " + ", ".join(outcome.waiting_for),
        )
    if outcome.kind == "start" and outcome.start_at_ms is not None:
        if state is RunState.PROPOSED:
            return RunWaiting(
                what="consent",
                orgs=[],
                since=row.created_at,
                until=row.consent_by,
                detail="the others consented; this org has not",
            )
        return RunWaiting(
            what="start",
            orgs=list(outcome.accepted),
            since=row.updated_at,
            until=from_ms(outcome.start_at_ms),
            detail="every consent is in; the run starts at the agreed time",
        )
    return None


def _activity(row: Run, node: object) -> RunWaiting | None:
    if not isinstance(node, RunActivities):
        return None
    now = node.run_activity(row.id)
    if now is None:
        return None
    return RunWaiting(
        what="round" if now.doing != "paused" else "resume",
        orgs=list(now.orgs),
        since=datetime.fromtimestamp(now.since, tz=UTC),
        detail=now.detail,
        round=now.round,
        stage=now.stage or now.doing,
    )


def apply_action(
    session: Session,
    row: Run,
    action: RunAction,
    values: Mapping[str, Any] | None = None,
    *,
    stage: str = "control",
) -> RunState | None:
    """Move ``row`` by ``action`` with ``values`` as one conditional update plus its
    audit event; the new state, or None if the table refuses it or another writer
    changed the row first (nothing is written then). The caller commits."""
    try:
        new = next_state(row.state, action)
    except InvalidTransition:
        return None
    update = {"state": new.value, "updated_at": utcnow(), **(values or {})}
    if not update_versioned(session, Run, row.id, row.version, update, where={"state": row.state}):
        session.rollback()
        return None
    append_audit_event(
        session, stage=stage, kind=f"run.{action.value}", run=row.id, privacy_class="internal"
    )
    return new
