"""``/v1/runs``: propose a run to every participant, consent to it or not, pause,
resume, abort; its status (with the participants' consents and what it waits for),
per-round metrics, and a server-sent events stream of its progress.

A run is proposed once, at one org (``POST /v1/runs``): the node signs the proposal and
spreads it to every participant, where it appears as ``proposed``. Each org's accept
or decline is signed and spread the same way; the node starts the run by itself at the
time the consents agree on (:mod:`org_node.proposals`). ``{run}`` in every route is the
federation run key, the run's name, a unique key prefix or the local id.

State changes follow the pure table of :mod:`org_node.runs`; an action the current
state does not allow is 409 naming that state. Each change is one conditional update
(``WHERE version = v AND state = s``), then the node's hook, then the commit: a hook that
refuses (``ServiceRefused``) or a concurrent change leaves nothing half-written.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request, Response, status
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import ValidationError
from sqlalchemy import Connection, bindparam
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, func, select

from api.deps import (
    CurrentPrincipal,
    IdempotencyKeyDep,
    NodeDep,
    PageDep,
    ReadsDep,
    SessionDep,
    TrainersDep,
    require_roles,
)
from api.idempotency import remember, replay, scope_of
from api.routers import ERRORS, READERS, WRITERS, conflict, run_or_404, unprocessable
from api.routers.policies import violations
from org_node.consent import ConsentRefused, bind_run
from org_node.db.models import (
    Run,
    RunActionRequest,
    RunConsent,
    RunConsentPublic,
    RunCreate,
    RunMetric,
    RunMetricPublic,
    RunMetricsPublic,
    RunPublic,
    RunSpecModel,
    RunsPublic,
    utcnow,
)
from org_node.db.repo import append_audit_event, update_versioned
from org_node.policy import PolicyError, RunSpec
from org_node.proposals import Consent, from_ms
from org_node.run_store import (
    consents_of,
    now_ms,
    outcome_of,
    proposal_of,
    store_consent,
    waiting_of,
)
from org_node.runs import TERMINAL_STATES, InvalidTransition, RunAction, RunState, next_state
from org_node.services import NodeServices, ProposalRefused, RunEvent, ServiceError
from org_node.trainers.catalog import TrainerCatalog

__all__ = ["HEARTBEAT_S", "router"]

HEARTBEAT_S = 15.0
"""Seconds between keep-alive comments on an idle event stream."""

router = APIRouter(prefix="/v1/runs", tags=["runs"], responses=ERRORS)

_HOOKS: dict[RunAction, str] = {
    RunAction.ACCEPT: "on_run_accepted",
    RunAction.DECLINE: "on_run_declined",
    RunAction.START: "on_run_started",
    RunAction.PAUSE: "on_run_paused",
    RunAction.RESUME: "on_run_resumed",
    RunAction.ABORT: "on_run_aborted",
}
_POLICY_CHECKED = (RunAction.ACCEPT, RunAction.START, RunAction.RESUME)
_DECIDING = (RunAction.ACCEPT, RunAction.DECLINE)


def _view(row: Run, consents: list[RunConsent], node: object = None) -> RunPublic:
    """The run as the API shows it: its row, the consents known and what it waits for
    (for a run under way, what ``node`` says its round waits for)."""
    public = RunPublic.model_validate(row, from_attributes=True)
    public.consents = [RunConsentPublic.model_validate(c, from_attributes=True) for c in consents]
    public.waiting = waiting_of(row, consents, node)
    return public


def _public(row: Run, session: Session, node: object = None) -> RunPublic:
    return _view(row, consents_of(session, row.run_key) if row.run_key else [], node)


def _spec_of(row: Run) -> RunSpec:
    """The run's stored spec; 409 naming what is wrong if it is not a valid one."""
    try:
        return RunSpecModel.model_validate(row.spec).to_spec()
    except (ValidationError, PolicyError) as exc:
        first = str(exc).splitlines()
        raise conflict(f"the run's spec is not valid here: {' '.join(first[:3])}") from None


_get = run_or_404


