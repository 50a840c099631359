"""End to end, five orgs with two faults in one round (issue 20, finding 1): org2 is
killed in round 2 and org3 is wiped after it; with t = 3 the three others and the
recovered org3 still make a quorum, so the run must not fail.

Real ``fedweave run`` processes on 127.0.0.1 driven by the harness (``--orgs 5
--rounds 4 --seed 11 --kill org2@2 --wipe org3@2``); assertions on ``summary.json``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from org_node.harness.scenario import Kill, Scenario, Wipe
from tests.e2e.test_harness import _common
from tests.e2e.test_harness_wipe_five import _run

pytestmark = pytest.mark.e2e

SURVIVING = ["org1", "org3", "org4", "org5"]


@pytest.mark.timeout(900)
def test_finding_1_two_faults_in_one_round_with_a_quorum_left_complete_every_round(
    tmp_path: Path,
) -> None:
    scenario = Scenario(
        orgs=5, rounds=4, seed=11, kills=(Kill("org2", 2),), wipes=(Wipe("org3", 2),)
    )
    summary = _run(scenario, tmp_path / "two-faults", timeout=600)
    # every surviving org finished all four rounds with the same model, the model equals
    # plaintext FedAvg over each round's survivors, and every audit log verifies
    _common(summary, scenario, SURVIVING, rejoined=frozenset({"org3"}))
    assert summary["states"]["org2"] == "killed"
    for org in ("org1", "org4", "org5", "org3"):
        assert summary["states"][org] == "completed", summary["states"]
        assert summary["rounds_completed_per_org"][org] == 4
    assert all(len(summary["survivors"][str(r)]) >= 3 for r in (1, 2, 3, 4))
