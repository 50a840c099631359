"""The node's dashboard: one page on the admin port, and the JSON snapshot it draws.

* ``GET /dashboard`` and ``GET /dashboard/static/{name}`` — the page, its script and
  its style sheet, shipped in the package (``api/static``): no CDN, works offline. They
  need no token and hold no data: until a token works the page shows only a login
  prompt.
* ``GET /v1/dashboard`` — everything the page shows, in one JSON document (admin,
  operator, auditor): the node, its peers (SWIM status, round-trip time, bytes, fault
  score, display name from the manifest), the current run, its per-round metrics
  (loss, accuracy, ε, bytes), this node's round timeline (stage by stage, per peer,
  with the likely culprit of each round), checkpoints with their shard placement and
  the holders' health, and the audit chain's status.

The run shown is the current one (:func:`current_run`): the run whose engine runs on
this node, else the newest running or paused run, else the newest pending one (proposed, accepted), else the newest that ended; a
newly proposed run thus replaces an ended one. It comes by name and run key, with its
true state, why it is in it (``state_reason``), what it waits for (``waiting``: whose
consent and until when, its start time, or what a resume waits for), the consents
known, a one-line ``headline`` and each round's outcome (``round_states``): once the
run has ended no round is ``running``; rounds it never reached are ``not_run``. A
timeline round left ``running`` by a run that no longer runs is ``interrupted``.

Live updates come from the run's server-sent events (``GET /v1/runs/{id}/events``),
which the page reads with ``fetch()`` and a streamed body rather than ``EventSource``:
``EventSource`` cannot send an ``Authorization`` header, and a token in a query string
would end up in logs and browser history. The same bearer token thus guards every
data call, and nothing else is issued.

Every string in the snapshot may come from a peer (org ids, display names, failure
details): the page only ever sets them as text (``textContent``), never as HTML; the
page's Content-Security-Policy forbids inline and foreign scripts as a second line.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from importlib import resources
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, HTTPException, Request, Response, status
from fastapi.responses import HTMLResponse
from sqlmodel import Session, col, func, select

from api.deps import NodeDep, SessionDep, observability_for, require_roles
from api.routers import ERRORS, READERS
from org_node.db.models import AuditEvent, AuditHead, Run, RunMetric, RunWaiting
from org_node.db.repo import GENESIS_HASH, audit_entry_hash
from org_node.observability import Observability
from org_node.run_store import PENDING_STATES, consents_of, waiting_of
from org_node.runs import RunState
from org_node.services import NodeServices

__all__ = [
    "CSP",
    "STATIC_FILES",
    "current_run",
    "page_router",
    "router",
    "snapshot",
]

router = APIRouter(tags=["dashboard"])
"""The snapshot route (token and role checked like every route under ``/v1``)."""

page_router = APIRouter(include_in_schema=False)
"""The public page and its assets: no data, not part of the API's schema."""

STATIC_FILES: dict[str, str] = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
"""The only files ``/dashboard/static/`` serves, with their media types."""

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
"""The page's Content-Security-Policy: its own script and style only, no inline code."""

_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_AUDIT_TAIL = 256
_METRIC_ROWS = 5000


def _static(name: str) -> bytes:
    return resources.files("api").joinpath("static", name).read_bytes()


@page_router.get("/dashboard", response_class=HTMLResponse)
def page() -> Response:
    """The dashboard page (no data: it asks for a token first)."""
    return Response(
        _static("dashboard.html"), media_type="text/html; charset=utf-8", headers=_HEADERS
    )


@page_router.get("/dashboard/static/{name}")
def static_file(name: str) -> Response:
    """The page's script and style sheet."""
    media = STATIC_FILES.get(name)
    if media is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail="no such file")
    return Response(_static(name), media_type=media, headers=_HEADERS)


@router.get("/v1/dashboard", responses=ERRORS, dependencies=[require_roles(*READERS)])
def dashboard(request: Request, session: SessionDep, node: NodeDep) -> dict[str, Any]:
    """Everything the dashboard shows, in one document (see the module docstring)."""
    return snapshot(session, node, observability_for(request))


