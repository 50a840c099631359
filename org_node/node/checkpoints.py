"""The checkpoint side of the org node: the erasure-coded checkpoints of this org's
private state that its peers hold, as the admin API lists, checks and restores them,
and :func:`recover_runs` / :func:`recover_state`, which ``fedweave recover`` and a
restore run: fetch any ``k`` shards of each run's private state from the peers (one
checkpoint set per run, :func:`~org_node.node.lifecycle.state_set`), verify, decode,
decrypt, and write each engine state where :meth:`~org_node.node.runs.Runs.resume`
finds it, so that the run in progress rejoins at the round it had reached and every
run the org was in is back.

The replicator belongs to the node's loop: every method here reads it there
(:meth:`~org_node.node.context.NodeContext.read`, ``on_loop``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path

from coordinator_free.checkpoints import NoCheckpoint, recover, recover_sets
from coordinator_free.endpoint import Endpoint
from coordinator_free.sealed import RecoverySecret, atomic_write

from org_node.config import NodePaths
from org_node.engine import STATE_FILE, EngineState
from org_node.node.context import NodeContext
from org_node.node.lifecycle import STATE_SET_PREFIX
from org_node.node.runs import Runs
from org_node.services import CheckpointInfo, ServiceRefused, ShardReport, UnknownCheckpoint

__all__ = ["Checkpoints", "RecoveredRun", "recover_runs", "recover_state"]

LEGACY_SET = "state"
"""The one checkpoint set of every run's state before each run had its own."""

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
        rep = self.ctx.read(lambda: self.ctx.replicator)
        set_id = rep.set_id if rep is not None else LEGACY_SET
        endpoint = self.ctx.endpoint
        assert endpoint is not None
        path = self.ctx.on_loop(
            recover_state(
                endpoint,
                self.ctx.secret,
                manifest.member_ids,
                self.ctx.paths,
                version=version,
                set_id=set_id,
            )
        )
        logger.info("%s: restored %s into %s", self.ctx.me, checkpoint_id, path)
        return next(c for c in self.checkpoints() if c.checkpoint_id == checkpoint_id)


@dataclass(frozen=True)
class RecoveredRun:
    """One run's engine state brought back from the peers, and where it was written."""

    run_key: str
    round: int
    status: str
    path: Path


async def recover_runs(
    endpoint: Endpoint,
    secret: RecoverySecret,
    peers: tuple[str, ...] | list[str],
    paths: NodePaths,
    *,
    timeout: float = 60.0,
) -> tuple[list[RecoveredRun], dict[str, str]]:
    """The newest checkpoint of every run of this org, each written as its run's engine
    state (the run in progress first: ``running``, then the newest), and why each run's
    set that could not be rebuilt was not."""
    got, lost = await recover_sets(
        endpoint, secret, peers, prefix=STATE_SET_PREFIX, legacy=LEGACY_SET, timeout=timeout
    )
    newest: dict[str, tuple[int, float, EngineState, bytes]] = {}
    for checkpoint in got.values():
        state = EngineState.from_bytes(checkpoint.state)
        seen = newest.get(state.run_key)
        if seen is None or (state.round, checkpoint.manifest.created_at) > seen[:2]:
            newest[state.run_key] = (
                state.round,
                checkpoint.manifest.created_at,
                state,
                checkpoint.state,
            )
    runs = []
    for key, (_round, at, state, data) in newest.items():
        rounds = (state.plan.get("spec") or {}).get("rounds")
        if state.status == "running" and rounds is not None and state.round >= int(rounds):
            # checkpointed after its last round, before it was marked done: it ended
            state.status = "completed"
            data = state.to_bytes()
        path = await asyncio.to_thread(_write_state, paths, key, data)
        recovered = RecoveredRun(key, state.round, state.status, path)
        runs.append((state.status != "running", -at, recovered))
    return [r for *_, r in sorted(runs, key=lambda x: (x[0], x[1], x[2].run_key))], lost


async def recover_state(
    endpoint: Endpoint,
    secret: RecoverySecret,
    peers: tuple[str, ...] | list[str],
    paths: NodePaths,
    *,
    version: int | None = None,
    set_id: str | None = None,
    timeout: float = 60.0,
) -> Path:
    """Fetch this org's private state from its peers and write it as its run's engine
    state; returns that file. Without ``set_id`` every run is recovered
    (:func:`recover_runs`) and the file of the run in progress is returned; with it,
    ``version`` (default: the newest) of that one set."""
    if set_id is None and version is None:
        runs, lost = await recover_runs(endpoint, secret, peers, paths, timeout=timeout)
        if not runs:
            raise NoCheckpoint("; ".join(f"{s}: {why}" for s, why in sorted(lost.items())))
        return runs[0].path
    recovered = await recover(
        endpoint, secret, peers, set_id=set_id or LEGACY_SET, version=version, timeout=timeout
    )
    state = EngineState.from_bytes(recovered.state)
    return await asyncio.to_thread(_write_state, paths, state.run_key, recovered.state)


def _write_state(paths: NodePaths, run_key: str, data: bytes) -> Path:
    """Write a recovered engine state where the run's engine finds it (fsyncs)."""
    path = paths.run_dir(run_key) / STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data)
    return path
