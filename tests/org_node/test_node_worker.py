"""Org nodes (in process, in-memory network) running a trainer from their config: the
trainer's code runs in each org's worker process and never in the node's."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
from coordinator_free.membership import SwimConfig
from coordinator_free.memory import InMemoryNetwork
from sqlmodel import Session

from api.app import create_app
from api.settings import Settings
from org_node.config import NodeConfig, TrainerSection
from org_node.db.models import Role
from org_node.db.repo import create_token
from org_node.engine import TrainingConfig
from org_node.node import OrgNode
from tests.org_node.test_node_inprocess import ORGS, make_federation
from tests.run_flow import apropose_once

TASK = '''\
"""A task only the worker may import: it records the process that imported it."""
import os

import torch

from org_node.tasks import Task, TaskData

IMPORTED_IN = os.getpid()


def task() -> Task:
    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Linear(4, 2)

    def data() -> TaskData:
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
        y = (x.sum(1) > 0).long()
        return TaskData(x, y, x, y)

    return Task("contained", build, data, torch.nn.functional.cross_entropy, lambda o, t: {})
'''


def _configure(dirs: dict[str, Path], code: Path) -> dict[str, str]:
    tokens = {}
    for org, d in dirs.items():
        config = NodeConfig.load(d / "fedweave.toml")
        config = config.replace(
            trainers={"contained": TrainerSection("task", f"{code}:task")},
            training=TrainingConfig(local_steps=2, batch_size=8, evaluate=False),
        )
        config.save(d / "fedweave.toml")
        from org_node.db.engine import default_database_url, make_engine

        engine = make_engine(default_database_url(d))
        with Session(engine) as s:
            _, tokens[org] = create_token(s, "test", Role.ADMIN)
            s.commit()
        engine.dispose()
    return tokens


def test_the_trainer_runs_in_the_worker_never_in_the_node(tmp_path: Path) -> None:
    code = tmp_path / "code" / "fw_contained_task.py"
    code.parent.mkdir()
    code.write_text(TASK)
    dirs = make_federation(tmp_path)
    tokens = _configure(dirs, code)
    spec = {"trainer": "contained", "rounds": 2, "participants": list(ORGS), "threshold": 2}

    async def scenario() -> dict[str, Any]:
        network = InMemoryNetwork()
        nodes = {}
        for org in ORGS:
            node = OrgNode.open(
                dirs[org],
                transport=network.transport(org),
                swim=SwimConfig(period_s=0.2, ping_timeout_s=0.08),
            )
            await node.start()
            nodes[org] = node
        clients = {
            org: httpx.AsyncClient(
                transport=httpx.ASGITransport(
                    app=create_app(Settings(data_dir=dirs[org]), node, engine=node.db)
                ),
                base_url="http://admin",
                headers={"Authorization": f"Bearer {tokens[org]}"},
            )
            for org, node in nodes.items()
        }
        try:
            ids = await apropose_once(clients, "w", spec)
            rows: dict[str, Any] = {}
            for _ in range(600):
                rows = {o: (await c.get(f"/v1/runs/{ids[o]}")).json() for o, c in clients.items()}
                if all(r["state"] in ("completed", "failed") for r in rows.values()):
                    break
                await asyncio.sleep(0.1)
            workers = {o: n.runs.active.engine.trainer for o, n in nodes.items() if n.runs.active}
            return {"rows": rows, "workers": workers}
        finally:
            for c in clients.values():
                await c.aclose()
            for node in nodes.values():
                await node.stop()

    out = asyncio.run(scenario())
    assert {r["state"] for r in out["rows"].values()} == {"completed"}, out["rows"]
    assert {r["current_round"] for r in out["rows"].values()} == {2}
    # the node process never imported the trainer's module: each org's worker did
    assert "fw_contained_task" not in sys.modules
    for org, trainer in out["workers"].items():
        log = (trainer.directory / "worker.log").read_text()
        assert "serving trainer 'contained'" in log, org
        assert trainer._proc is None  # stopped with the run