def snapshot(session: Session, node: NodeServices, obs: Observability) -> dict[str, Any]:
    """The dashboard's JSON document (what ``GET /v1/dashboard`` answers)."""
    ident = node.identity()
    health = node.health()
    manifest = node.manifest()
    names = {m.org_id: m.display_name for m in manifest.members} if manifest else {}
    now = time.monotonic()
    received = obs.metrics.peer_bytes_received()
    scores = obs.peer_scores()
    states = {p.org_id: p for p in node.peers()}
    peers = []
    for org in sorted(set(states) | (set(names) - {ident.org_id})):
        p = states.get(org)
        peers.append(
            {
                "org_id": org,
                "display_name": names.get(org, ""),
                "status": p.status.value if p is not None else "unknown",
                "incarnation": p.incarnation if p is not None else None,
                "last_seen_s_ago": (
                    None if p is None or p.last_seen is None else max(0.0, now - p.last_seen)
                ),
                "latency_ms": None if p is None or p.rtt is None else p.rtt * 1000.0,
                "bytes_received": received.get(org, 0),
                "score": round(scores.get(org, 0.0), 3),
            }
        )
    culprit = obs.culprit()
    named = None if culprit is None else {**culprit.to_dict(), "label": obs.label(culprit.round)}
    return {
        "generated_at": time.time(),
        "node": {
            "org_id": ident.org_id,
            "display_name": ident.display_name,
            "fingerprint": ident.fingerprint,
            "endpoint": ident.endpoint,
            "version": ident.version,
            "ready": health.ready,
            "checks": dict(health.checks),
        },
        "federation": (
            None
            if manifest is None
            else {
                "name": manifest.federation,
                "version": manifest.version,
                "members": len(manifest.members),
            }
        ),
        "peers": peers,
        **_run(session, node),
        "timeline": _timeline(session, obs),
        "culprit": named,
        "checkpoints": _checkpoints(node, states, ident.org_id),
        "audit": _audit(session),
    }


_ACTIVE_STATES = (RunState.RUNNING.value, RunState.PAUSED.value)
_ENDED_STATES = frozenset(
    s.value
    for s in (
        RunState.COMPLETED,
        RunState.FAILED,
        RunState.ABORTED,
        RunState.DECLINED,
        RunState.CANCELLED,
    )
)
_BAD_STATES = frozenset(
    s.value for s in (RunState.FAILED, RunState.ABORTED, RunState.DECLINED, RunState.CANCELLED)
)
_ROUND_STATES_MAX = 1000


def current_run(session: Session, active: str = "") -> Run | None:
    """The run the dashboard follows: the one whose engine runs on this node now
    (``active``, its local id), else the newest running or paused one, else the newest
    pending one (proposed, accepted), else the newest of the others (ended)."""
    here = session.get(Run, active) if active else None
    if here is not None:
        return here
    newest = (col(Run.created_at).desc(), col(Run.updated_at).desc(), col(Run.id).desc())
    running = session.exec(
        select(Run)
        .where(col(Run.state).in_(_ACTIVE_STATES))
        .order_by(col(Run.updated_at).desc(), *newest)
        .limit(1)
    ).first()
    if running is not None:
        return running
    pending = session.exec(
        select(Run).where(col(Run.state).in_(PENDING_STATES)).order_by(*newest).limit(1)
    ).first()
    if pending is not None:
        return pending
    return session.exec(select(Run).order_by(*newest).limit(1)).first()


def _active_run_id(node: object) -> str:
    """The run whose engine runs on ``node`` now, if the node says ("" otherwise)."""
    read = getattr(node, "active_run_id", None)
    if read is None:
        return ""
    try:
        return str(read() or "")
    except Exception:  # a node that is not running has no active run to show
        return ""


def _run(session: Session, node: object = None) -> dict[str, Any]:
    """The run to show (see :func:`current_run`), what it waits for (a round under way:
    what ``node`` says it waits for), and its metrics."""
    row = current_run(session, _active_run_id(node))
    if row is None:
        return {"run": None, "metrics": []}
    spec = dict(row.spec or {})
    consents = consents_of(session, row.run_key) if row.run_key else []
    waiting = waiting_of(row, consents, node)
    rounds = spec.get("rounds")
    participants = spec.get("participants")
    run = {
        "id": row.id,
        "name": row.name,
        "run_key": row.run_key,
        "origin": row.origin,
        "state": str(row.state),
        "state_reason": row.state_reason,
        "decision_reason": row.decision_reason,
        "ended": str(row.state) in _ENDED_STATES,
        "version": row.version,
        "current_round": row.current_round,
        "rounds": rounds,
        "epsilon": spec.get("epsilon"),
        "participants": list(participants) if isinstance(participants, list) else [],
        "consents": [
            {
                "org_id": c.org_id,
                "decision": c.decision,
                "reason": c.reason,
                "decided_at": _iso(c.decided_at),
            }
            for c in consents
        ],
        "waiting": None if waiting is None else waiting.model_dump(mode="json"),
        "consent_by": _iso(row.consent_by),
        "start_at": _iso(row.start_at),
        "created_at": _iso(row.created_at),
        "updated_at": _iso(row.updated_at),
        "href": "/v1/runs/" + quote(row.run_key or row.id, safe=""),
        "headline": _headline(row, rounds, waiting),
        "tone": _tone(str(row.state), waiting),
        "round_states": _round_states(str(row.state), row.current_round, rounds),
    }
    rows = session.exec(
        select(RunMetric.round, RunMetric.name, RunMetric.value)
        .where(RunMetric.run_id == row.id)
        .order_by(col(RunMetric.round), col(RunMetric.id))
        .limit(_METRIC_ROWS)
    ).all()
    metrics = [{"round": r, "name": n, "value": v} for r, n, v in rows]
    return {"run": run, "metrics": metrics}


