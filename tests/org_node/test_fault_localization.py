"""Fault localization: the pure peer scorer on hand-made observations, and every
node's scorer in the in-memory simulator naming a delayed and a killed peer."""

from __future__ import annotations

import asyncio

import pytest
from coordinator_free.rounds import RoundObservation
from coordinator_free.sim import Fault, FaultSpec, SimConfig, Simulation

from org_node.observability import FaultConfig, Observability, PeerScorer, Suspect


def obs(kind: str, peer: str = "", stage: str = "share", **kw: object) -> RoundObservation:
    return RoundObservation(kind, "run-1", 3, stage, peer, **kw)  # type: ignore[arg-type]


def test_a_peer_that_never_sent_is_the_culprit_with_its_evidence() -> None:
    scorer = PeerScorer("a")
    scorer.observe(obs("round", stage="ready"))
    scorer.observe(obs("missing", "c", detail="no share by the deadline"))
    scorer.observe(obs("unreachable", "c", stage="unmask", detail="RequestTimeout: 5s"))
    scorer.observe(obs("dropped", "c", stage="unmask"))
    scorer.observe(obs("left", "b", stage="leave"))
    found = scorer.culprit(3)
    assert isinstance(found, Suspect)
    assert found.org == "c" and found.round == 3 and found.run == "run-1"
    assert found.score == pytest.approx(3.0 + 2.0 + 2.0)
    assert "no share message from c in time (no share by the deadline)" in found.evidence
    assert any("unmask send to c failed" in e for e in found.evidence)
    assert scorer.scores("run-1", 3) == {"c": 7.0, "b": 0.5}


def test_late_arrivals_are_judged_against_the_stage_median() -> None:
    scorer = PeerScorer("a", FaultConfig(late_s=0.2))
    for peer, at in (("b", 0.01), ("c", 0.02), ("d", 0.9), ("e", 0.03)):
        scorer.observe(obs("arrival", peer, seconds=at))
    found = scorer.culprit(3)
    assert found is not None and found.org == "d"
    assert found.evidence[0].startswith("its share arrived 0.8")
    # everyone equally slow: nobody is late
    even = PeerScorer("a", FaultConfig(late_s=0.2))
    for peer in "bcde":
        even.observe(obs("arrival", peer, seconds=2.0))
    assert even.culprit(3) is None


def test_this_nodes_own_sending_time_is_a_sample_and_ring_order_stages_are_not_judged() -> None:
    scorer = PeerScorer("a", FaultConfig(late_s=0.5))
    # two peers only: this node began its share stage at 0.3 s (after 0.3 s of ready)
    scorer.observe(obs("stage", stage="ready", seconds=0.3))
    scorer.observe(obs("stage", stage="share", seconds=2.0))
    scorer.observe(obs("arrival", "b", seconds=0.35))
    scorer.observe(obs("arrival", "c", seconds=1.6))
    # model hashes and commit tokens arrive in ring order or after local work
    scorer.observe(obs("arrival", "b", stage="model", seconds=0.0))
    scorer.observe(obs("arrival", "c", stage="model", seconds=0.1))
    scorer.observe(obs("arrival", "d", stage="model", seconds=9.0))
    found = scorer.culprit(3)
    assert found is not None and found.org == "c"
    assert found.evidence == ["its share arrived 1.25s after the others' (median)"]
    assert "d" not in scorer.scores("run-1", 3)


def test_no_culprit_without_enough_or_without_leading_evidence() -> None:
    scorer = PeerScorer("a")
    scorer.observe(obs("left", "b"))
    assert scorer.culprit(3) is None  # 0.5 < min_score
    tie = PeerScorer("a")
    tie.observe(obs("missing", "b"))
    tie.observe(obs("missing", "c"))
    assert tie.culprit(3) is None  # two peers equally to blame: not singled out
    assert tie.culprit(4) is None  # a round never observed
    mine = PeerScorer("a")
    mine.observe(obs("missing", "a"))
    assert mine.culprit(3) is None  # a node never blames itself


def test_hash_disagreement_and_refusals_outweigh_a_late_arrival() -> None:
    scorer = PeerScorer("a", FaultConfig(late_s=0.5))
    scorer.observe(obs("arrival", "b", seconds=0.0))
    scorer.observe(obs("arrival", "c", seconds=0.0))
    scorer.observe(obs("arrival", "d", seconds=0.8))
    scorer.observe(obs("mismatch", "c", stage="model", detail="model hash"))
    scorer.observe(obs("refused", "c", stage="release", detail="bad share"))
    scorer.observe(obs("failed", stage="unmask", detail="2 orgs released shares"))
    found = scorer.culprit(3)
    assert found is not None and found.org == "c"
    assert found.evidence[0] == "it disagreed on the model hash (model hash)"
    assert found.evidence[-1] == "the round failed here at unmask: 2 orgs released shares"
    assert scorer.failure("run-1", 3) == "unmask: 2 orgs released shares"


