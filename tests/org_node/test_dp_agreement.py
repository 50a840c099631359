"""Issue 21, finding 2: the DP mechanism is part of the signed run spec, every
participant refuses a run whose mechanism differs from its own, and each round is
charged for the noise its survivors actually added."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from coordinator_free.memory import InMemoryNetwork

from org_node.dp_spec import DpMechanism, DpMechanismError, dp_disagreement, with_own_dp
from org_node.engine import (
    EngineConfig,
    EngineError,
    EngineState,
    RunEngine,
    RunFailed,
    RunPlan,
    run_key,
)
from org_node.policy import PolicyError, RunSpec
from org_node.privacy import RdpAccountant, agreed_noise, skellam_round_for
from tests.org_node.test_engine import DP_CONFIG, ORGS, Federation, FixedTrainer, plan
from tests.org_node.test_node_inprocess import make_federation, start_nodes
from tests.run_flow import START_DELAY_S, admin_clients, seen

MECHANISM = DpMechanism(noise_multiplier=2.0, l2_clip=1.0, delta=1e-5)


def _set_dp(data_dir: Path, noise_multiplier: float) -> None:
    """This org's own mechanism: uniform weighting and the given noise multiplier."""
    path = data_dir / "fedweave.toml"
    text = path.read_text()
    text = text.replace('weighting = "examples"', 'weighting = "uniform"')
    text = text.replace("noise_multiplier = 1.0", f"noise_multiplier = {noise_multiplier}")
    text = text.replace("l2_clip = 10000.0", "l2_clip = 1.0")
    path.write_text(text)


def test_finding_2_mismatched_dp_parameters_are_refused_at_consent(tmp_path: Path) -> None:
    """org-a at noise multiplier 0.8, org-b and org-c at 2.0 (the finding's setting): a
    run org-a proposes carries org-a's mechanism in its signed spec, and org-b and org-c
    refuse to consent to it, naming the field; a run with their mechanism is refused by
    org-a. Nothing starts."""
    dirs = make_federation(tmp_path)
    for org, nm in zip(ORGS, (0.8, 2.0, 2.0), strict=True):
        _set_dp(dirs[org], nm)
    spec = {"trainer": "breast_cancer", "rounds": 2, "participants": list(ORGS), "epsilon": 6.0}

    async def scenario() -> dict[str, Any]:
        network = InMemoryNetwork()
        nodes = await start_nodes(dirs, network)
        clients = admin_clients(dirs, nodes)
        out: dict[str, Any] = {}
        try:
            body = {"name": "low-noise", "spec": spec, "start_delay_s": START_DELAY_S}
            r = await clients["org-a"].post("/v1/runs", json=body)
            assert r.status_code == 201, r.text
            out["proposed"] = r.json()["spec"]
            for org in ORGS:
                out[f"seen-{org}"] = (await seen(clients[org], "low-noise"))["spec"]
            out["accept"] = {
                org: await clients[org].post("/v1/runs/low-noise/accept", json={}) for org in ORGS
            }
            body = {"name": "their-noise", "spec": spec, "start_delay_s": START_DELAY_S}
            r = await clients["org-b"].post("/v1/runs", json=body)
            assert r.status_code == 201, r.text
            await seen(clients["org-a"], "their-noise")
            out["a-accepts-theirs"] = await clients["org-a"].post(
                "/v1/runs/their-noise/accept", json={}
            )
            await asyncio.sleep(2 * START_DELAY_S)
            out["states"] = {
                org: (await clients[org].get("/v1/runs/low-noise")).json()["state"] for org in ORGS
            }
        finally:
            for c in clients.values():
                await c.aclose()
            for node in nodes.values():
                await node.stop()
        return out

    out = asyncio.run(scenario())
    assert out["proposed"]["dp"]["noise_multiplier"] == 0.8  # org-a's own, filled in
    assert all(out[f"seen-{o}"]["dp"] == out["proposed"]["dp"] for o in ORGS)
    accept = out["accept"]
    assert accept["org-a"].status_code == 200
    for org in ("org-b", "org-c"):
        assert accept[org].status_code == 409
        detail = accept[org].json()["detail"]
        assert "DP mechanism differs" in detail and "noise_multiplier" in detail
        assert "0.8" in detail and "2.0" in detail
    assert out["a-accepts-theirs"].status_code == 409
    assert "noise_multiplier" in out["a-accepts-theirs"].json()["detail"]
    assert "running" not in out["states"].values()
    assert "completed" not in out["states"].values()


