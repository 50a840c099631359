"""The ring first: started before ``U1`` is settled (``RoundConfig.ring_first``).

A node whose proposal holds every member masks with them and starts its ring at once,
``U1`` pending: the ring's completion settles ``U1``, and the node joins the token only
when another member runs it or its ring breaks. A smaller decision drops that ring
(even a completed one), narrows the session and runs the ring again over the decided
set. Every round here is checked against the plaintext sum of its survivors, on every
node.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest
from coordinator_free.rounds import RoundConfig, RoundObservation
from coordinator_free.rounds.context import StageContext
from coordinator_free.rounds.early import PendingU1
from coordinator_free.rounds.session import SecAggSession
from coordinator_free.rounds.share import ShareStage
from coordinator_free.sim import Fault, FaultSpec, RoundOutcome, SimConfig, Simulation

# the shares sealed ahead from three members (the default), so U1 goes by the token,
# or by the ring first
RING_FIRST = RoundConfig(
    ready_timeout=3.0,  # a late ready would make a proposal smaller: none here
    stage_timeout=4.0,
    step_timeout=2.0,
    send_timeout=4.0,
    ring_min_chunk=1,
    shares_ahead_from=3,
)
DROPPED = "the ring runs again"


def _check(out: RoundOutcome) -> None:
    assert out.problems() == []
    assert out.completed
    for res in out.results.values():
        assert np.array_equal(res.sum, out.expected(res.survivors))


def _watch(sim: Simulation) -> dict[str, list[RoundObservation]]:
    """Each engine's observations, as they come."""
    seen: dict[str, list[RoundObservation]] = {org: [] for org in sim.engines}
    for org, engine in sim.engines.items():
        engine._net.observers.append(seen[org].append)
    return seen


def _dropped(seen: dict[str, list[RoundObservation]], round: int) -> set[str]:
    """The orgs that dropped a ring started with U1 pending in ``round``."""
    return {
        org
        for org, obs in seen.items()
        if any(o.round == round and o.kind == "retry" and DROPPED in o.detail for o in obs)
    }


def _chunks(out: RoundOutcome) -> int:
    return sum(c["agg.chunk"] for c in out.signed.values())


def _tokens(out: RoundOutcome) -> int:
    return sum(c["round.token"] for c in out.signed.values())


def test_steady_rounds_settle_u1_by_the_ring_with_no_message() -> None:
    """From round 2 every proposal holds every member: each node starts its ring at once
    and its completion settles U1, so no token runs at all (the ring waiting for the
    token sends one each round), no ring is dropped, and the sums are the same."""
    n = 5

    async def scenario(config: RoundConfig) -> tuple[list[RoundOutcome], set[str]]:
        async with Simulation(SimConfig(peers=n, length=64, seed=3, round_config=config)) as sim:
            seen = _watch(sim)
            outs = [await sim.round(r) for r in (1, 2, 3)]
            return outs, _dropped(seen, 2) | _dropped(seen, 3)

    first, dropped = asyncio.run(scenario(RING_FIRST))
    waiting, _ = asyncio.run(scenario(dataclasses.replace(RING_FIRST, ring_first=False)))
    assert dropped == set()
    for r, (a, b) in enumerate(zip(first, waiting, strict=True), start=1):
        _check(a)
        _check(b)
        assert len(a.results) == n
        assert _chunks(a) == _chunks(b)
        for org in a.results:
            assert np.array_equal(a.results[org].sum, b.results[org].sum)
            assert a.results[org].ring_attempts == 1
        if r > 1:  # shares rode with the readies: U1 by the token, or by the ring
            assert _tokens(a) == 0
            assert _tokens(b) > 0


