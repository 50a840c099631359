"""The harness starts a run only once every node sees every other one alive, and says so
when they never do (finding 7): the wait, its failure reason and the verdict built from
it. The nodes' views are given by a stand-in for their ``GET /v1/peers`` answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from org_node.harness import runner
from org_node.harness.nodes import NodeProcess, Observation
from org_node.harness.scenario import Scenario
from org_node.harness.verdict import build_summary


def _observation(tmp_path: Path) -> Observation:
    obs = Observation(Scenario(orgs=3, rounds=2, delay_ms=60), tmp_path)
    for i, org in enumerate(obs.scenario.names):
        obs.nodes[org] = NodeProcess(org, i, tmp_path / "nodes" / org, 1000 + i, 2000 + i, 1000 + i)
    return obs


def test_finding_7_the_harness_does_not_start_a_run_before_the_nodes_see_each_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """org3 never sees org1 alive: no run is proposed, and the verdict's one reason is
    the membership that never converged (not rounds that failed)."""
    views = {"org1": {"org2", "org3"}, "org2": {"org1", "org3"}, "org3": {"org2"}}
    monkeypatch.setattr(runner, "_alive_seen", lambda node: views[node.org])
    monkeypatch.setattr(runner, "CONVERGE_TIMEOUT_S", 0.3)
    proposed: list[Observation] = []
    monkeypatch.setattr(runner, "propose_and_accept", proposed.append)
    obs = _observation(tmp_path)
    assert runner._converge_or_explain(obs) is False
    assert obs.membership_converged is False
    assert obs.errors == [
        "the nodes never all saw each other alive within 0.3 s, so no run was started "
        "(membership): org3 does not see org1 alive"
    ]
    summary = build_summary(obs)
    assert summary["ok"] is False
    assert summary["membership_converged"] is False
    assert summary["reason"] == obs.errors[0]
    assert not proposed


def test_the_wait_ends_as_soon_as_every_view_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}

    def seen(node: NodeProcess) -> set[str]:
        calls["n"] += 1
        others = {"org1", "org2", "org3"} - {node.org}
        return others if calls["n"] > 3 else set()  # the first pass lags

    monkeypatch.setattr(runner, "_alive_seen", seen)
    obs = _observation(tmp_path)
    assert runner._converge_or_explain(obs) is True
    assert obs.membership_converged is True and not obs.errors
    assert runner._not_seen(list(obs.nodes.values())) == []