def test_the_mechanism_is_signed_into_the_run_key_and_validated() -> None:
    base = {"trainer": "t", "rounds": 1, "participants": ["a", "b"], "epsilon": 2.0}
    keyed = run_key("r", base | {"dp": MECHANISM.to_dict()})
    other = DpMechanism(noise_multiplier=2.5, l2_clip=1.0, delta=1e-5)
    assert keyed != run_key("r", base | {"dp": other.to_dict()})
    assert keyed != run_key("r", base)
    # a spec without the field keeps the key it had before the field existed
    assert run_key("r", base) == run_key("r", base | {"dp": None})
    with pytest.raises(PolicyError, match="needs an epsilon"):
        RunSpec.from_dict(base | {"epsilon": None, "dp": MECHANISM.to_dict()})
    with pytest.raises(PolicyError, match="noise_for"):
        RunSpec.from_dict(base | {"dp": MECHANISM.to_dict() | {"noise_for": "some"}})
    with pytest.raises(DpMechanismError, match="unknown dp keys: sigma"):
        DpMechanism.from_dict(MECHANISM.to_dict() | {"sigma": 1})
    with pytest.raises(DpMechanismError, match="delta"):
        DpMechanism(noise_multiplier=1.0, l2_clip=1.0, delta=1.0)
    assert RunSpec.from_dict(base | {"dp": MECHANISM.to_dict()}).dp == MECHANISM


def test_a_node_fills_in_its_own_mechanism_and_names_every_difference() -> None:
    own = EngineConfig(noise_multiplier=2.0, l2_clip=1.0, delta=1e-5, weighting="uniform")
    spec = {"trainer": "t", "rounds": 1, "participants": ["a", "b"], "epsilon": 2.0}
    filled = with_own_dp(spec, own)
    assert DpMechanism.from_dict(filled["dp"]) == DpMechanism.of_engine(own)
    assert with_own_dp(spec | {"epsilon": None}, own) == spec | {"epsilon": None}
    assert dp_disagreement(filled, own) is None
    theirs = filled | {"dp": filled["dp"] | {"noise_multiplier": 0.8, "delta": 1e-6}}
    reason = dp_disagreement(theirs, own)
    assert reason is not None
    assert "noise_multiplier: the run's 0.8, this org's 2.0" in reason
    assert "delta: the run's 1e-06, this org's 1e-05" in reason
    assert "names no DP mechanism" in (dp_disagreement(spec, own) or "")
    weighted = EngineConfig(noise_multiplier=2.0, l2_clip=1.0, delta=1e-5)
    assert 'weighting = "uniform"' in (dp_disagreement(filled, weighted) or "")


def test_an_engine_refuses_a_plan_whose_mechanism_is_not_its_own(tmp_path: Path) -> None:
    """Start, resume and recovery build the engine: each refuses the mismatch too."""
    other = DP_CONFIG.__class__(**{**DP_CONFIG.__dict__, "noise_multiplier": 0.5})
    with pytest.raises(EngineError, match=r"^dp: .*noise_multiplier: the run's 0.5"):
        RunEngine(
            plan(rounds=1, epsilon=4.0, dp=other),
            DP_CONFIG,
            rounds=Federation().rounds["org-a"],
            trainer=FixedTrainer(0.1),
            state_dir=tmp_path,
        )


def _engine(tmp_path: Path, config: EngineConfig, threshold: int = 2) -> RunEngine:
    the_plan = plan(rounds=1, epsilon=50.0, dp=config)
    the_plan = RunPlan.from_spec("test-run", dict(the_plan.spec) | {"threshold": threshold})
    return RunEngine(
        the_plan,
        config,
        rounds=Federation().rounds["org-a"],
        trainer=FixedTrainer(0.1),
        state_dir=tmp_path,
    )


