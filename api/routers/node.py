"""``/v1/node`` (identity, version, health), ``/healthz``, ``/readyz`` and ``/metrics``.

``/healthz`` answers as long as the process serves requests; ``/readyz`` also checks the
database and the node's own readiness (503 when either fails). ``/metrics`` is the
Prometheus text format and needs a token like every other route under the admin port.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel
from sqlalchemy import text
from sqlmodel import func, select

from api.deps import NodeDep, SessionDep, observability_for, require_roles
from api.routers import ERRORS, READERS
from org_node.db.models import AuditEvent, Dataset, Run

__all__ = ["NodePublic", "Readiness", "SuspectPublic", "router"]

router = APIRouter(tags=["node"])


class SuspectPublic(BaseModel):
    """The likely culprit of a recent slow or failed round, as this node sees it."""

    org: str
    score: float
    evidence: list[str]
    round: int
    run: str


class NodePublic(BaseModel):
    org_id: str
    display_name: str
    fingerprint: str
    endpoint: str
    version: str
    ready: bool
    checks: dict[str, str]
    culprit: SuspectPublic | None = None


class Readiness(BaseModel):
    ready: bool
    checks: dict[str, str]


@router.get(
    "/v1/node",
    response_model=NodePublic,
    responses=ERRORS,
    dependencies=[require_roles(*READERS)],
)
def node_info(request: Request, node: NodeDep) -> NodePublic:
    """Who this node is, which version it runs, its health, and the likely culprit of
    its newest slow or failed round (None when no peer stands out)."""
    ident = node.identity()
    health = node.health()
    suspect = observability_for(request).culprit()
    return NodePublic(
        org_id=ident.org_id,
        display_name=ident.display_name,
        fingerprint=ident.fingerprint,
        endpoint=ident.endpoint,
        version=ident.version,
        ready=health.ready,
        checks=dict(health.checks),
        culprit=None
        if suspect is None
        else SuspectPublic(
            org=suspect.org,
            score=round(suspect.score, 3),
            evidence=list(suspect.evidence),
            round=suspect.round,
            run=suspect.run,
        ),
    )


@router.get("/healthz", response_model=Readiness)
async def healthz() -> Readiness:
    """Liveness: the process answers (on the event loop, no worker thread)."""
    return Readiness(ready=True, checks={"process": "ok"})


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Not ready"}},
)
def readyz(session: SessionDep, node: NodeDep, response: Response) -> Readiness:
    """Readiness: the database answers and the node says it is ready."""
    checks: dict[str, str] = {}
    try:
        session.exec(select(text("1"))).one()
        checks["database"] = "ok"
    except Exception as exc:  # any driver error means "not ready", reported by type only
        checks["database"] = f"unavailable ({type(exc).__name__})"
    health = node.health()
    checks.update(health.checks)
    ready = health.ready and checks["database"] == "ok"
    if not ready:
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    return Readiness(ready=ready, checks=checks)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={**ERRORS, 200: {"content": {"text/plain": {}}, "description": "Prometheus"}},
    dependencies=[require_roles(*READERS)],
)
def metrics(request: Request, session: SessionDep, node: NodeDep) -> PlainTextResponse:
    """Prometheus text exposition format 0.0.4."""
    lines: list[str] = []

    def gauge(name: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} gauge")
        for labels, value in samples:
            lines.append(f"{name}{labels} {value:g}")

    by_state = session.exec(select(Run.state, func.count()).group_by(Run.state)).all()
    gauge("fedweave_runs", "Runs by state.", [(f'{{state="{s}"}}', n) for s, n in by_state])
    n_datasets = session.exec(select(func.count()).select_from(Dataset)).one()
    gauge("fedweave_datasets", "Registered datasets.", [("", n_datasets)])
    n_audit = session.exec(select(func.count()).select_from(AuditEvent)).one()
    gauge("fedweave_audit_events", "Entries in the audit log.", [("", n_audit)])
    peers = node.peers()
    counts: dict[str, int] = {}
    for p in peers:
        counts[p.status.value] = counts.get(p.status.value, 0) + 1
    gauge(
        "fedweave_peers", "Peers by status.", [(f'{{status="{s}"}}', n) for s, n in counts.items()]
    )
    requests = request.app.state.request_counts
    lines.append("# HELP fedweave_http_requests_total Requests answered, by status class.")
    lines.append("# TYPE fedweave_http_requests_total counter")
    for klass, n in sorted(requests.items()):
        lines.append(f'fedweave_http_requests_total{{class="{klass}"}} {n}')
    stages = observability_for(request).render_metrics()
    return PlainTextResponse(
        "\n".join(lines) + "\n" + stages, media_type="text/plain; version=0.0.4; charset=utf-8"
    )
