"""``/v1/audit``: the hash-chained audit log — filtered, paginated events and a report —
and the signed privacy report of each run.

The ``/report`` totals count events and bytes by peer and by kind over a filter, and
re-verify the chain over the whole log (every ``prev_hash`` is its predecessor's
``entry_hash``, every ``entry_hash`` recomputes).

The privacy report of a run (``docs/SECURITY.md``, "Privacy audit"; schema
``org_node/audit/schema/report-v1.json``) is built by the node from its database and
signed egress log (:class:`org_node.services.RunReports`):
``POST /v1/audit/runs/{run_id}/report`` generates and stores it, ``GET`` returns the
stored JSON and ``GET .../report.html`` the same report as one self-contained page.
An unknown run is 404; a run whose messages no signed head covers yet is 409.
"""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Response, status
from fastapi.responses import HTMLResponse
from pydantic import BaseModel
from pydantic_core import to_json
from sqlalchemy import ColumnClause, literal_column
from sqlmodel import Session, col, func, select

from api.deps import NodeDep, Page, PageDep, SessionDep, SettingsDep, require_roles
from api.routers import AUDIT_READERS, ERRORS, conflict, not_found, run_or_404
from api.settings import Settings
from org_node.audit.facts import UnknownRunId
from org_node.audit.html import render_html
from org_node.audit.report import ReportError, report_to_bytes
from org_node.db.models import AuditEvent, AuditEventsPublic, AuditHead, Run
from org_node.db.repo import GENESIS_HASH, audit_entry_hash
from org_node.run_store import AmbiguousRun, RunNotFound, resolve_run
from org_node.services import PeerHeads, RunReports, ServiceError

__all__ = ["AuditReport", "events_page_generic", "events_page_sqlite", "report_dir", "router"]

router = APIRouter(
    prefix="/v1/audit",
    tags=["audit"],
    responses=ERRORS,
    dependencies=[require_roles(*AUDIT_READERS)],
)

_Name = Annotated[str | None, Query(min_length=1, max_length=100)]
_Time = Annotated[
    str | None,
    Query(
        min_length=10,
        max_length=64,
        json_schema_extra={"format": "date-time"},
        description="RFC 3339 date-time; without an offset it is taken as UTC.",
    ),
]


def _instant(value: str | None, name: str) -> datetime | None:
    """Parse an RFC 3339 timestamp strictly (no bare numbers); 422 otherwise."""
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value.upper())
    except ValueError:
        raise HTTPException(
            status_code=status.HTTP_422_UNPROCESSABLE_CONTENT,
            detail=f"{name} is not an RFC 3339 date-time",
        ) from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


class AuditReport(BaseModel):
    events: int
    bytes_total: int
    bytes_by_peer: dict[str, int]
    events_by_kind: dict[str, int]
    chain_ok: bool
    """Every entry links to its predecessor and recomputes, and the head names the last."""
    chain_length: int
    first_bad_entry: int | None
    head_ok: bool
    """The stored chain head equals the last entry's hash and the chain's length."""


def _filters(
    run: str | None,
    peer: str | None,
    kind: str | None,
    since: datetime | None,
    until: datetime | None,
    round: int | None = None,
    privacy_class: str | None = None,
) -> list[Any]:
    cond: list[Any] = []
    if round is not None:
        cond.append(AuditEvent.round == round)
    if privacy_class is not None:
        cond.append(AuditEvent.privacy_class == privacy_class)
    if run is not None:
        cond.append(col(AuditEvent.run).in_(run.split("\0")))
    if peer is not None:
        cond.append(AuditEvent.peer == peer)
    if kind is not None:
        cond.append(AuditEvent.kind == kind)
    if since is not None:
        cond.append(col(AuditEvent.time) >= since)
    if until is not None:
        cond.append(col(AuditEvent.time) < until)
    return cond


_EVENTS = AuditEvent.__table__  # type: ignore[attr-defined]


def _pydantic_utc(column: str) -> str:
    """SQL turning SQLite's stored UTC time ``YYYY-MM-DD HH:MM:SS.ffffff`` into the text
    pydantic writes for that datetime: ``YYYY-MM-DDTHH:MM:SS.ffffffZ``, without the
    fraction when it is zero."""
    c = f'"{column}"'
    return (
        f"CASE WHEN substr({c}, 21) = '000000' "
        f"THEN substr({c}, 1, 10) || 'T' || substr({c}, 12, 8) || 'Z' "
        f"ELSE substr({c}, 1, 10) || 'T' || substr({c}, 12) || 'Z' END"
    )


