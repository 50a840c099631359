"""``/v1/checkpoints``: list the node's erasure-coded checkpoints, verify their shards at
the holders, restore one. The node's checkpoint store does the work."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from pydantic import BaseModel

from api.deps import NodeDep, require_roles
from api.routers import ADMIN, ERRORS, READERS, WRITERS, conflict, not_found
from org_node.services import CheckpointInfo, ServiceRefused, UnknownCheckpoint

__all__ = ["CheckpointPublic", "CheckpointsPublic", "ShardReportPublic", "router"]

router = APIRouter(prefix="/v1/checkpoints", tags=["checkpoints"], responses=ERRORS)
CheckpointId = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")]


class CheckpointPublic(BaseModel):
    checkpoint_id: str
    run_id: str
    round: int
    created_at: float
    data_shards: int
    parity_shards: int
    sha256: str


class CheckpointsPublic(BaseModel):
    data: list[CheckpointPublic]
    count: int


class ShardReportPublic(BaseModel):
    checkpoint_id: str
    healthy: int
    missing: list[str]
    corrupt: list[str]
    restorable: bool


def _public(c: CheckpointInfo) -> CheckpointPublic:
    return CheckpointPublic(**vars(c))


@router.get("", response_model=CheckpointsPublic, dependencies=[require_roles(*READERS)])
def list_checkpoints(node: NodeDep) -> CheckpointsPublic:
    data = [_public(c) for c in node.checkpoints()]
    return CheckpointsPublic(data=data, count=len(data))


@router.post(
    "/{checkpoint_id}/verify",
    response_model=ShardReportPublic,
    dependencies=[require_roles(*WRITERS)],
)
def verify(checkpoint_id: CheckpointId, node: NodeDep) -> ShardReportPublic:
    """Ask every shard holder for its shard and check it against the shard hashes."""
    try:
        r = node.verify_checkpoint(checkpoint_id)
    except UnknownCheckpoint:
        raise not_found("checkpoint") from None
    except ServiceRefused as exc:
        raise conflict(str(exc)) from None
    return ShardReportPublic(
        checkpoint_id=r.checkpoint_id,
        healthy=r.healthy,
        missing=list(r.missing),
        corrupt=list(r.corrupt),
        restorable=r.restorable,
    )


@router.post(
    "/{checkpoint_id}/restore",
    response_model=CheckpointPublic,
    dependencies=[require_roles(*ADMIN)],
)
def restore(checkpoint_id: CheckpointId, node: NodeDep) -> CheckpointPublic:
    """Rebuild the node's state from any k shards of the checkpoint."""
    try:
        return _public(node.restore_checkpoint(checkpoint_id))
    except UnknownCheckpoint:
        raise not_found("checkpoint") from None
    except ServiceRefused as exc:
        raise conflict(str(exc)) from None
