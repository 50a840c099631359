"""Fault localization with real node processes: one org's node is killed in the middle
of a run, and both survivors name it as the likely culprit in ``GET /v1/node`` (what
``fedweave status`` prints), with the evidence, while the run goes on without it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.nodes import running_nodes

pytestmark = pytest.mark.e2e

ORGS = ("lab-1", "lab-2", "lab-3")


def test_survivors_name_the_killed_node(tmp_path: Path) -> None:
    with running_nodes(tmp_path, ORGS, local_steps=2) as nodes:
        spec = {"task": "tabular", "rounds": 4, "participants": list(ORGS), "threshold": 2}
        run_ids = nodes.propose_and_accept("culprit-demo", spec)
        nodes.start(run_ids)
        first = ORGS[0]
        with nodes.client(first) as c:
            end = time.monotonic() + 60
            while c.get(f"/v1/runs/{run_ids[first]}").json()["current_round"] < 1:
                assert time.monotonic() < end, "no round completed"
                time.sleep(0.1)

        dead = ORGS[2]
        proc = nodes.procs[dead]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

        named: dict[str, Any] = {}
        end = time.monotonic() + 60
        while time.monotonic() < end and len(named) < 2:
            for org in ORGS[:2]:
                with nodes.client(org) as c:
                    culprit = c.get("/v1/node").json()["culprit"]
                if culprit is not None and culprit["org"] == dead:
                    named[org] = culprit
            time.sleep(0.2)
        assert set(named) == set(ORGS[:2]), named
        for culprit in named.values():
            assert culprit["score"] >= 2.0 and culprit["evidence"], culprit
            assert any(dead in e or "send" in e for e in culprit["evidence"]), culprit
        with nodes.client(first) as c:
            metrics = c.get("/metrics").text
        assert f'peer="{dead}"' in metrics
