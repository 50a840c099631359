"""The checkpoint side of the org node: the erasure-coded checkpoints of this org's
private state that its peers hold, as the admin API lists, checks and restores them,
and :func:`recover_state`, which ``fedweave recover`` and a restore run: fetch any
``k`` shards of this org's private state from its peers, verify, decode, decrypt, and
write the engine state where :meth:`~org_node.node.runs.Runs.resume` finds it (rejoining
the run at the round it had reached).

The replicator belongs to the node's loop: every method here reads it there
(:meth:`~org_node.node.context.NodeContext.read`, ``on_loop``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from coordinator_free.checkpoints import recover
from coordinator_free.endpoint import Endpoint
from coordinator_free.sealed import RecoverySecret, atomic_write

from org_node.config import NodePaths
from org_node.engine import STATE_FILE, EngineState
from org_node.node.context import NodeContext
from org_node.node.runs import Runs
from org_node.services import CheckpointInfo, ServiceRefused, ShardReport, UnknownCheckpoint

__all__ = ["Checkpoints", "recover_state"]

logger = logging.getLogger("org_node.node")


class Checkpoints:
    """This org's checkpoints at its peers (see the module docstring)."""

    def __init__(self, ctx: NodeContext, runs: Runs) -> None:
        self.ctx = ctx
        self.runs = runs

    def checkpoints(self) -> list[CheckpointInfo]:
        if self.ctx.loop is None:
            return []
        return self.ctx.read(self._list)

    def _list(self) -> list[CheckpointInfo]:
        rep = self.ctx.replicator
        if rep is None:
            return []
        active = self.runs.active
        run_id = active.run_id if active is not None else ""
        out = []
        for v in rep.versions:
            m = rep.manifest(v)
            out.append(
                CheckpointInfo(
                    checkpoint_id=f"state-{v}",
                    run_id=run_id,
                    round=v,
                    created_at=float(m.created_at),
                    data_shards=m.k,
                    parity_shards=m.m,
                    sha256=m.merkle_root.hex(),
                )
            )
        return out

    def _version(self, checkpoint_id: str) -> int:
        prefix, _, num = checkpoint_id.partition("-")
        rep = self.ctx.replicator
        if prefix != "state" or not num.isdigit() or rep is None or int(num) not in rep.versions:
            raise UnknownCheckpoint(f"no checkpoint {checkpoint_id!r}")
        return int(num)

    def verify(self, checkpoint_id: str) -> ShardReport:
        version = self.ctx.read(lambda: self._version(checkpoint_id))
        return self.ctx.on_loop(self._verify(checkpoint_id, version))

    async def _verify(self, checkpoint_id: str, version: int) -> ShardReport:
        rep, membership = self.ctx.replicator, self.ctx.membership
        assert rep is not None and membership is not None
        await rep.repair(audit=True)
        m = rep.manifest(version)
        live = set(membership.live())
        missing = tuple(sorted({h for h in m.holders if h and h not in live}))
        healthy = sum(1 for h in m.holders if h and h in live)
        return ShardReport(checkpoint_id, healthy, missing, (), healthy >= m.k)

    def restore(self, checkpoint_id: str) -> CheckpointInfo:
        version = self.ctx.read(lambda: self._version(checkpoint_id))
        if self.runs.engine_status() == "running":
            raise ServiceRefused("pause and abort the active run before restoring its state")
        manifest = self.ctx.require_manifest()
        endpoint = self.ctx.endpoint
        assert endpoint is not None
        path = self.ctx.on_loop(
            recover_state(
                endpoint, self.ctx.secret, manifest.member_ids, self.ctx.paths, version=version
            )
        )
        logger.info("%s: restored %s into %s", self.ctx.me, checkpoint_id, path)
        return next(c for c in self.checkpoints() if c.checkpoint_id == checkpoint_id)


async def recover_state(
    endpoint: Endpoint,
    secret: RecoverySecret,
    peers: tuple[str, ...] | list[str],
    paths: NodePaths,
    *,
    version: int | None = None,
    timeout: float = 60.0,
) -> Path:
    """Fetch any ``k`` shards of this org's private state, verify, decode, decrypt, and
    write it as the engine state of its run; returns that file."""
    recovered = await recover(endpoint, secret, peers, version=version, timeout=timeout)
    state = EngineState.from_bytes(recovered.state)
    path = paths.run_dir(state.run_key) / STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, recovered.state)
    return path