@router.post(
    "",
    response_model=RunPublic,
    status_code=status.HTTP_201_CREATED,
    dependencies=[require_roles(*WRITERS)],
)
def propose(
    body: RunCreate,
    session: SessionDep,
    node: NodeDep,
    principal: CurrentPrincipal,
    idempotency_key: IdempotencyKeyDep,
) -> Response | RunPublic:
    """Propose a run to every participant (this org has not consented yet).

    The node checks the spec (every participant a federation member, this org among
    them), signs the proposal and spreads it; each participant records it as
    ``proposed``. A name already used in the federation (known here) is 409.
    """
    scope = scope_of("runs.create", principal)
    if (earlier := replay(session, scope, idempotency_key, body)) is not None:
        return earlier
    spec = body.spec.model_dump(mode="json")
    same = session.exec(select(Run).where(Run.name == body.name)).first()
    if same is not None:
        raise conflict(f"a run named {body.name!r} exists already (key {same.run_key})")
    try:
        proposal = node.propose_run(body.name, spec, body.consent_timeout_s, body.start_delay_s)
    except ProposalRefused as exc:
        raise unprocessable(str(exc)) from None
    except ServiceError as exc:
        raise conflict(f"the node cannot propose the run: {exc}") from None
    row = Run(
        id=uuid.uuid4().hex,
        name=body.name,
        spec=dict(proposal.spec),  # with the DP mechanism the node filled in
        proposed_by=principal.name,
        run_key=proposal.run_key,
        origin=proposal.proposer,
        proposal=proposal.to_dict(),
        consent_by=from_ms(proposal.consent_by_ms),
    )
    session.add(row)
    session.flush()
    public = _public(row, session)
    remember(session, scope, idempotency_key, body, 201, public.model_dump(mode="json"))
    append_audit_event(
        session, stage="consent", kind="run.propose", run=row.id, privacy_class="internal"
    )
    session.commit()
    node.announce_run(row.id)
    return public


@router.get("", response_model=RunsPublic, dependencies=[require_roles(*READERS)])
def list_runs(
    session: SessionDep,
    page: PageDep,
    node: NodeDep,
    state: Annotated[RunState | None, Query()] = None,
) -> RunsPublic:
    """Runs, newest first, optionally only those in ``state``."""
    count_q = select(func.count()).select_from(Run)
    rows_q = select(Run)
    if state is not None:
        count_q = count_q.where(Run.state == state.value)
        rows_q = rows_q.where(Run.state == state.value)
    count = session.exec(count_q).one()
    rows = session.exec(
        rows_q.order_by(col(Run.created_at).desc(), col(Run.id))
        .offset(page.offset)
        .limit(page.limit)
    ).all()
    return RunsPublic(data=[_public(r, session, node) for r in rows], count=count)


_RUN = Run.__table__  # type: ignore[attr-defined]
_CONSENT = RunConsent.__table__  # type: ignore[attr-defined]
_RUN_BY = {
    column: sa_select(_RUN).where(_RUN.c[column] == bindparam("ref"))
    for column in ("id", "run_key", "name")
}
_CONSENTS_OF = (
    sa_select(_CONSENT).where(_CONSENT.c.run_key == bindparam("key")).order_by(_CONSENT.c.org_id)
)


def _exact_run(conn: Connection, ref: str) -> tuple[Run, list[RunConsent]] | None:
    """The run whose id, key or name is ``ref`` (one indexed read each), with its
    consents; None if none is (a prefix, or an unknown run)."""
    if not 0 < len(ref) <= 100:
        return None
    for query in _RUN_BY.values():
        rows = conn.execute(query, {"ref": ref}).mappings().all()
        if len(rows) == 1:
            run = Run.model_validate(dict(rows[0]))
            if not run.run_key:
                return run, []
            found = conn.execute(_CONSENTS_OF, {"key": run.run_key}).mappings().all()
            return run, [RunConsent.model_validate(dict(c)) for c in found]
    return None


def _resolved(engine: Any, ref: str, node: object) -> RunPublic:
    """The run ``ref`` names, read in a session of its own."""
    with Session(engine) as session:
        return _public(_get(session, ref), session, node)


@router.get("/{run_id}", response_model=RunPublic, dependencies=[require_roles(*READERS)])
async def read(run_id: str, reads: ReadsDep, request: Request) -> Response:
    """The run's status: state, version, current round, this org's recorded consent,
    the participants' consents known here and what the run waits for."""
    # One indexed read by id, key or name (api.reads: on the event loop for SQLite),
    # validated once and encoded once; a key prefix takes the general path.
    found = await reads(partial(_exact_run, ref=run_id))
    node = request.app.state.node
    if found is None:
        public = await run_in_threadpool(_resolved, request.app.state.engine, run_id, node)
    else:
        public = _view(*found, node)
    return Response(public.model_dump_json(), media_type="application/json")


def _check_decision(row: Run, action: RunAction, request: RunActionRequest) -> None:
    """Refuse an accept or decline that does not fit the run's proposal (409/422)."""
    if action is RunAction.DECLINE and not request.reason.strip():
        raise unprocessable("a decline must give its reason (reason)")
    if request.run_key is not None and request.run_key != row.run_key:
        raise conflict(
            f"the run's key is {row.run_key}, not {request.run_key}: its spec is not the "
            "one reviewed"
        )
    proposal = proposal_of(row)
    if proposal is not None and now_ms() > proposal.consent_by_ms:
        raise conflict(
            f"the consent deadline passed at {from_ms(proposal.consent_by_ms).isoformat()}"
        )


