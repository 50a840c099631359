"""End-to-end runs of the harness: real ``fedweave run`` processes on 127.0.0.1, faults
injected, and assertions on ``summary.json`` only (never on logs).

Each scenario is kept tiny (the breast-cancer MLP, 3 local steps, 2-3 rounds) so that it
ends in about a minute on two cores. The last test interrupts a harness with SIGINT
once its nodes are up and checks that no process it started is left and no port bound.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from org_node.config import NodeConfig
from org_node.harness.nodes import port_is_free
from org_node.harness.runner import run_harness
from org_node.harness.scenario import Kill, Scenario, Wipe
from org_node.harness.verdict import finish

pytestmark = pytest.mark.e2e


def _run(scenario: Scenario, out: Path) -> dict[str, Any]:
    ports: list[int] = []

    def started(obs: Any, pids: list[int]) -> None:
        for node in obs.nodes.values():
            ports.extend([node.peer_port, node.admin_port, node.public_peer_port])

    obs = run_harness(scenario, out, on_started=started)
    finish(obs)
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    # every process the harness started is gone, every port it used is free again
    assert all(n.proc is not None and n.proc.poll() is not None for n in obs.nodes.values())
    assert ports and all(port_is_free(p) for p in ports)
    return summary


def _common(
    summary: dict[str, Any],
    scenario: Scenario,
    surviving: list[str],
    rejoined: frozenset[str] = frozenset(),
) -> None:
    """``rejoined``: orgs wiped and rebuilt, whose new audit log may hold no egress of the
    run (an un-held wipe lets the others go on; the rebuilt org may then adopt the final
    model without sending anything): then its report says so, and it was among no
    round's survivors after its recovery. One that tried a round and was left out (its
    ready came late) has egress, and a report, all the same."""
    assert summary["ok"] is True, summary["reason"]
    assert summary["reason"] == ""
    assert summary["orgs"] == list(scenario.names)
    assert summary["backend"] == scenario.backend
    assert summary["rounds_completed"] == scenario.rounds
    assert summary["surviving"] == surviving
    shas = {summary["final_model_sha256"][o] for o in surviving}
    assert len(shas) == 1 and None not in shas
    for org in surviving:
        assert summary["audit_verified"][org]["ok"] is True
        assert summary["bytes_sent"][org] > 0
        m = summary["metrics"][org]
        assert m["loss"] is not None and m["loss"] > 0
        assert m["accuracy"] is not None and 0.0 <= m["accuracy"] <= 1.0
        assert 0.0 <= m["final_model_accuracy"] <= 1.0 and m["final_model_loss"] > 0
        report = summary["audit_reports"][org]
        if org in rejoined and not Path(report).is_file():
            # its new log holds no egress of the run: it took part in no round since
            assert report.startswith("not written: no egress of run"), report
            assert not _sent_after_recovery(summary, org)
        else:
            assert Path(report).is_file(), report
    check = summary["harness_check"]
    assert check["ok"] is True
    assert check["max_abs_diff"] is not None and check["max_abs_diff"] <= check["tolerance"]
    assert check["rounds"] == scenario.rounds


def _sent_after_recovery(summary: dict[str, Any], org: str) -> bool:
    """Whether ``org`` was among the survivors of a round that started after its wipe.
    The round in flight when it was killed (the one after ``rounds_done_at_wipe``) may
    hold what the node sent before the wipe, in the log the wipe destroyed."""
    (rec,) = [r for r in summary["recoveries"] if r["org"] == org]
    (wipe,) = [f for f in summary["faults"] if f["org"] == org and f["kind"] == "wipe"]
    first = max(int(rec["recovered_round"]), int(wipe["rounds_done_at_wipe"]) + 1) + 1
    later = range(first, summary["rounds_completed"] + 1)
    return any(org in summary["survivors"].get(str(r), []) for r in later)


def test_three_orgs_three_rounds_masked(tmp_path: Path) -> None:
    scenario = Scenario(orgs=3, rounds=3, seed=1)
    out = tmp_path / "demo"
    summary = _run(scenario, out)
    _common(summary, scenario, ["org1", "org2", "org3"])
    assert summary["faults"] == [] and summary["recoveries"] == []
    assert summary["survivors"] == {str(r): ["org1", "org2", "org3"] for r in (1, 2, 3)}
    assert set(summary["states"].values()) == {"completed"}
    assert summary["plot"] == str(out / "progress.png")
    assert (out / "progress.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_four_orgs_one_killed_mid_reduce(tmp_path: Path) -> None:
    scenario = Scenario(orgs=4, rounds=2, kills=(Kill("org2", 2, "reduce"),))
    summary = _run(scenario, tmp_path / "kill")
    _common(summary, scenario, ["org1", "org3", "org4"])
    (fault,) = summary["faults"]
    assert fault["kind"] == "kill" and fault["org"] == "org2" and fault["stage"] == "reduce"
    assert fault["signal"] == "SIGKILL" and fault["update_exported"] is True
    assert summary["states"]["org2"] == "killed"
    assert "org2" in summary["survivors"]["1"]
    assert "org2" not in summary["survivors"]["2"]


def test_a_wiped_org_recovers_and_finishes_the_run(tmp_path: Path) -> None:
    scenario = Scenario(orgs=3, rounds=2, wipes=(Wipe("org3", 1),))
    summary = _run(scenario, tmp_path / "wipe")
    _common(summary, scenario, ["org1", "org2", "org3"], rejoined=frozenset({"org3"}))
    (fault,) = summary["faults"]
    assert fault["kind"] == "wipe" and fault["org"] == "org3"
    (rec,) = summary["recoveries"]
    assert rec["org"] == "org3" and rec["recover_exit"] == 0
    assert rec["recovered_round"] >= 1 and rec["outcome"] == "restarted"
    assert rec["finished"] is True and rec["final_round"] == 2
    assert summary["states"]["org3"] == "completed"
    assert summary["rounds_completed_per_org"]["org3"] == 2


def test_ckks_run_with_delay(tmp_path: Path) -> None:
    scenario = Scenario(orgs=3, rounds=2, backend="ckks", delay_ms=5)
    summary = _run(scenario, tmp_path / "ckks")
    _common(summary, scenario, ["org1", "org2", "org3"])
    assert summary["backend"] == "ckks"
    assert summary["scenario"]["delay_ms"] == 5
    assert summary["harness_check"]["tolerance"] > 0


def _pids_under(out: Path) -> list[int]:
    """Live processes whose command line names ``out`` (the nodes the harness started)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            status = (proc / "status").read_text()
        except OSError:
            continue
        if str(out) in cmd and "State:\tZ" not in status:
            found.append(int(proc.name))
    return found


