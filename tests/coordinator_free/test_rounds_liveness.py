"""Liveness of the round engine: the ready stage's early end, a node that fell behind,
and attempts of one round that converge (issue 20, findings 1, 2 and 7)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
from coordinator_free.endpoint import Endpoint
from coordinator_free.identity import OrgIdentity
from coordinator_free.memory import InMemoryNetwork
from coordinator_free.ring import RingReducer
from coordinator_free.rounds import (
    RoundConfig,
    RoundEngine,
    RoundFailed,
    endpoint_signer,
    secagg_sessions,
)
from coordinator_free.rounds.ckks import KIND_CKKS_PARTIAL, CkksAggregator
from coordinator_free.rounds.context import StageContext
from coordinator_free.rounds.ready import READY, wait_is_over
from coordinator_free.rounds.state import RoundState, RoundTable

ORGS = ("org-a", "org-b", "org-c")
RUN = "run-live"


class Nodes:
    """Three round engines on an in-memory network; ``live`` is what each believes alive."""

    def __init__(self, config: RoundConfig, live: set[str] | None = None) -> None:
        self.network = InMemoryNetwork()
        ids = {
            o: OrgIdentity.generate(o, private_bytes=bytes([i + 1]) * 32)
            for i, o in enumerate(ORGS)
        }
        keys = {o: i.public_key for o, i in ids.items()}
        self.members = {o: dict(keys) for o in ORGS}  # each node's member list
        self.endpoints = {
            o: Endpoint(ids[o], "fed", self.network.transport(o), functools.partial(dict, m))
            for o, m in self.members.items()
        }
        self.live = set(ORGS) if live is None else live

        def believed() -> Iterable[str]:
            return sorted(self.live)

        self.engines = {
            o: RoundEngine(
                e,
                lambda: ORGS,
                secagg_sessions(*endpoint_signer(e), seed=7),
                config,
                live=believed,
            )
            for o, e in self.endpoints.items()
        }

    async def __aenter__(self) -> Nodes:
        for e in self.endpoints.values():
            await e.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for e in self.endpoints.values():
            await e.close()

    def vector(self, org: str) -> np.ndarray:
        return np.full(8, ORGS.index(org) + 1, dtype=np.uint64)


def ctx_with(ready: Iterable[str], live: set[str] | None, t: int = 2) -> StageContext:
    """The parts of a stage context the ready stage's early end reads."""
    state = RoundState("org-a", RUN, 0)
    for org in ready:
        state.inbox.put(READY, org, b"r")
    live_fn = None if live is None else (lambda: sorted(live))
    return cast(StageContext, SimpleNamespace(u0=ORGS, t=t, state=state, live=live_fn))


def test_finding_7_ready_stage_ends_early_only_on_all_ready_or_t_ready_and_the_rest_dead() -> None:
    everyone = set(ORGS)
    assert wait_is_over(ctx_with(ORGS, everyone))  # every participant is ready
    assert wait_is_over(ctx_with(ORGS, None))
    # t ready, the missing one merely suspect (still in the view): wait on
    assert not wait_is_over(ctx_with(("org-a", "org-b"), everyone))
    # t ready, the missing one confirmed dead: the wait may end
    assert wait_is_over(ctx_with(("org-a", "org-b"), {"org-a", "org-b"}))
    # fewer than t ready: never early, even when the others are dead (the old rule
    # ended the wait once every member believed alive was ready)
    assert not wait_is_over(ctx_with(("org-a",), {"org-a"}))
    # no membership layer: only all ready ends it early
    assert not wait_is_over(ctx_with(("org-a", "org-b"), None))


def test_a_slow_member_still_in_the_view_is_waited_for_until_the_deadline() -> None:
    """org-c is slow (still in the view, suspects included): the others hold t ready
    ones long before its ready comes, yet they wait for it, and it is in the round."""
    config = RoundConfig(ready_timeout=5.0, stage_timeout=5.0, threshold=2)

    async def scenario() -> dict[str, Any]:
        async with Nodes(config) as nodes:
            engines = nodes.engines

            async def late() -> Any:
                await asyncio.sleep(1.0)
                return await engines["org-c"].run_round(RUN, 0, nodes.vector("org-c"))

            results = await asyncio.gather(
                engines["org-a"].run_round(RUN, 0, nodes.vector("org-a")),
                engines["org-b"].run_round(RUN, 0, nodes.vector("org-b")),
                late(),
            )
            return dict(zip(ORGS, results, strict=True))

    results = asyncio.run(scenario())
    for result in results.values():
        assert set(result.survivors) == set(ORGS)
        assert int(result.sum[0]) == 6