def _check_start(session: Session, row: Run, me: str) -> None:
    """A run with a proposal starts once its consents allow it (409 naming what is missing)."""
    outcome = outcome_of(row, consents_of(session, row.run_key)) if row.run_key else None
    if outcome is None or (outcome.kind == "start" and me in outcome.accepted):
        return
    if outcome.kind == "waiting":
        raise conflict("waiting for the consent of " + ", ".join(outcome.waiting_for))
    raise conflict(f"the run will not start: {outcome.reason or 'without this org'}")


def _check_request(action: RunAction, request: RunActionRequest) -> None:
    """A dataset binds only with an accept, a run key pins only an accept or decline."""
    if request.dataset is not None and action is not RunAction.ACCEPT:
        raise conflict("a dataset is bound when accepting a run, not otherwise")
    if request.run_key is not None and action not in _DECIDING:
        raise conflict("a run key is pinned when accepting or declining a run, not otherwise")


def _check_action(
    session: Session,
    row: Run,
    action: RunAction,
    request: RunActionRequest,
    node: NodeServices,
) -> RunState:
    """The state ``action`` takes the run to, once the version, the state table, the
    decision, the consents to start and this org's policies allow it (409 otherwise)."""
    if request.version is not None and request.version != row.version:
        raise conflict(f"run version is {row.version}, not {request.version}: reload and retry")
    try:
        new = next_state(RunState(row.state), action)
    except InvalidTransition as exc:
        raise conflict(str(exc)) from None
    if action in _DECIDING:
        _check_decision(row, action, request)
    if action is RunAction.START:
        _check_start(session, row, node.identity().org_id)
    if action in _POLICY_CHECKED:
        broken = violations(session, _spec_of(row))
        if broken:
            listed = "; ".join(f"{v.policy}: {v.message}" for v in broken)
            raise conflict(f"run violates this org's policies: {listed}")
    return new


def _new_values(
    session: Session,
    row: Run,
    action: RunAction,
    request: RunActionRequest,
    new: RunState,
    principal: CurrentPrincipal,
    trainers: TrainerCatalog,
) -> dict[str, Any]:
    """The run row's new values: its state, the decision, and for an accept the trainer
    and dataset bound to it."""
    values: dict[str, Any] = {"state": new.value, "updated_at": utcnow()}
    if action in _DECIDING:
        values |= {
            "decided_by": principal.name,
            "decided_at": utcnow(),
            "decision_reason": request.reason or None,
        }
    if action is RunAction.ACCEPT:
        # nothing is imported: the trainer is looked up among those installed here
        try:
            binding = bind_run(session, trainers, _spec_of(row), request.dataset)
        except ConsentRefused as exc:
            raise conflict(f"this org cannot accept the run: {exc}") from None
        values |= binding.row_values()
    return values


def _record_decision(
    session: Session, run_key: str, action: RunAction, request: RunActionRequest, node: NodeServices
) -> None:
    """Store this org's consent (accept or decline) to the proposed run ``run_key``; 409
    if it decided already."""
    mine = Consent(
        run_key,
        node.identity().org_id,
        "accept" if action is RunAction.ACCEPT else "decline",
        request.reason,
        now_ms(),
    )
    if not store_consent(session, mine, ""):
        session.rollback()
        raise conflict("this org has decided on the run already")


def _transition(
    action: RunAction,
    run_id: str,
    body: RunActionRequest | None,
    session: Session,
    node: NodeServices,
    principal: CurrentPrincipal,
    trainers: TrainerCatalog,
) -> RunPublic:
    request = body or RunActionRequest()
    _check_request(action, request)
    row = _get(session, run_id)
    current = RunState(row.state)
    new = _check_action(session, row, action, request, node)
    values = _new_values(session, row, action, request, new, principal, trainers)
    if not update_versioned(session, Run, row.id, row.version, values, where={"state": current}):
        session.rollback()
        latest = _get(session, row.id)
        raise conflict(f"run changed concurrently; it is now {latest.state}")
    deciding = action in _DECIDING
    if deciding and row.run_key and row.proposal:
        _record_decision(session, row.run_key, action, request, node)
    append_audit_event(
        session,
        stage="consent" if deciding else "control",
        kind=f"run.{action.value}",
        run=row.id,
        privacy_class="internal",
    )
    hook: Callable[[str, dict[str, Any]], None] = getattr(node, _HOOKS[action])
    try:
        hook(row.id, dict(row.spec))
    except ServiceError as exc:
        session.rollback()
        raise conflict(f"the node refused to {action.value} the run: {exc}") from None
    session.commit()
    session.expire_all()
    public = _public(_get(session, row.id), session, node)
    if deciding:
        node.announce_run(row.id)
    node.events.publish(row.id, "state", {"state": public.state.value, "version": public.version})
    return public