def _iso(at: datetime | None) -> str | None:
    if at is None:
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _when(at: datetime | None) -> str:
    """A time as the headline writes it (UTC, to the second)."""
    if at is None:
        return "an unknown time"
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _of(rounds: Any) -> str:
    return f" of {rounds}" if isinstance(rounds, int) else ""


def _headline(row: Run, rounds: Any, waiting: RunWaiting | None) -> str:
    """One line saying truthfully where the run stands, with why when it ended badly or
    what it waits for (whom, and until when)."""
    state, done = str(row.state), row.current_round
    reason = row.state_reason or row.decision_reason or ""
    if state in _BAD_STATES:
        where = ""
        if state == RunState.FAILED.value and not _finished(done, rounds):
            where = f" in round {done + 1}{_of(rounds)}"
        elif state in (RunState.FAILED.value, RunState.ABORTED.value):
            where = f" after {done}{_of(rounds)} rounds"
        return f"{state}{where}: {reason or 'no reason recorded'}"
    if state in PENDING_STATES:
        if waiting is not None and waiting.what == "consent":
            whom = (
                "the consent of " + ", ".join(waiting.orgs)
                if waiting.orgs
                else "this org's consent"
            )
            deadline = f" (deadline {_when(waiting.until)})" if waiting.until else ""
            return f"{state}: waiting for {whom}{deadline}"
        if waiting is not None and waiting.what == "start":
            return f"{state}: every consent is in; starts at {_when(waiting.until)}"
        return state
    if state == RunState.RUNNING.value:
        if waiting is not None and waiting.what == "resume":
            return f"running, waiting to resume: {waiting.detail}"
        if waiting is not None and waiting.what == "round":
            return f"running, {waiting.detail}"
        return f"running round {done + 1}{_of(rounds)}"
    if state == RunState.PAUSED.value:
        return f"paused after round {done}{_of(rounds)}" + (f": {reason}" if reason else "")
    if state == RunState.COMPLETED.value:
        return f"completed {done}{_of(rounds)} rounds"
    return state + (f": {reason}" if reason else "")


def _finished(done: int, rounds: Any) -> bool:
    return isinstance(rounds, int) and done >= rounds


def _tone(state: str, waiting: RunWaiting | None) -> str:
    """How the page colours the run's banner: bad, wait, ok or info."""
    if state in _BAD_STATES:
        return "bad"
    if state in PENDING_STATES:
        return "wait"
    if waiting is not None and (
        waiting.what != "round" or waiting.orgs or waiting.stage == "quorum"
    ):
        return "wait"
    return "ok" if state == RunState.COMPLETED.value else "info"


def _round_states(state: str, done: int, rounds: Any) -> list[dict[str, Any]]:
    """Each training round of the run (1 to ``rounds``) with what became of it: rounds up
    to ``current_round`` are ``completed``; the next is ``running``/``paused`` while the
    run is, ``failed``/``aborted`` when the run ended in it; every other one is
    ``not_run`` once the run has ended and ``upcoming`` while it may still come."""
    if not isinstance(rounds, int) or rounds < 1:
        return []
    ended = state in _ENDED_STATES
    at_next = {
        RunState.RUNNING.value: "running",
        RunState.PAUSED.value: "paused",
        RunState.FAILED.value: "failed",
        RunState.ABORTED.value: "aborted",
    }
    out = []
    for n in range(1, min(rounds, _ROUND_STATES_MAX) + 1):
        if n <= done:
            what = "completed"
        elif n == done + 1 and state in at_next:
            # an abort may come before the first round: only then is round 1 not run
            started = state != RunState.ABORTED.value or done > 0
            what = at_next[state] if started else "not_run"
        else:
            what = "not_run" if ended else "upcoming"
        out.append({"round": n, "state": what})
    return out