def test_a_member_one_peer_left_out_is_decided_out_and_the_others_ring_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In round 2 org-3 holds two different shares from org-1 (an equivocation) and
    proposes no org-1, so it waits for the token; the others hold every share and
    start their ring over all five beside it. The decision leaves org-1 out: the
    others drop the ring (org-3 never joined it), mask again with the four and sum
    exactly them; org-1, left out, fails its round."""
    n = 5
    run = ShareStage.run

    async def equivocated(self: ShareStage, ctx: StageContext) -> None:
        await run(self, ctx)
        if ctx.me == "org-3" and ctx.round == 2:
            ctx.state.equivocal.add("org-1")

    monkeypatch.setattr(ShareStage, "run", equivocated)

    seen: dict[str, list[RoundObservation]] = {}

    async def scenario() -> tuple[RoundOutcome, set[str]]:
        config = SimConfig(peers=n, length=64, seed=8, round_config=RING_FIRST)
        async with Simulation(config) as sim:
            seen.update(_watch(sim))
            _check(await sim.round(1))
            return await sim.round(2), _dropped(seen, 2)

    out, dropped = asyncio.run(scenario())
    _check(out)
    four = {"org-0", "org-2", "org-3", "org-4"}
    assert set(out.results) == four
    for res in out.results.values():
        assert set(res.participants) == set(res.survivors) == four
    assert "leave this node out" in out.failures["org-1"]
    # the nodes that held every share started the ring first and dropped it
    # (counted as a ring run); org-3 waited for the decision and ran one
    assert dropped == {"org-0", "org-2", "org-4"}
    attempts = {org: res.ring_attempts for org, res in out.results.items()}
    assert attempts == {"org-0": 2, "org-2": 2, "org-3": 1, "org-4": 2}
    # left out after the rings started: no participant (no key of it rebuilt), but
    # observed as dropped by those that ran a ring with it
    assert out.results["org-0"].dropped == ()
    assert any(o.kind == "dropped" and o.peer == "org-1" for o in seen["org-0"])


@pytest.mark.parametrize("sealed_ahead", [True, False], ids=["sealed-ahead", "exchanged"])
def test_a_share_that_does_not_open_makes_its_receiver_run_the_token_without_its_sender(
    monkeypatch: pytest.MonkeyPatch, sealed_ahead: bool
) -> None:
    """org-1 cannot take org-3's shares: sealed ahead in round 2 (it asks by the exchange,
    and org-3, believing the pair done, sends nothing), or exchanged in round 1 (they
    came, but do not open). org-1 proposes every member but org-3 and runs the token at
    once, where the others, whose rings over all six never complete without org-1, join
    it. The decision leaves out one of the two in conflict (the tie goes by id: org-3);
    the others drop their rings, narrow and sum exactly."""
    n = 6
    victim_round = 2 if sealed_ahead else 1
    name = "open_ahead" if sealed_ahead else "receive_share"
    taken = getattr(SecAggSession, name)

    def refuse(self: SecAggSession, sender: str, *args: Any, **kwargs: Any) -> None:
        mine = self.peer.me == "org-1" and self.peer.config.ctx.round == victim_round
        if mine and sender == "org-3":
            raise ValueError("refused for the test")
        taken(self, sender, *args, **kwargs)

    monkeypatch.setattr(SecAggSession, name, refuse)

    async def scenario() -> tuple[RoundOutcome, set[str]]:
        config = SimConfig(peers=n, length=64, seed=5, round_config=RING_FIRST)
        async with Simulation(config) as sim:
            seen = _watch(sim)
            outs = [await sim.round(r) for r in range(1, victim_round + 1)]
            return outs[-1], _dropped(seen, victim_round)

    out, dropped = asyncio.run(scenario())
    _check(out)
    five = {f"org-{i}" for i in range(n)} - {"org-3"}
    assert set(out.results) == five
    for res in out.results.values():
        assert set(res.participants) == five
    assert "org-3" in out.failures
    assert dropped >= five - {"org-1"}


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_a_member_that_proposes_less_than_it_masked_with_never_gets_a_wrong_sum(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """A hostile org-2 starts its ring over all five and at once runs the token with a
    proposal that leaves org-4 out. Either the rings complete first (U1 is every member:
    a completed ring decides the token, as it decides a ring attempt) or the token
    decides first and leaves org-4 out, and the others drop their rings, completed or
    not, and sum the four again. Either way every node that finishes holds the exact
    sum of the same survivors, and a left-out org-4 fails."""
    n = 5
    init = PendingU1.__init__

    def lying(self: PendingU1, *args: Any) -> None:
        init(self, *args)
        if self.agreement.me == "org-2" and self.state.round == 2:
            self.start(without=frozenset({"org-4"}))

    monkeypatch.setattr(PendingU1, "__init__", lying)

    async def scenario() -> tuple[RoundOutcome, set[str]]:
        config = SimConfig(peers=n, length=64, seed=seed, round_config=RING_FIRST)
        async with Simulation(config) as sim:
            seen = _watch(sim)
            _check(await sim.round(1))
            return await sim.round(2), _dropped(seen, 2)

    out, dropped = asyncio.run(scenario())
    _check(out)
    (survivors,) = {frozenset(r.survivors) for r in out.results.values()}
    if "org-4" in survivors:
        assert set(out.results) == set(survivors) == {f"org-{i}" for i in range(n)}
        assert dropped == set()
    else:
        four = {"org-0", "org-1", "org-2", "org-3"}
        assert set(out.results) == set(survivors) == four
        assert "org-4" in out.failures
        assert dropped >= four - {"org-2"}


@pytest.mark.parametrize(
    ("stage", "counted"),
    [("reduce", False), ("reduce.scatter.1", False), ("reduce.gather.1", True)],
)
def test_a_member_killed_in_the_ring_first_never_costs_the_sum(stage: str, counted: bool) -> None:
    """A member dies while the ring runs with U1 pending: the rings break (or, killed in
    the all-gather, complete at some) and the others join the token. Killed before its
    chunks are all in, it is left out (by the token, which it never answers, or by the
    attempt's agreement, its masks removed); killed in the all-gather, its input is in
    the sum the others complete. Either way the sum is exact."""
    n = 6
    victim = "org-4"

    async def scenario() -> RoundOutcome:
        config = SimConfig(peers=n, length=64, seed=5, round_config=RING_FIRST)
        async with Simulation(config, [FaultSpec(victim, Fault.KILL, stage, round=2)]) as sim:
            _check(await sim.round(1))
            return await sim.round(2)

    out = asyncio.run(scenario())
    _check(out)
    assert victim in out.killed
    assert set(out.results) == {f"org-{i}" for i in range(n)} - {victim}
    for res in out.results.values():
        assert (victim in res.survivors) is counted


def test_members_may_choose_apart_whether_the_ring_waits_for_the_token() -> None:
    """Two members start their ring first, the others run the token and wait for it:
    the early rings are the very ring the others start later (same members, same
    attempt), so every round completes with every member and sums exactly."""
    n = 5

    async def scenario() -> list[RoundOutcome]:
        waiting = dataclasses.replace(RING_FIRST, ring_first=False)
        config = SimConfig(peers=n, length=64, seed=4, round_config=waiting)
        async with Simulation(config) as sim:
            for org in ("org-0", "org-3"):
                sim.engines[org].config = RING_FIRST
            return [await sim.round(r) for r in (1, 2, 3)]

    for out in asyncio.run(scenario()):
        _check(out)
        assert len(out.results) == n
        for res in out.results.values():
            assert res.ring_attempts == 1