def _action_route(action: RunAction, doc: str) -> None:
    """Register ``POST /v1/runs/{run_id}/<action>`` (admin and operator)."""

    def handler(
        run_id: str,
        session: SessionDep,
        node: NodeDep,
        principal: CurrentPrincipal,
        trainers: TrainersDep,
        body: Annotated[RunActionRequest | None, Body()] = None,
    ) -> RunPublic:
        return _transition(action, run_id, body, session, node, principal, trainers)

    handler.__doc__ = doc
    handler.__name__ = f"{action.value}_run"
    router.add_api_route(
        f"/{{run_id}}/{action.value}",
        handler,
        methods=["POST"],
        response_model=RunPublic,
        dependencies=[require_roles(*WRITERS)],
        name=f"{action.value}_run",
        summary=f"{action.value.capitalize()} a run",
    )


_action_route(
    RunAction.ACCEPT,
    "This org consents to the run: checked against its policies, the trainer the spec "
    "names looked up among this org's installed trainers (and its pinned hash), and for a "
    "run that needs data the named dataset (``dataset``) checked against the spec's "
    "requirement and bound to the run.",
)
_action_route(RunAction.DECLINE, "This org declines the run; the decision is recorded.")
_action_route(RunAction.START, "Start an accepted run (policies are checked again).")
_action_route(RunAction.PAUSE, "Pause a running run after the current round.")
_action_route(
    RunAction.RESUME,
    "Resume a paused run, or a failed run whose failure is recoverable: it continues from "
    "its last saved state and catches up (policies are checked again; an unrecoverable "
    "failure answers 409 with its reason).",
)
_action_route(RunAction.ABORT, "Abort a run that has not ended.")


@router.get(
    "/{run_id}/metrics", response_model=RunMetricsPublic, dependencies=[require_roles(*READERS)]
)
def metrics(
    run_id: str,
    session: SessionDep,
    page: PageDep,
    round: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
) -> RunMetricsPublic:
    """Per-round metrics recorded by the run engine, in round order."""
    run_id = _get(session, run_id).id
    cond = [RunMetric.run_id == run_id]
    if round is not None:
        cond.append(RunMetric.round == round)
    count = session.exec(select(func.count()).select_from(RunMetric).where(*cond)).one()
    rows = session.exec(
        select(RunMetric)
        .where(*cond)
        .order_by(col(RunMetric.round), col(RunMetric.id))
        .offset(page.offset)
        .limit(page.limit)
    ).all()
    return RunMetricsPublic(data=[RunMetricPublic.model_validate(r) for r in rows], count=count)


def _sse(event: RunEvent) -> str:
    data = json.dumps(dict(event.data), separators=(",", ":"), default=str)
    return f"id: {event.seq}\nevent: {event.kind}\ndata: {data}\n\n"


def _ended(event: RunEvent) -> bool:
    return event.kind == "state" and event.data.get("state") in {s.value for s in TERMINAL_STATES}


@router.get(
    "/{run_id}/events",
    response_class=StreamingResponse,
    dependencies=[require_roles(*READERS)],
    responses={200: {"content": {"text/event-stream": {}}, "description": "Event stream"}},
)
async def events(run_id: str, request: Request, node: NodeDep) -> StreamingResponse:
    """Server-sent events of the run's progress (``state``, ``round``, ``metric`` …).

    The first event is a ``state`` snapshot; the stream ends after a terminal state.
    """
    snapshot = await run_in_threadpool(_resolved, request.app.state.engine, run_id, None)
    run_id = snapshot.id
    bus = node.events
    queue = bus.subscribe(run_id)

    async def stream() -> AsyncIterator[str]:
        try:
            first = {"state": snapshot.state.value, "version": snapshot.version}
            yield _sse(RunEvent(run_id, 0, "state", first))
            if snapshot.state in TERMINAL_STATES:
                return
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), HEARTBEAT_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        return
                    yield ": keep-alive\n\n"
                    continue
                yield _sse(event)
                if _ended(event):
                    return
        finally:
            bus.unsubscribe(run_id, queue)

    return StreamingResponse(
        stream(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
    )