def _timeline(session: Session, obs: Observability) -> list[dict[str, Any]]:
    """The round timeline, with no round left ``running`` that cannot be: a round of a
    run that is no longer running here, or one a later attempt already finished, is
    ``interrupted`` (with a note saying why)."""
    lines = obs.timeline(10)
    keys = {str(line["run"]).split(":", 1)[0] for line in lines if line["state"] == "running"}
    if not keys:
        return lines
    rows = session.exec(select(Run).where(col(Run.run_key).in_(keys))).all()
    runs: dict[str, Run] = {}
    for row in rows:
        if row.run_key is None:
            continue
        seen = runs.get(row.run_key)
        if seen is None or (row.state in _ACTIVE_STATES and seen.state not in _ACTIVE_STATES):
            runs[row.run_key] = row
    per = max(1, obs.attempts_per_round)
    for line in lines:
        key, _, part = str(line["run"]).partition(":")
        run = runs.get(key)
        if line["state"] != "running" or run is None:
            continue
        training_round = int(line["round"]) // per + 1
        if not part and training_round <= run.current_round:
            note = f"a later attempt finished round {training_round}"
        elif run.state in _ACTIVE_STATES:
            continue
        else:
            reason = run.state_reason or run.decision_reason
            note = f"the run {run.state} before this round finished" + (
                f": {reason}" if reason else ""
            )
        line["state"], line["note"] = "interrupted", note
    return lines


def _checkpoints(node: NodeServices, states: dict[str, Any], me: str) -> list[dict[str, Any]]:
    """Checkpoints, each with its shard holders (when the node's replicator says) and
    whether each holder is alive in this node's membership view: ``restorable`` when at
    least ``k`` holders are alive, ``at_risk`` when that needs holders SWIM suspects."""
    replicator = getattr(node, "replicator", None)
    out = []
    for info in node.checkpoints():
        holders: list[str] | None = None
        if replicator is not None:
            try:
                holders = [str(h) for h in replicator.manifest(info.round).holders]
            except (AttributeError, KeyError, LookupError, ValueError, TypeError):
                holders = None
        shards = []
        for index, holder in enumerate(holders or []):
            state = "alive" if holder == me else _status(states.get(holder))
            shards.append({"index": index, "holder": holder, "status": state})
        alive = sum(1 for s in shards if s["status"] == "alive")
        maybe = sum(1 for s in shards if s["status"] == "suspect")
        out.append(
            {
                "checkpoint_id": info.checkpoint_id,
                "run_id": info.run_id,
                "round": info.round,
                "created_at": info.created_at,
                "data_shards": info.data_shards,
                "parity_shards": info.parity_shards,
                "sha256": info.sha256,
                "shards": shards,
                "restorable": None if holders is None else alive >= info.data_shards,
                "at_risk": holders is not None and alive < info.data_shards <= alive + maybe,
            }
        )
    return out


def _status(state: Any) -> str:
    return "unknown" if state is None else str(state.status.value)


def _audit(session: Session) -> dict[str, Any]:
    """The audit chain's status: its length, whether the head row matches the newest
    entry, and whether the newest entries (up to 256) chain and hash correctly."""
    length = session.exec(select(func.count()).select_from(AuditEvent)).one()
    tail = list(
        session.exec(select(AuditEvent).order_by(col(AuditEvent.id).desc()).limit(_AUDIT_TAIL))
    )
    tail.reverse()
    tail_ok = True
    first_bad: int | None = None
    for i, row in enumerate(tail):
        if i > 0 and row.prev_hash != tail[i - 1].entry_hash:
            tail_ok, first_bad = False, row.id
            break
        if audit_entry_hash(row.prev_hash, row.model_dump()) != row.entry_hash:
            tail_ok, first_bad = False, row.id
            break
    if tail and length <= _AUDIT_TAIL and tail[0].prev_hash != GENESIS_HASH:
        tail_ok, first_bad = False, tail[0].id
    head = session.get(AuditHead, 1)
    newest = tail[-1].entry_hash if tail else None
    if head is None:
        head_ok = not tail
    else:
        head_ok = head.length == length and (head.entry_hash == newest if tail else True)
    return {
        "events": length,
        "head": newest,
        "head_ok": head_ok,
        "checked": len(tail),
        "tail_ok": tail_ok,
        "first_bad_entry": first_bad,
        "ok": head_ok and tail_ok,
    }
