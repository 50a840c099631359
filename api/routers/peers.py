"""``/v1/peers``: the live view of the federation's other members (SWIM status,
incarnation, seconds since last heard from, smoothed round-trip time)."""

from __future__ import annotations

import time

from fastapi import APIRouter
from pydantic import BaseModel

from api.deps import NodeDep, require_roles
from api.routers import ERRORS, READERS

__all__ = ["PeerPublic", "PeersPublic", "router"]

router = APIRouter(
    prefix="/v1/peers", tags=["peers"], responses=ERRORS, dependencies=[require_roles(*READERS)]
)


class PeerPublic(BaseModel):
    org_id: str
    status: str
    incarnation: int
    last_seen_s_ago: float | None
    latency_ms: float | None
    """Smoothed round-trip time of direct pings (what SWIM's ping timeout follows)."""


class PeersPublic(BaseModel):
    data: list[PeerPublic]
    count: int


@router.get("", response_model=PeersPublic)
def list_peers(node: NodeDep) -> PeersPublic:
    """Every member in the node's membership view, by org id."""
    now = time.monotonic()
    data = [
        PeerPublic(
            org_id=p.org_id,
            status=p.status.value,
            incarnation=p.incarnation,
            last_seen_s_ago=None if p.last_seen is None else max(0.0, now - p.last_seen),
            latency_ms=None if p.rtt is None else p.rtt * 1000.0,
        )
        for p in sorted(node.peers(), key=lambda p: p.org_id)
    ]
    return PeersPublic(data=data, count=len(data))