def test_throughput_drift_is_measured_against_the_links_own_history() -> None:
    scorer = PeerScorer("a", FaultConfig(min_score=1.0, lead=0.5))
    for rnd in range(4):
        scorer.observe(
            RoundObservation("link", "r", rnd, "reduce", "b", seconds=1.0, bytes=1_000_000)
        )
        assert scorer.culprit(rnd, "r") is None
    scorer.observe(RoundObservation("link", "r", 4, "reduce", "b", seconds=10.0, bytes=1_000_000))
    found = scorer.culprit(4, "r")
    assert found is not None and found.org == "b"
    assert found.evidence == ["ring link from b ran at 0.10 MB/s, its usual 1.00 MB/s"]


def test_latest_and_round_retention() -> None:
    scorer = PeerScorer("a", FaultConfig(rounds=2))
    for rnd, peer in ((1, "b"), (2, "c"), (3, "d")):
        scorer.observe(RoundObservation("missing", "r", rnd, "ready", peer))
    assert scorer.rounds() == [("r", 2), ("r", 3)]
    assert scorer.culprit(1) is None  # forgotten
    latest = scorer.latest()
    assert latest is not None and (latest.org, latest.round) == ("d", 3)


@pytest.mark.parametrize(
    "bad",
    [
        {"min_score": 0},
        {"late_s": -1},
        {"drift_factor": 1.0},
        {"history": 1},
        {"lead": -0.1},
        {"rounds": 2.5},
    ],
)
def test_fault_config_rejects_invalid_values(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="FaultConfig"):
        FaultConfig(**bad)  # type: ignore[arg-type]


# -- the simulator -----------------------------------------------------------------------


def simulate(
    faults: list[FaultSpec], peers: int = 5
) -> tuple[dict[str, Observability], set[str], set[str]]:
    """One simulated round with every node observed; (observers, finished, failed)."""

    async def go() -> tuple[dict[str, Observability], set[str], set[str]]:
        config = SimConfig(peers=peers, length=64, seed=7)
        async with Simulation(config, faults) as sim:
            hubs = {}
            for org, engine in sim.engines.items():
                hubs[org] = Observability(org, faults=FaultConfig(late_s=0.5))
                hubs[org].attach(engine)
            outcome = await sim.round(1)
            assert outcome.problems() == []
            return hubs, set(outcome.results), set(outcome.failures)

    return asyncio.run(go())


def test_simulator_every_node_names_the_delayed_peer() -> None:
    slow = "org-3"
    hubs, finished, _ = simulate([FaultSpec(slow, Fault.DELAY, "share", round=1, delay_s=2.0)])
    assert slow in finished  # slow, not dead: the round still includes it
    for org, hub in hubs.items():
        if org == slow:
            continue
        found = hub.scorer.culprit(1)
        assert found is not None, org
        assert found.org == slow, (org, found)
        assert any("share arrived" in e for e in found.evidence), found.evidence
        line = hub.timeline()[-1]
        assert line["culprit"]["org"] == slow
        assert line["peers"][slow]["share"]["at"] > 1.0


def test_simulator_every_surviving_node_names_the_killed_peer() -> None:
    dead = "org-2"
    # killed before it passed the reduction on: no member's ring completes, so the
    # ring runs again without it (a kill after some ring completed keeps it in the sum)
    hubs, finished, failed = simulate([FaultSpec(dead, Fault.KILL, "reduce.scatter.0", round=1)])
    assert dead not in finished
    assert finished, failed
    for org in finished:
        found = hubs[org].culprit()
        assert found is not None and found.org == dead, (org, found)
        assert "it was dropped from the round's survivors" in found.evidence
        assert hubs[org].timeline()[-1]["dropped"] == [dead]
        text = hubs[org].render_metrics()
        assert f'fedweave_dropouts_total{{peer="{dead}"}} 1' in text


def test_simulator_fault_free_round_names_nobody() -> None:
    hubs, finished, failed = simulate([], peers=4)
    assert not failed and len(finished) == 4
    for hub in hubs.values():
        assert hub.culprit() is None
        line = hub.timeline()[-1]
        assert line["state"] == "completed" and line["culprit"] is None
        assert [s["stage"] for s in line["stages"]][:3] == ["ready", "share", "agree-ready"]


def test_a_failing_observer_never_affects_the_round() -> None:
    async def go() -> tuple[set[str], list[str]]:
        async with Simulation(SimConfig(peers=3, length=16, seed=3)) as sim:
            seen: list[str] = []

            def broken(o: RoundObservation) -> None:
                seen.append(o.kind)
                raise RuntimeError("observer bug")

            sim.engines["org-0"].add_observer(broken)
            outcome = await sim.round(1)
            assert outcome.problems() == []
            return set(outcome.results), seen

    finished, seen = asyncio.run(go())
    assert finished == {"org-0", "org-1", "org-2"}
    assert seen[0] == "round" and "completed" in seen
