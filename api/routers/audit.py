"""``/v1/audit``: the hash-chained audit log — filtered, paginated events and a report.

The report counts events and bytes by peer and by kind over a filter, and re-verifies
the chain over the whole log (every ``prev_hash`` is its predecessor's ``entry_hash``,
every ``entry_hash`` recomputes). Signed chain heads and the compliance report belong
to the audit log module and extend this report.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Response, status
from pydantic import BaseModel
from pydantic_core import to_json
from sqlmodel import col, func, select

from api.deps import PageDep, SessionDep, require_roles
from api.routers import AUDIT_READERS, ERRORS
from org_node.db.models import AuditEvent, AuditEventsPublic, AuditHead
from org_node.db.repo import GENESIS_HASH, audit_entry_hash

__all__ = ["AuditReport", "router"]

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
) -> list[Any]:
    cond: list[Any] = []
    if run is not None:
        cond.append(AuditEvent.run == run)
    if peer is not None:
        cond.append(AuditEvent.peer == peer)
    if kind is not None:
        cond.append(AuditEvent.kind == kind)
    if since is not None:
        cond.append(col(AuditEvent.time) >= since)
    if until is not None:
        cond.append(col(AuditEvent.time) < until)
    return cond


@router.get("/events", response_model=AuditEventsPublic)
def list_events(
    session: SessionDep,
    page: PageDep,
    run: _Name = None,
    peer: _Name = None,
    kind: _Name = None,
    since: _Time = None,
    until: _Time = None,
) -> Response:
    """Audit events in log order, filtered by run, peer, kind and time.

    The hot path of a compliance export: rows are read as plain column tuples (no ORM
    objects) and encoded straight to JSON.
    """
    cond = _filters(run, peer, kind, _instant(since, "since"), _instant(until, "until"))
    count = session.exec(select(func.count()).select_from(AuditEvent).where(*cond)).one()
    table = AuditEvent.__table__  # type: ignore[attr-defined]
    result = session.execute(
        table.select().where(*cond).order_by(table.c.id).offset(page.offset).limit(page.limit)
    )
    keys = list(result.keys())
    # The rows come from typed columns whose names are AuditEventPublic's fields, so they
    # are serialized as they are (pydantic_core's encoder), without re-validation.
    data = [dict(zip(keys, row, strict=True)) for row in result.all()]
    return Response(to_json({"data": data, "count": count}), media_type="application/json")


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
