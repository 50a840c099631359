"""A round without a quorum waits for one (issue 20, finding 1): backoff, alignment of
attempts, the run spec's ``quorum_wait_s``, and what the wait looks like."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from coordinator_free.endpoint import Endpoint
from coordinator_free.identity import OrgIdentity
from coordinator_free.memory import InMemoryNetwork
from coordinator_free.rounds import RoundConfig, RoundEngine, endpoint_signer, secagg_sessions

from org_node.audit.report import PROTOCOL_ATTEMPTS, round_facts_from_engine, run_round_of
from org_node.engine import (
    ATTEMPTS,
    EngineConfig,
    RoundReport,
    RunEngine,
    RunFailed,
    RunPlan,
    run_key,
)
from org_node.node.lifecycle import engine_activity
from org_node.policy import PolicyError, RunSpec
from org_node.quorum import QuorumWait, backoff_s
from org_node.run_config import QUORUM_WAIT_DEFAULT_S
from org_node.services import RunActivity
from tests.org_node.test_engine import MODEL, ORGS, FixedTrainer


def federation(threshold: int) -> tuple[InMemoryNetwork, dict[str, Endpoint], dict[str, Any]]:
    network = InMemoryNetwork()
    ids = {
        o: OrgIdentity.generate(o, private_bytes=bytes([i + 1]) * 32) for i, o in enumerate(ORGS)
    }
    keys = {o: i.public_key for o, i in ids.items()}
    endpoints = {o: Endpoint(ids[o], "fed", network.transport(o), lambda: keys) for o in ORGS}
    config = RoundConfig(
        ready_timeout=1.0,
        stage_timeout=5,
        threshold=threshold,
        lookahead_rounds=2 * ATTEMPTS,
        max_open_rounds=34,
        attempts_per_round=ATTEMPTS,
    )
    rounds = {
        o: RoundEngine(e, lambda: ORGS, secagg_sessions(*endpoint_signer(e), seed=7), config)
        for o, e in endpoints.items()
    }
    return network, endpoints, rounds


def the_plan(rounds: int = 1, **spec: Any) -> RunPlan:
    return RunPlan.from_spec(
        "quorum-run",
        {"trainer": "breast_cancer", "rounds": rounds, "participants": list(ORGS), **spec},
    )


def engines_for(
    rounds: dict[str, Any], tmp_path: Path, plan: RunPlan, config: EngineConfig
) -> dict[str, RunEngine]:
    return {
        o: RunEngine(
            plan,
            config,
            rounds=rounds[o],
            trainer=FixedTrainer(float(i + 1)),
            state_dir=tmp_path / o,
            initial_model=MODEL,
            rng=np.random.default_rng(i),
        )
        for i, o in enumerate(ORGS)
    }


QUICK = EngineConfig(
    ready_timeout_s=1.0, model_hash_timeout_s=5, quorum_backoff_s=0.2, quorum_backoff_max_s=0.4
)


def test_finding_1_a_round_waits_for_a_quorum_and_a_late_org_joins_the_attempt_under_way(
    tmp_path: Path,
) -> None:
    """t = 3 of 3 and org-c comes late (down, recovering): the others' attempts fail,
    they back off and try again instead of failing the run, and org-c, starting at
    attempt 1, joins the attempt its peers run. The old engine failed the run after
    max_attempts (3) and never aligned attempts."""
    seen: list[RunActivity] = []

    async def scenario() -> dict[str, Any]:
        _net, endpoints, rounds = federation(threshold=3)
        for e in endpoints.values():
            await e.start()
        engines = engines_for(rounds, tmp_path, the_plan(threshold=3), QUICK)

        async def late() -> Any:
            await asyncio.sleep(4.0)  # a few failed attempts at the others
            return await engines["org-c"].run()

        async def watch() -> None:
            while True:
                activity = engine_activity(engines["org-a"], None)
                if activity.doing == "quorum":
                    seen.append(activity)  # what runs show and the dashboard print
                await asyncio.sleep(0.05)

        watcher = asyncio.create_task(watch())
        try:
            outcomes = await asyncio.wait_for(
                asyncio.gather(engines["org-a"].run(), engines["org-b"].run(), late()), 60
            )
        finally:
            watcher.cancel()
            for e in endpoints.values():
                await e.close()
        return {
            "outcomes": outcomes,
            "reports": {o: engines[o] for o in ORGS},
        }

    got = asyncio.run(scenario())
    assert [o.status for o in got["outcomes"]] == ["completed"] * 3
    assert len({o.model_hash for o in got["outcomes"]}) == 1
    assert seen, "the engine never showed its wait for a quorum"
    assert any(a.orgs == ("org-c",) for a in seen)
    assert max(a.failures for a in seen) >= 2
    line = seen[-1].detail
    assert line.startswith("round 1: waiting for a quorum of 3")


def test_finding_1_a_round_fails_the_run_only_after_quorum_wait_s(tmp_path: Path) -> None:
    """org-c never comes: org-a and org-b keep trying for the spec's quorum_wait_s (2 s
    here, many more attempts than the old max_attempts), then fail with a reason."""

    async def scenario() -> tuple[Any, ...]:
        _net, endpoints, rounds = federation(threshold=3)
        for e in endpoints.values():
            await e.start()
        config = EngineConfig(
            ready_timeout_s=0.3,
            model_hash_timeout_s=5,
            quorum_backoff_s=0.05,
            quorum_backoff_max_s=0.1,
            max_attempts=1,
        )
        engines = engines_for(rounds, tmp_path, the_plan(quorum_wait_s=2, threshold=3), config)
        try:
            return await asyncio.wait_for(
                asyncio.gather(
                    engines["org-a"].run(), engines["org-b"].run(), return_exceptions=True
                ),
                30,
            )
        finally:
            for e in endpoints.values():
                await e.close()

    results = asyncio.run(scenario())
    for failed in results:
        assert isinstance(failed, RunFailed)
        text = str(failed)
        assert "found no quorum of 3" in text and "quorum_wait_s 2" in text
        attempts = int(text.split("(")[1].split(" attempts")[0])
        assert attempts > 1


def test_finding_1_backoff_doubles_and_is_capped() -> None:
    assert [backoff_s(n, 1.0, 30.0) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff_s(10_000, 1.0, 30.0) == 30.0  # no overflow after a long wait
    assert backoff_s(0, 1.0, 30.0) == 0.0


def test_attempts_are_one_constant_shared_with_the_audit_report() -> None:
    assert PROTOCOL_ATTEMPTS == ATTEMPTS >= 1024
    assert run_round_of(2 * ATTEMPTS + 37) == (3, 38)


def test_quorum_wait_s_is_a_validated_run_spec_field_with_a_default() -> None:
    base = {"trainer": "tabular", "rounds": 2, "participants": ["a", "b"]}
    assert RunSpec.from_dict(base).quorum_wait_s == QUORUM_WAIT_DEFAULT_S == 3600.0
    assert RunSpec.from_dict(base | {"quorum_wait_s": 90}).to_dict()["quorum_wait_s"] == 90.0
    for bad in (0, 0.5, 86401, "soon", float("nan"), True):
        with pytest.raises(PolicyError, match="quorum_wait_s"):
            RunSpec.from_dict(base | {"quorum_wait_s": bad})
    # a spec from before the field keeps its run key; another wait is another run
    assert run_key("r", base) == run_key("r", base | {"quorum_wait_s": 3600})
    assert run_key("r", base) != run_key("r", base | {"quorum_wait_s": 60})
    assert RunPlan.from_spec("r", base | {"quorum_wait_s": 60}).quorum_wait_s == 60.0


def test_engine_config_checks_the_backoff() -> None:
    with pytest.raises(Exception, match="quorum_backoff_max_s"):
        EngineConfig(quorum_backoff_s=5.0, quorum_backoff_max_s=1.0)


def test_the_wait_reads_as_one_line_with_whom_it_misses_and_the_next_attempt() -> None:
    now = 1_800_000_000.0
    wait = QuorumWait(2, now - 90, 3, failures=4, attempt=5, missing=("org-c", "org-d"))
    activity = RunActivity(
        wait.round,
        "quorum",
        wait.since,
        attempt=wait.attempt,
        orgs=wait.missing,
        failures=wait.failures,
        threshold=wait.threshold,
        next_attempt=now + 8,
        deadline=wait.since + 3600,
    )
    line = activity.detail
    assert line.startswith("round 2: waiting for a quorum of 3 (4 attempts failed; missing org-c")
    assert "attempt 5 at " in line and "the run fails if none by" in line
    assert wait.waited(now) == 90


def test_the_audit_report_records_how_long_a_round_waited() -> None:
    report = RoundReport(
        run_key="k",
        round=3,
        model_hash="ab" * 32,
        survivors=ORGS,
        dropped=(),
        attempts=6,
        local_steps=1,
        examples=1,
        metrics={"quorum_wait_s": 41.5},
        epsilon_spent=None,
        bytes_sent=0,
    )
    facts = round_facts_from_engine(report, ORGS)
    assert (facts.attempts, facts.quorum_wait_s) == (6, 41.5)