_SQLITE_EVENT_JSON: ColumnClause[str] = literal_column(
    "json_object("
    + ", ".join(
        f"'{c.name}', " + (_pydantic_utc(c.name) if c.name == "time" else f'"{c.name}"')
        for c in _EVENTS.columns
    )
    + ")"
)
"""One event as the JSON object the generic path writes (same keys, same order)."""
_SQLITE_TIME_AS_STORED: ColumnClause[bool] = literal_column(
    """length("time") = 26 AND substr("time", 11, 1) = ' ' AND substr("time", 20, 1) = '.'"""
)
"""True when the stored time has the one form :data:`_SQLITE_EVENT_JSON` converts."""


def events_page_generic(session: Session, cond: list[Any], page: Page) -> list[dict[str, Any]]:
    """The page's events as dicts of typed values (any database)."""
    result = session.execute(
        _EVENTS.select().where(*cond).order_by(_EVENTS.c.id).offset(page.offset).limit(page.limit)
    )
    keys = list(result.keys())
    return [dict(zip(keys, row, strict=True)) for row in result.all()]


def events_page_sqlite(session: Session, cond: list[Any], page: Page) -> list[str] | None:
    """The page's events encoded to JSON objects by SQLite itself, in log order; None when
    a stored time is not in the form this encoding knows (the generic path answers)."""
    rows = session.execute(
        select(_SQLITE_EVENT_JSON, _SQLITE_TIME_AS_STORED)
        .select_from(_EVENTS)
        .where(*cond)
        .order_by(_EVENTS.c.id)
        .offset(page.offset)
        .limit(page.limit)
    ).all()
    if not all(ok for _, ok in rows):
        return None
    return [obj for obj, _ in rows]


@router.get("/events", response_model=AuditEventsPublic)
def list_events(
    session: SessionDep,
    page: PageDep,
    run: _Name = None,
    peer: _Name = None,
    kind: _Name = None,
    since: _Time = None,
    until: _Time = None,
    round: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    privacy_class: _Name = None,
) -> Response:
    """Audit events in log order, filtered by run, round, peer, kind, privacy class and
    time.

    The hot path of a compliance export: no ORM objects and no re-validation. On SQLite
    the database encodes each event to JSON itself (:func:`events_page_sqlite`, the same
    text as the generic path); elsewhere rows are read as plain column tuples, whose
    typed columns are ``AuditEventPublic``'s fields, and encoded straight to JSON.
    """
    if run is not None:  # a run's events carry its local id or its run key
        with contextlib.suppress(RunNotFound, AmbiguousRun):
            row = resolve_run(session, run)
            run = "\0".join(sorted({row.id, row.run_key or row.id, run}))
    cond = _filters(
        run,
        peer,
        kind,
        _instant(since, "since"),
        _instant(until, "until"),
        round,
        privacy_class,
    )
    count = session.exec(select(func.count()).select_from(AuditEvent).where(*cond)).one()
    encoded = None
    if session.get_bind().dialect.name == "sqlite":
        encoded = events_page_sqlite(session, cond, page)
    if encoded is None:
        data = events_page_generic(session, cond, page)
        return Response(to_json({"data": data, "count": count}), media_type="application/json")
    body = '{"data":[' + ",".join(encoded) + '],"count":' + str(int(count)) + "}"
    return Response(body.encode("utf-8"), media_type="application/json")


@router.get("/report", response_model=AuditReport)
def report(
    session: SessionDep,
    run: _Name = None,
    peer: _Name = None,
    since: _Time = None,
    until: _Time = None,
) -> AuditReport:
    """Totals over the filtered events, and a verification of the whole chain."""
    cond = _filters(run, peer, None, _instant(since, "since"), _instant(until, "until"))
    events, total = session.exec(
        select(func.count(), func.coalesce(func.sum(AuditEvent.bytes), 0)).where(*cond)
    ).one()
    by_peer = session.exec(
        select(AuditEvent.peer, func.sum(AuditEvent.bytes))
        .where(*cond, col(AuditEvent.peer).is_not(None))
        .group_by(AuditEvent.peer)
    ).all()
    by_kind = session.exec(
        select(AuditEvent.kind, func.count()).where(*cond).group_by(AuditEvent.kind)
    ).all()
    prev, length, bad = GENESIS_HASH, 0, None
    for row in session.exec(select(AuditEvent).order_by(col(AuditEvent.id))):
        length += 1
        fields = row.model_dump()
        if row.prev_hash != prev or audit_entry_hash(prev, fields) != row.entry_hash:
            bad = row.id
            break
        prev = row.entry_hash
    stored = session.get(AuditHead, 1)
    head_ok = (
        bad is None and stored is not None and stored.entry_hash == prev and stored.length == length
    )
    return AuditReport(
        events=events,
        bytes_total=int(total),
        bytes_by_peer={str(p): int(b) for p, b in by_peer},
        events_by_kind={k: int(n) for k, n in by_kind},
        chain_ok=bad is None and head_ok,
        chain_length=length,
        first_bad_entry=bad,
        head_ok=head_ok,
    )