def test_finding_2_a_node_that_fell_behind_is_not_refused_by_its_own_round_table() -> None:
    """The cause: the table refused the node's own round as "too far ahead" of the
    last round it finished; moving on to a later round moves the window along."""
    config = RoundConfig(lookahead_rounds=2)
    table = RoundTable("org-a", config, RingReducer(cast(Any, SimpleNamespace(on=lambda *a: 0))))
    table.finish(RUN, 3)
    table.advance(RUN, 40)  # a restart or a catch-up: round 40 is this node's round now
    assert table.state(RUN, 40).round == 40
    assert table.last_done(RUN) == 39


def test_finding_2_a_node_back_from_an_outage_takes_part_again() -> None:
    """org-a failed round 0 alone (the others were away); the federation moved on to
    round 30. Its next round, far past the last one it finished, completes with the
    others instead of failing with "cannot start: refused (stale) ... too far ahead"."""
    config = RoundConfig(ready_timeout=3.0, stage_timeout=5.0, threshold=2, lookahead_rounds=2)

    async def scenario() -> dict[str, Any]:
        async with Nodes(config) as nodes:
            engines = nodes.engines
            with pytest.raises(RoundFailed):
                await engines["org-a"].run_round(
                    RUN, 0, nodes.vector("org-a"), deadline=engines["org-a"].clock() + 0.3
                )
            results = await asyncio.gather(
                *(engines[o].run_round(RUN, 30, nodes.vector(o)) for o in ORGS)
            )
            return dict(zip(ORGS, results, strict=True))

    results = asyncio.run(scenario())
    assert set(results["org-a"].survivors) == set(ORGS)


def test_finding_1_a_node_at_an_earlier_attempt_joins_the_attempt_its_peers_run() -> None:
    """Attempts of one round are protocol rounds 10..19 (attempts_per_round=10):
    org-b and org-c run attempt 14, org-a starts attempt 11. Its ready stage sees their
    ready for the later attempt and leaves at once (well before its deadline) to join."""
    config = RoundConfig(
        ready_timeout=30.0, stage_timeout=5.0, attempts_per_round=10, lookahead_rounds=20
    )

    async def scenario() -> tuple[str, Any]:
        async with Nodes(config) as nodes:
            engines = nodes.engines
            others = [
                asyncio.create_task(engines[o].run_round(RUN, 14, nodes.vector(o)))
                for o in ("org-b", "org-c")
            ]
            await asyncio.sleep(0.3)
            with pytest.raises(RoundFailed) as failed:
                await asyncio.wait_for(
                    engines["org-a"].run_round(RUN, 11, nodes.vector("org-a")), 20
                )
            later = engines["org-a"].later_attempt(RUN, 11, 20)
            assert later == 14
            mine = await engines["org-a"].run_round(RUN, later, nodes.vector("org-a"))
            await asyncio.gather(*others)
            return failed.value.reason, mine

    reason, mine = asyncio.run(scenario())
    assert reason.startswith("superseded")
    assert set(mine.survivors) == set(ORGS)


def test_round_config_checks_the_attempts_and_open_rounds_fields() -> None:
    with pytest.raises(ValueError, match="attempts_per_round"):
        RoundConfig(attempts_per_round=0)
    with pytest.raises(ValueError, match="max_open_rounds"):
        RoundConfig(max_open_rounds=1)
    assert RoundConfig(attempts_per_round=8).attempts_end(13) == 16
    assert RoundConfig().attempts_end(13) == 14
    assert RoundConfig(lookahead_rounds=3).open_rounds_limit() == 8
    assert RoundConfig(max_open_rounds=5).open_rounds_limit() == 5


def test_a_ckks_wait_for_a_member_removed_meanwhile_fails_at_once() -> None:
    """The CKKS chain has no dropout tolerance: a round waiting on a member that the
    federation removes fails at once (the next attempt leaves it out), not after the
    aggregator's timeout (300 s here)."""

    async def scenario() -> RoundFailed:
        async with Nodes(RoundConfig()) as nodes:
            ckks = CkksAggregator(
                nodes.endpoints["org-a"],
                model_hashes=nodes.engines["org-a"].model_hashes,
                timeout=300.0,
            )
            waiting = asyncio.ensure_future(ckks._wait(RUN, 0, KIND_CKKS_PARTIAL, "org-c"))
            await asyncio.sleep(0.1)
            assert not waiting.done()
            del nodes.members["org-a"]["org-c"]
            ckks.members_removed()
            with pytest.raises(RoundFailed) as failed:
                await asyncio.wait_for(waiting, 30)
            return failed.value

    failed = asyncio.run(scenario())
    assert "no longer a member" in str(failed)
