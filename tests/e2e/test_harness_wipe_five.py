"""End to end, five orgs: one org's data directory is wiped mid-training, the org is
rebuilt from the checkpoint shards its peers hold, and trains again with all five.

Real ``fedweave run`` processes on 127.0.0.1 driven by the harness (``--orgs 5
--rounds 3 --wipe org3@1:hold``); assertions on ``summary.json`` only. Every org pauses
the run after round 1 (so no round is in flight at the wipe); the others resume it once
org3 is back with round 1's state and all five see each other alive.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from org_node.harness.nodes import port_is_free
from org_node.harness.runner import run_harness
from org_node.harness.scenario import Scenario, Wipe, parse_wipe
from org_node.harness.verdict import finish
from tests.e2e.test_harness import _common

pytestmark = pytest.mark.e2e

ORGS = ["org1", "org2", "org3", "org4", "org5"]
OTHERS = ["org1", "org2", "org4", "org5"]


def _run(scenario: Scenario, out: Path, timeout: float) -> dict[str, Any]:
    ports: list[int] = []

    def started(obs: Any, pids: list[int]) -> None:
        for node in obs.nodes.values():
            ports.extend([node.peer_port, node.admin_port, node.public_peer_port])

    obs = run_harness(scenario, out, timeout=timeout, on_started=started)
    finish(obs)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    # every process the harness started is gone, every port it used is free again
    assert all(n.proc is not None and n.proc.poll() is not None for n in obs.nodes.values())
    assert ports and all(port_is_free(p) for p in ports)
    return summary


def test_wipe_hold_is_parsed() -> None:
    assert parse_wipe("org3@1:hold") == Wipe("org3", 1, hold=True)
    assert str(Wipe("org3", 1, hold=True)) == "org3@1:hold"
    assert parse_wipe("org3@1") == Wipe("org3", 1)


@pytest.mark.timeout(600)
def test_five_orgs_one_wiped_recovers_from_peers_and_all_five_train_on(tmp_path: Path) -> None:
    scenario = Scenario(orgs=5, rounds=3, seed=2, wipes=(Wipe("org3", 1, hold=True),))
    summary = _run(scenario, tmp_path / "wipe5", timeout=300)
    # every org finished with the same model, the federated model equals plaintext
    # FedAvg recomputed over each round's survivors, every audit log verifies
    _common(summary, scenario, ORGS)
    (fault,) = summary["faults"]
    assert fault["kind"] == "wipe" and fault["org"] == "org3" and fault["round"] == 1
    assert fault["rounds_done_at_wipe"] >= 1
    assert fault["held_by"] == OTHERS
    # rebuilt from its peers' shards: its disk was deleted, its offline backup holds the
    # recovery secret only, yet it came back with the state of a trained round
    (rec,) = summary["recoveries"]
    assert rec["org"] == "org3" and rec["recover_exit"] == 0
    assert rec["recovered_round"] >= 1 and rec["outcome"] == "restarted"
    assert rec["resumed_by"] == OTHERS
    assert rec["finished"] is True and rec["final_round"] == 3
    assert summary["states"] == {org: "completed" for org in ORGS}
    # every round has all five: before the wipe, and both rounds after the recovery
    assert rec["caught_up_before_resume"] is True
    assert fault["held_at_round"] == 1
    assert summary["survivors"] == {str(r): ORGS for r in (1, 2, 3)}
    assert summary["harness_check"]["rounds"] == 3