MODEL = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)}
DIM = 6 + 2 + 1 + 1  # the model, FedNova's tau and the weight


def test_a_round_is_charged_for_the_noise_its_survivors_added(tmp_path: Path) -> None:
    """With noise sized for all three participants, a round with two survivors carries
    two thirds of the variance and is charged for exactly that: more than a full round,
    never less than what the sum holds."""
    engine = _engine(tmp_path, DP_CONFIG)
    assert engine.dp is not None and engine.budget is not None
    charge = engine._charge_for(MODEL)
    assert charge is not None
    full, lost = RdpAccountant(), RdpAccountant()
    full.charge(skellam_round_for(engine.dp, DIM, 3))
    lost.charge(skellam_round_for(engine.dp, DIM, 2))
    spent = charge(2)
    assert spent == pytest.approx(lost.epsilon(1e-5), rel=1e-12)
    assert spent > full.epsilon(1e-5)
    mech = skellam_round_for(engine.dp, DIM, 2)
    # the variance charged is that of two shares of the noise, in ring units
    assert mech.variance == pytest.approx(2 * 2 * engine.dp.mu_org)
    assert math.sqrt(mech.variance) == pytest.approx(
        math.sqrt(2 / 3) * DP_CONFIG.noise_multiplier * DP_CONFIG.l2_clip * engine.codec.scale
    )


def test_threshold_sizing_gives_every_completed_round_at_least_the_nominal_noise(
    tmp_path: Path,
) -> None:
    config = DP_CONFIG.__class__(**{**DP_CONFIG.__dict__, "noise_for": "threshold"})
    engine = _engine(tmp_path, config, threshold=2)
    assert engine.dp is not None
    nominal = (config.noise_multiplier * config.l2_clip * engine.codec.scale) ** 2
    assert engine.dp.n_orgs == 2  # each share sized for the threshold
    for survivors in (2, 3):
        variance = skellam_round_for(engine.dp, DIM, survivors).variance
        assert variance >= nominal * (1 - 1e-12)
    assert agreed_noise(DpMechanism.of_engine(config), 3, 2).mu_org == engine.dp.mu_org


def test_the_budget_is_checked_at_the_least_noise_a_round_can_carry(tmp_path: Path) -> None:
    """The hard stop holds whatever the dropouts: a budget that one full round fits but
    a round of ``threshold`` survivors would exceed refuses the round before it."""
    engine = _engine(tmp_path, DP_CONFIG)
    assert engine.dp is not None and engine.budget is not None
    acct = RdpAccountant()
    acct.charge(skellam_round_for(engine.dp, DIM, 3))
    full = acct.epsilon(1e-5)
    acct2 = RdpAccountant()
    acct2.charge(skellam_round_for(engine.dp, DIM, 2))
    worst = acct2.epsilon(1e-5)
    engine.budget.epsilon_max = (full + worst) / 2
    from org_node.privacy import BudgetExceeded

    with pytest.raises(BudgetExceeded):
        engine._charge_for(MODEL)


def test_a_round_that_fails_after_the_update_went_out_is_charged_at_the_least_noise(
    tmp_path: Path,
) -> None:
    """The protected update may be in a sum others released: the round is charged as if
    only ``threshold`` orgs survived, and the charge is saved with the engine's state."""
    engine = _engine(tmp_path, DP_CONFIG)
    engine.state.model = {k: v.copy() for k, v in MODEL.items()}

    async def broken(round: int, vector: np.ndarray) -> Any:
        raise RunFailed("the federation went away")

    engine._aggregate = broken  # type: ignore[method-assign]
    with pytest.raises(RunFailed):
        asyncio.run(engine.run_one_round())
    assert engine.dp is not None and engine.budget is not None
    worst = RdpAccountant()
    worst.charge(skellam_round_for(engine.dp, DIM, 2))
    assert engine.budget.spent == pytest.approx(worst.epsilon(1e-5), rel=1e-12)
    saved = EngineState.from_bytes(engine.state_path.read_bytes())
    assert saved.accountant is not None and len(saved.accountant["rounds"]) == 1
    assert saved.round == 0
