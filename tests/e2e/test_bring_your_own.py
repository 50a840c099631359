"""End to end, an org brings its own trainer and data: real ``fedweave run`` processes
over mutual TLS on 127.0.0.1, driven through each org's admin API by the harness.

* a Flower App directory (Message API ``ClientApp`` with ``@app.train()`` /
  ``@app.evaluate()``, its ServerApp giving the initial model and ``lr``), unchanged;
* a legacy ``NumPyClient`` behind ``ClientApp(client_fn=...)`` in one ``.py`` file;
* each org's own CSV file, registered through its API, bound at consent, trained by the
  bundled ``tabular`` trainer with features standardised by the secure sum; and the
  same after an org is wiped and rebuilt from its peers' shards: its admin registers the
  dataset again and the run resumes with it.

Assertions are on ``summary.json`` and the signed audit reports only.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from org_node.harness.runner import run_harness
from org_node.harness.scenario import Scenario, Wipe
from org_node.harness.verdict import finish
from org_node.trainers.code import code_hash

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _summary(scenario: Scenario, out: Path) -> dict[str, Any]:
    finish(run_harness(scenario, out))
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is True, summary["reason"]
    assert summary["harness_check"]["ok"] is True
    assert summary["rounds_completed"] == scenario.rounds
    assert len({summary["final_model_sha256"][o] for o in summary["surviving"]}) == 1
    return summary


def _binding(summary: dict[str, Any], org: str) -> dict[str, Any]:
    report = json.loads(Path(summary["audit_reports"][org]).read_text())
    binding: dict[str, Any] = report["run"]["binding"]
    return binding


def test_a_flower_app_directory_runs_unchanged(tmp_path: Path) -> None:
    app = EXAMPLES / "flower-quickstart"
    scenario = Scenario(orgs=3, rounds=2, flower_app=str(app))
    summary = _summary(scenario, tmp_path / "out")
    for org in scenario.names:
        history = summary["history"][org]
        assert set(history) == {"1", "2"}
        # the client's own metrics (train_loss, and eval_acc from @app.evaluate())
        assert 0.0 <= history["2"]["eval_acc"] <= 1.0 and history["2"]["train_loss"] > 0
        # each org trained on its own partition (partition-id in its node_config)
        assert history["1"]["examples"] > 0
        binding = _binding(summary, org)
        assert binding["trainer"] == {
            "name": "flower-app",
            "sha256": code_hash("flower-app", str(app)),
        }
        assert binding["dataset"] is None
    # the training split's 1437 digits, cut into one partition per org
    assert sum(summary["history"][o]["1"]["examples"] for o in scenario.names) == 1437


def test_a_legacy_numpy_client_runs_unchanged(tmp_path: Path) -> None:
    client = EXAMPLES / "flower-legacy" / "client.py"
    scenario = Scenario(orgs=3, rounds=2, flower_app=str(client))
    summary = _summary(scenario, tmp_path / "out")
    for org in scenario.names:
        m = summary["metrics"][org]
        assert m["accuracy"] is not None and m["accuracy"] > 0.8
        assert _binding(summary, org)["trainer"]["name"] == "flower-app"


def _hospitals(tmp_path: Path) -> Path:
    data = tmp_path / "hospitals"
    subprocess.run(
        [sys.executable, str(EXAMPLES / "hospitals" / "make_data.py"), str(data)], check=True
    )
    return data


def test_each_org_trains_on_its_own_csv(tmp_path: Path) -> None:
    data = _hospitals(tmp_path)
    scenario = Scenario(orgs=3, rounds=3, data=str(data), target="diagnosis", local_steps=5)
    summary = _summary(scenario, tmp_path / "out")
    for org in scenario.names:
        binding = _binding(summary, org)
        rows = len((data / f"{org}.csv").read_text().strip().splitlines()) - 1
        assert binding["trainer"]["name"] == "tabular"
        assert binding["dataset"]["name"] == f"{org}-data" and binding["dataset"]["rows"] == rows
        assert summary["metrics"][org]["accuracy"] > 0.8
        # the report names the dataset by id and hash, never by where it lives
        report = Path(summary["audit_reports"][org]).read_text()
        assert str(data) not in report and f"{org}.csv" not in report


def test_a_wiped_org_registers_its_data_again_and_rejoins(tmp_path: Path) -> None:
    data = _hospitals(tmp_path)
    scenario = Scenario(
        orgs=3,
        rounds=3,
        data=str(data),
        target="diagnosis",
        wipes=(Wipe("org3", 1, hold=True),),
    )
    summary = _summary(scenario, tmp_path / "out")
    (recovery,) = summary["recoveries"]
    assert recovery["outcome"] == "restarted" and recovery["finished"] is True
    assert summary["survivors"]["3"] == ["org1", "org2", "org3"]
    assert _binding(summary, "org3")["dataset"]["name"] == "org3-data"
