"""The simulator: many in-process peers, faulty peers of every kind, partitions that heal."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest
from coordinator_free.rounds import RoundConfig
from coordinator_free.sim import (
    STAGES,
    Fault,
    FaultSpec,
    PartitionSpec,
    RoundOutcome,
    SimConfig,
    Simulation,
    main,
    random_faults,
    simulate,
)
from coordinator_free.wire import Envelope

QUICK = RoundConfig(
    ready_timeout=0.6, stage_timeout=4.0, step_timeout=2.0, send_timeout=4.0, ring_min_chunk=1
)


def run_rounds(
    config: SimConfig,
    faults: list[FaultSpec],
    rounds: int = 2,
    partition: PartitionSpec | None = None,
) -> list[RoundOutcome]:
    return asyncio.run(simulate(config, rounds, faults, partition=partition))


def after_the_ring(faults: list[FaultSpec]) -> set[str]:
    """The peers killed once their ring completed (their update is in the sum)."""
    return {
        f.org for f in faults if f.fault is Fault.KILL and f.stage in ("agree-reduce", "unmask")
    }


@pytest.mark.slow
def test_fifty_peers_with_random_faults() -> None:
    config = SimConfig(peers=50, length=16, seed=11)
    orgs = [f"org-{i:02d}" for i in range(50)]
    faults = random_faults(orgs, 4, seed=11)
    assert {f.fault for f in faults} >= {Fault.KILL}
    (out,) = run_rounds(config, faults, rounds=1)
    assert out.problems() == []
    res = next(iter(out.results.values()))
    assert len(out.results) >= res.threshold == 26
    # a peer killed before its ring completed is dropped; one killed after (here org-29,
    # at agree-reduce) has its update in the sum, its self mask rebuilt from shares
    assert out.killed - set(res.survivors) == out.killed - after_the_ring(faults)
    assert (res.sum == out.expected(res.survivors)).all()
    assert set(out.results) | set(out.failures) | out.killed == set(orgs)


# the owner path's stages after the agreement: a peer killed there is a survivor
AFTER_AGREEMENT = ("unmask", "gather", "reduce.gather.1", "reduce.gather.4")


# seeds 7, 14, 19 and 24 each kill a peer after the agreement (and others before it,
# or send garbage, replays, wrong rounds, delays); seed 3 kills none after it
@pytest.mark.parametrize("seed", [3, 7, 14, 19, 24])
def test_owner_unmasking_with_random_faults(seed: int) -> None:
    # 12 peers and a chunked ring: each unmasks only the chunks it holds
    config = SimConfig(peers=12, length=48, seed=seed, round_config=QUICK)
    orgs = [f"org-{i:02d}" for i in range(12)]
    faults = random_faults(orgs, 3, seed=seed, stages=(*STAGES, *AFTER_AGREEMENT))
    outcomes = run_rounds(config, faults, rounds=2)
    for out in outcomes:
        assert out.problems() == []
        assert set(out.results) | set(out.failures) | out.killed == set(orgs)
    first = outcomes[0]
    res = next(iter(first.results.values()))
    assert "gather" in res.stage_times  # the owner path ran
    assert (res.sum == first.expected(res.survivors)).all()
    survivors_killed = {
        f.org for f in faults if f.fault is Fault.KILL and f.stage in AFTER_AGREEMENT
    }
    assert first.killed - set(res.survivors) == first.killed - survivors_killed
    assert outcomes[1].results  # the next round works


def test_owner_unmasking_under_secagg_plus_keeps_a_peer_killed_after_the_agreement() -> None:
    # 40 peers: SecAgg+ (16 neighbours each) and owner unmasking together. One peer
    # dies in the reduce-scatter (the ring runs again without it), another as the
    # unmask begins (a survivor: its neighbours release its self-mask shares, its
    # chunk comes from its successor's copy)
    config = SimConfig(peers=40, length=80, seed=5, round_config=QUICK)
    faults = [
        FaultSpec("org-07", Fault.KILL, "reduce.scatter.1", round=1),
        FaultSpec("org-21", Fault.KILL, "unmask", round=1),
    ]
    (out,) = run_rounds(config, faults, rounds=1)
    assert out.problems() == []
    assert len(out.results) == 38
    for res in out.results.values():
        assert res.neighbours == 16 and "gather" in res.stage_times
        assert "org-07" not in res.survivors and "org-21" in res.survivors
        assert res.ring_attempts == 2
        assert (res.sum == out.expected(res.survivors)).all()


STAGE_OF = {
    Fault.KILL: "reduce.scatter.1",
    Fault.GARBAGE: "share",
    Fault.REPLAY: "agree-reduce",
    Fault.DELAY: "reduce",
    Fault.WRONG_ROUND: "unmask",
}


@pytest.mark.parametrize("fault", list(Fault), ids=[f.value for f in Fault])
def test_each_fault_kind_leaves_a_consistent_round_and_the_next_works(fault: Fault) -> None:
    config = SimConfig(peers=6, length=40, seed=3, round_config=QUICK)
    faulty = "org-2"
    first, second = run_rounds(config, [FaultSpec(faulty, fault, STAGE_OF[fault], round=1)])
    assert first.problems() == [] and second.problems() == []
    honest = {f"org-{i}" for i in range(6)} - {faulty}
    # every honest peer finishes the faulty round with the correct sum
    assert honest <= set(first.results)
    if fault is Fault.KILL:
        assert faulty not in first.results and faulty not in second.results
    elif fault is Fault.GARBAGE:
        # its garbage share came first: the others never held its keys
        assert faulty not in first.results["org-0"].survivors
    else:
        # refused replays, wrong-round messages and a short stall change nothing
        assert first.results["org-0"].survivors == tuple(
            o for o in first.results["org-0"].participants
        )
        assert len(first.results) == 6
    assert honest <= set(second.results)


def test_a_peer_slower_than_the_ready_deadline_is_left_out_then_rejoins() -> None:
    config = SimConfig(peers=5, length=40, seed=12, round_config=QUICK)
    slow = FaultSpec("org-4", Fault.DELAY, "ready", round=1, delay_s=1.5)
    first, second = run_rounds(config, [slow])
    assert first.problems() == [] and second.problems() == []
    assert set(first.results) == {"org-0", "org-1", "org-2", "org-3"}
    assert "org-4" in first.failures and "org-4" not in first.results["org-0"].participants
    assert len(second.results) == 5


def test_garbage_at_every_stage_is_refused_without_harm() -> None:
    config = SimConfig(peers=5, length=40, seed=4, round_config=QUICK)
    stages = ["ready", "agree-ready", "reduce.scatter.0", "reduce.gather.1", "unmask"]
    faults = [FaultSpec("org-1", Fault.GARBAGE, s, round=1) for s in stages]
    first, second = run_rounds(config, faults)
    assert first.problems() == [] and second.problems() == []
    assert {"org-0", "org-2", "org-3", "org-4"} <= set(first.results)
    assert len(second.results) == 5


def test_a_partition_that_heals_after_the_deadline() -> None:
    config = SimConfig(peers=6, length=40, seed=5, round_config=QUICK)
    majority = ("org-0", "org-1", "org-2", "org-3")
    minority = ("org-4", "org-5")
    partition = PartitionSpec(groups=(majority, minority), heal_after_s=2.0)
    first, second = run_rounds(config, [], partition=partition)
    assert first.problems() == [] and second.problems() == []
    # t = 4 of 6: the majority sums its own inputs, the minority fails and says why
    assert set(first.results) == set(majority)
    assert set(first.results["org-0"].survivors) == set(majority)
    assert set(first.failures) == set(minority)
    assert all("fewer than" in reason for reason in first.failures.values())
    # healed: everyone is back in the next round
    assert len(second.results) == 6


def test_a_partition_that_heals_before_the_deadline_costs_nothing() -> None:
    rc = RoundConfig(
        ready_timeout=2.0, stage_timeout=4.0, step_timeout=2.0, send_timeout=4.0, ring_min_chunk=1
    )
    config = SimConfig(peers=5, length=40, seed=6, round_config=rc)
    partition = PartitionSpec(
        groups=(("org-0", "org-1", "org-2"), ("org-3", "org-4")), heal_after_s=0.3
    )
    (out,) = run_rounds(config, [], rounds=1, partition=partition)
    assert out.problems() == []
    assert len(out.results) == 5
    assert len(out.results["org-0"].survivors) == 5


def test_chain_reduce_for_short_vectors_gives_the_same_sums() -> None:
    config = SimConfig(peers=8, length=16, seed=8)  # default config: the chain path
    faults = [FaultSpec("org-5", Fault.KILL, "reduce.gather.0", round=1)]
    first, second = run_rounds(config, faults)
    assert first.problems() == [] and second.problems() == []
    assert len(first.results) == 7 and len(second.results) == 7


def test_random_faults_are_seeded_and_on_distinct_orgs() -> None:
    orgs = [f"o{i}" for i in range(20)]
    a = random_faults(orgs, 6, rounds=(1, 2), seed=9)
    assert a == random_faults(orgs, 6, rounds=(1, 2), seed=9)
    assert a != random_faults(orgs, 6, rounds=(1, 2), seed=10)
    assert len({f.org for f in a}) == 6
    assert all(f.round in (1, 2) for f in a)
    with pytest.raises(ValueError, match="distinct"):
        random_faults(orgs, 21)


def test_configuration_is_validated() -> None:
    with pytest.raises(ValueError, match="peers"):
        SimConfig(peers=1)
    with pytest.raises(ValueError, match="bits"):
        SimConfig(bits=16)
    with pytest.raises(ValueError, match="not in the simulation"):
        Simulation(SimConfig(peers=2), [FaultSpec("nobody", Fault.KILL)])
    assert FaultSpec("o", "kill").fault is Fault.KILL  # type: ignore[arg-type]


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    code = main(
        [
            "--peers",
            "5",
            "--rounds",
            "2",
            "--faults",
            "1",
            "--kinds",
            "kill",
            "--length",
            "32",
            "--seed",
            "2",
            "--json",
            str(out),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "fault: " in text and "round 2:" in text
    rows = json.loads(out.read_text())
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["problems"] == [] for r in rows)


def _split_during_shares(
    config: SimConfig, halves: tuple[tuple[str, ...], tuple[str, ...]]
) -> tuple[RoundOutcome, RoundOutcome]:
    """Round 1 with the network split into ``halves`` as the key shares start, then a
    round 2 after it heals."""

    async def scenario() -> tuple[RoundOutcome, RoundOutcome]:
        async with Simulation(config) as sim:
            split = asyncio.Event()

            async def hook(org: str, run: str, round: int, stage: str) -> None:
                if round == 1 and stage == "share" and not split.is_set():
                    split.set()
                    sim.network.partition(*halves)

            for engine in sim.engines.values():
                engine.hook = hook
            first = await sim.round(1)
            sim.network.heal()
            return first, await sim.round(2)

    return asyncio.run(scenario())


def test_a_split_during_the_key_shares_is_detected_never_summed() -> None:
    config = SimConfig(peers=6, length=40, seed=13, round_config=QUICK)
    halves = (("org-0", "org-1", "org-2"), ("org-3", "org-4", "org-5"))

    first, second = _split_during_shares(config, halves)
    # each half saw the other ready but lost its shares: the halves' views differ, and
    # neither half alone reaches t = 4 of 6, so every node fails and says why; no node
    # sums over a view the others do not share
    assert first.problems() == []
    assert not first.results
    assert set(first.failures) == {f"org-{i}" for i in range(6)}
    assert all(
        "fewer than t=4" in reason or "leave this node out" in reason
        for reason in first.failures.values()
    )
    assert second.problems() == [] and len(second.results) == 6


def test_forty_peers_run_secagg_plus_and_sum_exactly_despite_a_kill() -> None:
    """Above ``secagg_plus_above`` members the engine runs SecAgg+ (Bell et al., CCS'20):
    k = 16 neighbours for 40 members; a member killed in the ring is unmasked from its
    neighbourhood's shares alone and the survivors' sum is still exact. (The ring
    waits for the token's decision on ``U1``, so the member dies a participant: with
    the ring first it may die before it proposes, and the decision then
    leaves it out with nothing to unmask; ``test_ring_first`` covers that.)"""
    base = SimConfig(peers=40, length=16, seed=5).engine_config()
    rc = RoundConfig(
        ready_timeout=base.ready_timeout,
        stage_timeout=base.stage_timeout,
        step_timeout=base.step_timeout,
        send_timeout=base.send_timeout,
        secagg_plus_above=16,
        ring_first=False,
    )
    config = SimConfig(peers=40, length=16, seed=5, round_config=rc)
    killed = "org-17"
    (out,) = run_rounds(config, [FaultSpec(killed, Fault.KILL, "reduce", round=1)], rounds=1)
    assert out.problems() == []
    res = out.results["org-00"]
    assert res.neighbours == 16
    assert killed in res.dropped and killed not in res.survivors
    assert len(res.survivors) == 39 and len(out.results) == 39
    assert (res.sum == out.expected(res.survivors)).all()
    # each node sent ShareKeys to its 16 neighbours only, not to all 39 others
    assert all(r.neighbours == 16 for r in out.results.values())


@pytest.mark.e2e
@pytest.mark.timeout(1200)
def test_two_hundred_peers_with_random_faults_sum_exactly() -> None:
    """200 in-process peers run SecAgg+ (k = 24) with a kill, a replay and two delays
    at random stages (``python -m coordinator_free.sim --peers 200 --faults 4 --seed 3``):
    the view agreements travel as one token each (``O(n)`` messages, not ``n^2``), and
    every finisher holds the exact sum of the same survivors."""
    n = 200
    config = SimConfig(peers=n, length=16, seed=3)
    orgs = [f"org-{i:03d}" for i in range(n)]
    faults = random_faults(orgs, 4, seed=3)
    assert Fault.KILL in {f.fault for f in faults}
    (out,) = run_rounds(config, faults, rounds=1)
    assert out.problems() == []
    res = out.results[min(out.results)]
    assert res.neighbours == 24
    assert out.killed and out.killed - set(res.survivors) == out.killed - after_the_ring(faults)
    assert set(out.results) | set(out.failures) | out.killed == set(orgs)
    assert len(out.results) >= n - len(faults) and not out.failures
    assert (res.sum == out.expected(res.survivors)).all()
    # readies relayed (2 ceil(log2 n)), releases to every other survivor, shares to
    # the k neighbours, the ring
    # and two tokens: a view agreement (n - 1 views per attempt, two attempts or more
    # after a kill) would add 2 n messages per node and more
    sent = sorted(r.messages_sent for r in out.results.values())
    assert sent[len(sent) // 2] < 2 * n + 4 * 24


@pytest.mark.parametrize("ring_first", [True, False], ids=["ring-first", "ring-waits"])
def test_a_fault_free_secagg_plus_round_settles_u1_by_the_ring_or_one_token_and_no_view(
    ring_first: bool,
) -> None:
    """Under SecAgg+ the participants are agreed by the token. With the ring first (the
    default) every proposal holds every member, each ring completes, and that settles
    them: no token at all. With the ring waiting, one token settles them: ``n`` hops to
    collect the proposals (the last one back to its starter), the starter's decision
    to the ``n - 1`` others, and at most one probe of the starter from each of them (it
    wakes a starter that runs its ring first). Either way no view is ever sent, and no
    member asks another for the masked sum."""
    n = 20
    rc = RoundConfig(
        ready_timeout=2.0,
        stage_timeout=30.0,
        step_timeout=5.0,
        send_timeout=5.0,
        secagg_plus_above=8,
        ring_first=ring_first,
    )
    kinds: Counter[str] = Counter()

    def count(env: Envelope, wire: bytes) -> None:
        kinds[env.kind] += 1

    async def scenario() -> RoundOutcome:
        async with Simulation(SimConfig(peers=n, length=16, seed=4, round_config=rc)) as sim:
            for endpoint in sim.endpoints.values():
                endpoint.on_egress = count
            return await sim.round(1)

    out = asyncio.run(scenario())
    assert out.problems() == [] and len(out.results) == n
    assert all(r.neighbours is not None for r in out.results.values())
    assert kinds["round.view"] == 0 and kinds["round.total"] == 0
    if ring_first:
        assert kinds["round.token"] == 0
    else:
        assert n <= kinds["round.token"] <= 3 * n - 2


def test_a_split_under_secagg_plus_is_detected_by_the_token_never_summed() -> None:
    """With SecAgg+ the participants are always settled by the agreement token; a
    partition into halves during the key shares leaves each half a token of its own
    (its first member takes over from the unreachable ones), neither reaches t, and
    every node fails with its reason: no node sums over a view the others lack."""
    n = 20
    rc = RoundConfig(
        ready_timeout=2.0,
        stage_timeout=8.0,
        step_timeout=1.0,
        send_timeout=4.0,
        secagg_plus_above=8,
    )
    config = SimConfig(peers=n, length=16, seed=21, round_config=rc)
    orgs = [f"org-{i:02d}" for i in range(n)]
    halves = (tuple(orgs[::2]), tuple(orgs[1::2]))

    first, second = _split_during_shares(config, halves)
    assert first.problems() == []
    assert not first.results
    assert set(first.failures) == set(orgs)
    assert all(
        "fewer than t=11" in reason or "leave this node out" in reason
        for reason in first.failures.values()
    )
    assert second.problems() == [] and len(second.results) == n
    assert all(r.neighbours is not None for r in second.results.values())


def test_only_an_org_that_replays_keeps_the_requests_it_sent() -> None:
    # the simulated peers of a large federation would otherwise each hold their last
    # 256 requests (ring chunks included) across rounds: hundreds of MB that no real
    # node holds, in the heap the benchmark's plain rings and secure rounds share
    faults = [FaultSpec("org-1", Fault.REPLAY, "agree-reduce", round=2)]

    async def scenario() -> dict[str, int]:
        config = SimConfig(peers=4, length=64, seed=3, round_config=QUICK)
        async with Simulation(config, faults) as sim:
            outcome = await sim.round(1)
            assert not outcome.problems(), outcome.summary()
            return {o: len(t.sent) for o, t in sim.transports.items()}

    kept = asyncio.run(scenario())
    assert kept.pop("org-1") > 0
    assert set(kept.values()) == {0}