# --------------------------------------------------------------------------- run reports


def report_dir(settings: Settings) -> Path:
    """Where the node keeps the privacy reports the API generated."""
    return settings.data_dir / "audit" / "reports"


_known_run = run_or_404


def _file_key(row: Run) -> str:
    """What the stored report files are named by: the federation run key."""
    return row.run_key or row.id


def _stored(settings: Settings, row: Run, suffix: str) -> Path:
    key = _file_key(row)
    path = report_dir(settings) / f"{key}{suffix}"
    if not path.is_file():
        raise HTTPException(
            status_code=status.HTTP_404_NOT_FOUND,
            detail=f"no report of run {row.name} yet: POST /v1/audit/runs/{key}/report",
        )
    return path


_REPORT_JSON: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/json": {}}, "description": "The signed report"}
}


@router.post(
    "/runs/{run_id}/report",
    status_code=status.HTTP_201_CREATED,
    response_class=Response,
    responses={201: _REPORT_JSON[200]},
)
def generate_report(
    run_id: str, session: SessionDep, node: NodeDep, settings: SettingsDep
) -> Response:
    """Build the run's signed privacy report now, store it (JSON and HTML) under the run
    key, return it."""
    row = _known_run(session, run_id)
    if not isinstance(node, RunReports):
        raise conflict("this node does not write privacy reports")
    try:
        report = node.run_report(row.id)
    except UnknownRunId:
        raise not_found("run") from None
    except ReportError as exc:
        raise conflict(f"cannot report run {row.name} yet: {exc}") from None
    except ServiceError as exc:
        raise conflict(str(exc)) from None
    body = report_to_bytes(report)
    out = report_dir(settings)
    out.mkdir(parents=True, exist_ok=True)
    for suffix, data in ((".json", body), (".html", render_html(report).encode("utf-8"))):
        tmp = out / f"{_file_key(row)}{suffix}.tmp"
        tmp.write_bytes(data)
        tmp.replace(out / f"{_file_key(row)}{suffix}")
    return Response(body, status_code=status.HTTP_201_CREATED, media_type="application/json")


@router.get("/peer-heads")
def peer_heads(node: NodeDep) -> dict[str, Any]:
    """The signed heads of this org's egress log that its live members hold, asked now:
    what ``fedweave audit verify --from-peers`` checks the log against (a log cut
    short or rewritten after a head no longer matches it)."""
    if not isinstance(node, PeerHeads):
        raise conflict("this node does not exchange audit heads")
    try:
        heads = node.peer_heads()
    except ServiceError as exc:
        raise conflict(str(exc)) from None
    data = [h.to_dict() for h in heads]
    return {"data": data, "count": len(data)}


@router.get("/runs/{run_id}/report", response_class=Response, responses=_REPORT_JSON)
def read_report(run_id: str, session: SessionDep, settings: SettingsDep) -> Response:
    """The stored report of the run, as signed (the verifiable JSON form)."""
    row = _known_run(session, run_id)
    return Response(_stored(settings, row, ".json").read_bytes(), media_type="application/json")


_REPORT_HTML: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/html": {"schema": {"type": "string"}}},
        "description": "The report as one self-contained HTML page",
    }
}


@router.get("/runs/{run_id}/report.html", response_class=Response, responses=_REPORT_HTML)
def read_report_html(run_id: str, session: SessionDep, settings: SettingsDep) -> HTMLResponse:
    """The stored report as one self-contained HTML page (no external references)."""
    row = _known_run(session, run_id)
    return HTMLResponse(_stored(settings, row, ".html").read_text(encoding="utf-8"))
