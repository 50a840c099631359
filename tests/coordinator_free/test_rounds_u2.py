"""The U2 gap on the round engine: an org's shares reach only some holders before it
drops, and a holder it reached falls silent before unmasking. Whoever finishes holds
the exact sum of its survivors; whoever does not says why."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import pytest
from coordinator_free.rounds import RoundConfig, SecAggSession
from coordinator_free.sim import Fault, FaultSpec, PeerKilled, RoundOutcome, SimConfig, Simulation

QUICK = RoundConfig(
    ready_timeout=0.6, stage_timeout=4.0, step_timeout=2.0, send_timeout=4.0, ring_min_chunk=1
)


class PartialShares(Simulation):
    """A simulation where ``dropper``'s link to every org but ``reached`` goes down as
    it begins to share its keys in round 1 (so its shares reach those alone), and it
    dies as that stage ends."""

    def __init__(
        self,
        config: SimConfig,
        faults: Sequence[FaultSpec],
        dropper: str,
        reached: frozenset[str],
    ) -> None:
        super().__init__(config, faults)
        self.dropper = dropper
        self.reached = reached
        self.cut = False
        linked = self.network._linked

        def only_reached(a: str, b: str) -> bool:
            if self.cut and dropper in (a, b) and not {a, b} <= reached | {dropper}:
                return False
            return linked(a, b)

        self.network._linked = only_reached  # type: ignore[method-assign]

    async def _hook(self, org: str, run: str, round: int, stage: str) -> None:
        if org == self.dropper and round == 1:
            if stage == "share":
                self.cut = True
            elif stage == "agree-ready":
                self.network.kill(org)
                self.killed.add(org)
                raise PeerKilled(f"{org} dropped after sharing with {sorted(self.reached)}")
        await super()._hook(org, run, round, stage)


def names(n: int) -> list[str]:
    """The simulator's org ids for ``n`` peers."""
    return [f"org-{i:0{len(str(n - 1))}d}" for i in range(n)]


def _run(
    n: int, reached: frozenset[str], silent: str, *, ahead: bool = True
) -> tuple[RoundOutcome, RoundOutcome]:
    dropper = names(n)[-1]
    round_config = dataclasses.replace(QUICK, shares_ahead_from=3 if ahead else None)
    config = SimConfig(peers=n, length=64, seed=4, round_config=round_config)
    faults = [FaultSpec(silent, Fault.KILL, "unmask", round=1)]

    async def scenario() -> tuple[RoundOutcome, RoundOutcome]:
        async with PartialShares(config, faults, dropper, reached) as sim:
            return await sim.round(1), await sim.round(2)

    return asyncio.run(scenario())


@pytest.mark.parametrize("ahead", [True, False], ids=["token", "views"])
@pytest.mark.parametrize("n", [7, 12])
@pytest.mark.parametrize("reach", ["one", "all-but-one"])
def test_finding_4_a_partial_share_send_and_a_silent_holder_never_give_a_wrong_sum(
    n: int, reach: str, ahead: bool
) -> None:
    """With the shares sealed ahead (``token``) the participants are agreed by the token, which
    every live member joins; without (``views``) the members whose shares all came with
    their own view hash settle at no message and the others by views."""
    orgs = names(n)
    dropper, silent = orgs[-1], orgs[0]
    reached = frozenset(orgs[:1] if reach == "one" else orgs[:-2])
    first, second = _run(n, reached, silent, ahead=ahead)
    # every finisher holds the plaintext sum of exactly its survivors, all the same,
    # and every other org failed its round with a reason
    assert first.problems() == []
    assert dropper in first.killed
    for org in set(orgs) - first.killed:
        assert org in first.results or first.failures[org]
    for res in first.results.values():
        assert dropper not in res.survivors
        assert (res.sum == first.expected(res.survivors)).all()
    if reach == "all-but-one" and ahead:
        # the member it did not reach proposes no dropper, which the token's decision
        # leaves out: every live member finishes, the dropper in no one's participants
        assert set(first.results) == set(orgs) - first.killed
        for res in first.results.values():
            assert dropper not in res.participants
    elif reach == "all-but-one":
        # the members it reached settled U1 with it; the silent holder masked with it,
        # and its masks with every survivor come off its reconstructed key
        assert set(first.results) == set(orgs[1:-2])
        for res in first.results.values():
            assert silent in res.survivors and dropper in res.dropped
    # the next round works without the dead
    assert second.problems() == []
    assert set(second.results) == set(orgs) - first.killed


def test_finding_4_a_node_lacking_the_shares_of_a_participant_fails_by_name_and_masks_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # org-1 refuses org-3's shares after the participants were settled with org-3 (by
    # the share exchange's view hashes; with the shares sealed ahead, a node lacking a
    # share joins the token without its sender instead: test_ring_first):
    # masking without them would carry other masks than the participants know of, so
    # org-1 fails its round naming org-3, and the others sum exactly without org-1
    taken = SecAggSession.receive_share

    def refuse(self: SecAggSession, sender: str, data: bytes) -> None:
        if self.peer.me == "org-1" and sender == "org-3":
            raise ValueError("refused for the test")
        taken(self, sender, data)

    monkeypatch.setattr(SecAggSession, "receive_share", refuse)

    async def scenario() -> RoundOutcome:
        exchange = dataclasses.replace(QUICK, shares_ahead_from=None)
        async with Simulation(SimConfig(peers=6, length=64, seed=5, round_config=exchange)) as sim:
            return await sim.round(1)

    out = asyncio.run(scenario())
    assert out.problems() == []
    assert "did not reach this node" in out.failures["org-1"]
    assert "['org-3']" in out.failures["org-1"]
    assert set(out.results) == {"org-0", "org-2", "org-3", "org-4", "org-5"}
    for res in out.results.values():
        assert "org-1" not in res.survivors
        assert (res.sum == out.expected(res.survivors)).all()