def _answers(data_dir: Path) -> bool:
    """Whether the node of ``data_dir`` (federation installed) answers on its admin port."""
    try:
        if not (data_dir / "federation" / "chain.json").exists():
            return False
        net = NodeConfig.load(data_dir / "fedweave.toml").network
        return httpx.get(f"http://127.0.0.1:{net.admin_port}/healthz", timeout=1).is_success
    except (OSError, ValueError, httpx.HTTPError):
        return False


def test_ctrl_c_leaves_no_process_and_no_port(tmp_path: Path) -> None:
    out = tmp_path / "interrupted"
    code = (
        "import typer\n"
        "from org_node.harness.cli import harness\n"
        "app = typer.Typer()\n"
        "app.command()(harness)\n"
        "app()\n"
    )
    harness = subprocess.Popen(
        [sys.executable, "-c", code, "--orgs", "3", "--rounds", "50", "--out", str(out), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            if all(_answers(out / "nodes" / f"org{i}") for i in (1, 2, 3)):
                break
            assert harness.poll() is None, harness.communicate()
            time.sleep(0.2)
        else:
            pytest.fail("the nodes did not come up")
        children = _pids_under(out)
        assert len(children) >= 3
        ports = []
        for i in (1, 2, 3):
            net = NodeConfig.load(out / "nodes" / f"org{i}" / "fedweave.toml").network
            ports += [net.peer_port, net.admin_port]
        harness.send_signal(signal.SIGINT)
        _, err = harness.communicate(timeout=60)
        assert harness.returncode == 130, err
        assert "every node the harness started is stopped" in err.strip().splitlines()[-1]
        assert not [p for p in children if Path(f"/proc/{p}").exists() and p in _pids_under(out)]
        assert all(port_is_free(p) for p in ports)
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait(10)
        for pid in _pids_under(out):
            os.killpg(pid, signal.SIGKILL)
