"""Finding 7 end to end: latency is not death. Three real ``fedweave run`` nodes whose
every peer byte is held 60 ms by the harness's relays (a round trip of at least 120 ms,
above the harness's 80 ms ping floor) complete every round with every org in it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from org_node.harness.runner import run_harness
from org_node.harness.scenario import Scenario
from org_node.harness.verdict import finish

pytestmark = pytest.mark.e2e


def test_finding_7_three_orgs_at_60_ms_complete_every_round(tmp_path: Path) -> None:
    scenario = Scenario(orgs=3, rounds=2, delay_ms=60)
    out = tmp_path / "delay"
    finish(run_harness(scenario, out))
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert summary["membership_converged"] is True
    assert summary["ok"] is True, summary["reason"]
    assert summary["rounds_completed"] == 2
    assert summary["states"] == {"org1": "completed", "org2": "completed", "org3": "completed"}
    # no org was left out of a round for want of being seen alive
    assert summary["survivors"] == {"1": ["org1", "org2", "org3"], "2": ["org1", "org2", "org3"]}
    assert summary["scenario"]["delay_ms"] == 60
