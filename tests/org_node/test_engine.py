"""The run engine over real round engines on an in-memory network (tiny models)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from coordinator_free.endpoint import Endpoint
from coordinator_free.identity import OrgIdentity
from coordinator_free.memory import InMemoryNetwork
from coordinator_free.rounds import (
    MASKS_PREPARED,
    RoundConfig,
    RoundEngine,
    RoundObservation,
    endpoint_signer,
    secagg_sessions,
)
from coordinator_free.rounds.ckks import CkksAggregator

from org_node.dp_spec import DpMechanism
from org_node.engine import (
    ATTEMPTS,
    EngineConfig,
    EngineError,
    RoundReport,
    RunEngine,
    RunPlan,
    TrainingConfig,
    UpdateRejected,
    check_update,
    model_hash,
    run_key,
)
from org_node.training.exchange import LocalResult

ORGS = ("org-a", "org-b", "org-c")
MODEL = {"w": np.zeros((2, 3), dtype=np.float32), "b": np.zeros(3, dtype=np.float32)}


class FixedTrainer:
    """Hands back ``delta = value * ones`` after ``steps`` steps on ``examples`` examples."""

    def __init__(self, value: float, steps: int = 4, examples: int = 10) -> None:
        self.value = value
        self.steps = steps
        self.examples = examples
        self.calls = 0

    def train(
        self, global_state: Mapping[str, np.ndarray], round: int, options: Mapping[str, Any]
    ) -> LocalResult:
        self.calls += 1
        update = {
            k: np.full(np.shape(v), self.value, dtype=np.float32) for k, v in global_state.items()
        }
        return LocalResult(update, self.examples, self.steps, {"train_loss": 1.0 / (round + 1)})


class Federation:
    def __init__(self, orgs: tuple[str, ...] = ORGS, attempts_per_round: int | None = None) -> None:
        self.network = InMemoryNetwork()
        self.ids = {
            o: OrgIdentity.generate(o, private_bytes=bytes([i + 1]) * 32)
            for i, o in enumerate(orgs)
        }
        keys = {o: i.public_key for o, i in self.ids.items()}
        self.endpoints = {
            o: Endpoint(self.ids[o], "fed", self.network.transport(o), lambda: keys) for o in orgs
        }
        config = RoundConfig(
            ready_timeout=5,
            stage_timeout=5,
            lookahead_rounds=2 * ATTEMPTS,
            attempts_per_round=attempts_per_round,
        )
        self.rounds = {
            o: RoundEngine(e, lambda: orgs, secagg_sessions(*endpoint_signer(e), seed=7), config)
            for o, e in self.endpoints.items()
        }

    async def start(self) -> None:
        for e in self.endpoints.values():
            await e.start()

    async def close(self) -> None:
        for e in self.endpoints.values():
            await e.close()


def plan(
    rounds: int = 2,
    epsilon: float | None = None,
    backend: str = "masked",
    dp: EngineConfig | None = None,
) -> RunPlan:
    """A run of ORGS; with an ``epsilon``, its DP mechanism is ``dp``'s (the orgs')."""
    spec: dict[str, Any] = {
        "trainer": "breast_cancer",
        "rounds": rounds,
        "participants": list(ORGS),
        "epsilon": epsilon,
    }
    if epsilon is not None:
        spec["dp"] = DpMechanism.of_engine(dp or fast()).to_dict()
    return RunPlan.from_spec("test-run", spec | {"backend": backend})


def fast(**kw: Any) -> EngineConfig:
    return EngineConfig(ready_timeout_s=5, model_hash_timeout_s=5, **kw)


DP_CONFIG = EngineConfig(
    ready_timeout_s=5,
    model_hash_timeout_s=5,
    weighting="uniform",
    l2_clip=10.0,
    noise_multiplier=3.0,
)
"""Every org's engine config in the DP tests: one mechanism for all."""


def make_engines(
    fed: Federation,
    tmp_path: Path,
    trainers: dict[str, Any],
    the_plan: RunPlan,
    config: EngineConfig,
    **kw: Any,
) -> dict[str, RunEngine]:
    return {
        o: RunEngine(
            the_plan,
            config,
            rounds=fed.rounds[o],
            trainer=trainers[o],
            state_dir=tmp_path / o,
            initial_model=MODEL,
            rng=np.random.default_rng(i),
            **kw,
        )
        for i, o in enumerate(ORGS)
    }


def test_three_orgs_end_with_the_same_model_equal_to_the_weighted_mean(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[Any], dict[str, RunEngine]]:
        fed = Federation()
        await fed.start()
        trainers = {
            o: FixedTrainer(v, examples=n)
            for o, v, n in zip(ORGS, (0.1, 0.2, 0.6), (10, 10, 20), strict=True)
        }
        engines = make_engines(fed, tmp_path, trainers, plan(rounds=2), fast(fednova=False))
        try:
            out = await asyncio.gather(*(e.run() for e in engines.values()))
        finally:
            await fed.close()
        return list(out), engines

    outcomes, engines = asyncio.run(scenario())
    assert {o.status for o in outcomes} == {"completed"}
    assert len({o.model_hash for o in outcomes}) == 1
    # weighted mean delta per round: (10*0.1 + 10*0.2 + 20*0.6) / 40 = 0.375, two rounds
    model = engines["org-a"].state.model
    np.testing.assert_allclose(model["w"], np.full((2, 3), 0.75), atol=1e-6)
    assert model_hash(model).hex() == outcomes[0].model_hash


def test_a_run_s_rounds_after_its_first_take_the_masks_prepared_while_the_update_trained(
    tmp_path: Path,
) -> None:
    """With the protocol rounds an org node numbers (``ATTEMPTS`` per training round, as
    its engine is configured), each training round after the first adds its update to
    the masks expanded after the round before; the model is the weighted mean still."""
    seen: dict[str, list[tuple[int, bool]]] = {o: [] for o in ORGS}

    async def scenario() -> dict[str, RunEngine]:
        fed = Federation(attempts_per_round=ATTEMPTS)
        for org, engine in fed.rounds.items():

            def completed(obs: RoundObservation, org: str = org) -> None:
                if obs.kind == "completed":
                    seen[org].append((obs.round, obs.detail == MASKS_PREPARED))

            engine.add_observer(completed)
        await fed.start()
        trainers = {o: FixedTrainer(v) for o, v in zip(ORGS, (0.1, 0.2, 0.6), strict=True)}
        engines = make_engines(fed, tmp_path, trainers, plan(rounds=3), fast(fednova=False))
        try:
            outcomes = await asyncio.gather(*(e.run() for e in engines.values()))
        finally:
            await fed.close()
        assert {o.status for o in outcomes} == {"completed"}
        return engines

    engines = asyncio.run(scenario())
    for org in ORGS:
        assert [r // ATTEMPTS for r, _ in seen[org]] == [0, 1, 2]
        # the first round knows no masking key of its peers
        assert [took for _, took in seen[org]] == [False, True, True]
    np.testing.assert_allclose(engines["org-b"].state.model["w"], np.full((2, 3), 0.9), atol=1e-6)


def test_fednova_normalizes_by_steps_so_a_slow_org_does_not_bias(tmp_path: Path) -> None:
    # same per-step progress (0.05 per step), different step counts: FedNova gives
    # tau_eff * mean(delta / tau) = tau_eff * 0.05 with tau_eff the weighted mean steps
    async def scenario() -> dict[str, RunEngine]:
        fed = Federation()
        await fed.start()
        trainers = {
            "org-a": FixedTrainer(0.05 * 10, steps=10),
            "org-b": FixedTrainer(0.05 * 10, steps=10),
            "org-c": FixedTrainer(0.05 * 2, steps=2),
        }
        engines = make_engines(fed, tmp_path, trainers, plan(rounds=1), fast(weighting="uniform"))
        try:
            await asyncio.gather(*(e.run() for e in engines.values()))
        finally:
            await fed.close()
        return engines

    engines = asyncio.run(scenario())
    tau_eff = (10 + 10 + 2) / 3
    np.testing.assert_allclose(
        engines["org-b"].state.model["b"], np.full(3, 0.05 * tau_eff), atol=1e-6
    )


def test_nan_update_is_refused_naming_the_field_and_never_sent(tmp_path: Path) -> None:
    class NanTrainer(FixedTrainer):
        def train(
            self, global_state: Mapping[str, np.ndarray], round: int, options: Mapping[str, Any]
        ) -> LocalResult:
            result = super().train(global_state, round, options)
            result.update["b"][1] = np.nan
            return result

    async def scenario() -> tuple[BaseException, int]:
        fed = Federation()
        await fed.start()
        engine = RunEngine(
            plan(),
            fast(),
            rounds=fed.rounds["org-a"],
            trainer=NanTrainer(0.1),
            state_dir=tmp_path,
            initial_model=MODEL,
        )
        try:
            with pytest.raises(UpdateRejected) as info:
                await engine.run_one_round()
        finally:
            await fed.close()
        return info.value, fed.network.messages_sent["org-a"]

    exc, sent = asyncio.run(scenario())
    assert "update.b" in str(exc)
    assert sent == 0


def test_check_update_names_the_mismatched_tensor() -> None:
    with pytest.raises(UpdateRejected, match=r"update\.w: shape \(3, 2\)"):
        check_update({"w": np.zeros((3, 2)), "b": np.zeros(3)}, MODEL)
    with pytest.raises(UpdateRejected, match=r"update\.b: missing"):
        check_update({"w": np.zeros((2, 3))}, MODEL)
    with pytest.raises(UpdateRejected, match=r"update\.extra"):
        check_update({**MODEL, "extra": np.zeros(1)}, MODEL)
    check_update({k: v + 1 for k, v in MODEL.items()}, MODEL)


def test_privacy_budget_stops_before_a_round_that_would_exceed_epsilon(tmp_path: Path) -> None:
    async def scenario() -> list[Any]:
        fed = Federation()
        await fed.start()
        trainers = {o: FixedTrainer(0.01) for o in ORGS}
        engines = make_engines(
            fed,
            tmp_path,
            trainers,
            plan(rounds=50, epsilon=3.0, dp=DP_CONFIG),
            DP_CONFIG,
        )
        try:
            return list(await asyncio.gather(*(e.run() for e in engines.values())))
        finally:
            await fed.close()

    outcomes = asyncio.run(scenario())
    assert {o.status for o in outcomes} == {"budget_exhausted"}
    done = {o.rounds_done for o in outcomes}
    assert len(done) == 1 and 0 < done.pop() < 50
    assert len({o.model_hash for o in outcomes}) == 1
    assert "epsilon_max=3" in outcomes[0].reason


def test_state_is_saved_each_round_and_a_restarted_engine_resumes(tmp_path: Path) -> None:
    checkpoints: list[tuple[str, int, int]] = []
    reports: list[RoundReport] = []

    async def scenario() -> dict[str, RunEngine]:
        fed = Federation()
        await fed.start()
        trainers = {o: FixedTrainer(0.1) for o in ORGS}

        def make_ckpt(org: str) -> Any:
            async def ckpt(data: bytes, version: int) -> None:
                checkpoints.append((org, version, len(data)))

            return ckpt

        engines = {
            o: RunEngine(
                plan(rounds=3),
                fast(checkpoint_every=2),
                rounds=fed.rounds[o],
                trainer=trainers[o],
                state_dir=tmp_path / o,
                initial_model=MODEL,
                checkpoint=make_ckpt(o),
                on_round=reports.append,
            )
            for o in ORGS
        }
        try:
            await asyncio.gather(*(e.run_one_round() for e in engines.values()))
            await asyncio.gather(*(e.run_one_round() for e in engines.values()))
        finally:
            await fed.close()
        return engines

    engines = asyncio.run(scenario())
    assert sorted(checkpoints)[0][:2] == ("org-a", 2) and len(checkpoints) == 3
    assert {r.round for r in reports} == {1, 2} and all(
        r.survivors == tuple(sorted(r.survivors)) or r.survivors for r in reports
    )
    fed2 = Federation()
    again = RunEngine(
        plan(rounds=3),
        fast(),
        rounds=fed2.rounds["org-a"],
        trainer=FixedTrainer(0.1),
        state_dir=tmp_path / "org-a",
        initial_model=MODEL,
    )
    assert again.resume() is True
    assert again.state.round == 2
    assert model_hash(again.state.model) == model_hash(engines["org-a"].state.model)
    assert again.strategy.round == 2


def test_harness_debug_export_writes_each_plaintext_update(tmp_path: Path) -> None:
    async def scenario() -> None:
        fed = Federation()
        await fed.start()
        trainers = {o: FixedTrainer(0.1 * (i + 1)) for i, o in enumerate(ORGS)}
        engines = make_engines(
            fed, tmp_path, trainers, plan(rounds=1), fast(), debug_export=tmp_path / "export"
        )
        try:
            await asyncio.gather(*(e.run() for e in engines.values()))
        finally:
            await fed.close()

    asyncio.run(scenario())
    key = plan(rounds=1).run_key
    files = sorted((tmp_path / "export").rglob("*.npy"))
    assert [f.parent.parent.name for f in files] == list(ORGS)
    packed = np.load(tmp_path / "export" / "org-b" / key / "round-000000.npy")
    # [w*delta/tau ..., w*tau, w] with w=10 examples, tau=4 steps, delta=0.2
    np.testing.assert_allclose(packed[:-2], 10 * 0.2 / 4, rtol=1e-6)
    assert packed[-2:].tolist() == [40.0, 10.0]


def test_a_harness_hold_file_stops_the_org_after_its_export_until_removed(
    tmp_path: Path,
) -> None:
    key = plan(rounds=1).run_key
    export = tmp_path / "export"
    hold = export / "org-b" / key / "round-000000.hold"
    hold.parent.mkdir(parents=True)
    hold.touch()

    async def scenario() -> dict[str, RunEngine]:
        fed = Federation()
        await fed.start()
        trainers = {o: FixedTrainer(0.1 * (i + 1)) for i, o in enumerate(ORGS)}
        engines = make_engines(fed, tmp_path, trainers, plan(rounds=1), fast(), debug_export=export)
        try:
            runs = asyncio.gather(*(e.run() for e in engines.values()))
            for _ in range(200):  # until org-b's update is made and exported
                if hold.with_suffix(".npy").exists():
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)
            # held: nobody finished the round, since org-b sent nothing of it
            assert hold.with_suffix(".npy").exists()
            assert [e.state.round for e in engines.values()] == [0, 0, 0]
            hold.unlink()
            await runs
        finally:
            await fed.close()
        return engines

    engines = asyncio.run(scenario())
    assert [e.state.round for e in engines.values()] == [1, 1, 1]
    assert len({model_hash(e.state.model) for e in engines.values()}) == 1


def test_ckks_backend_gives_every_org_the_same_model(tmp_path: Path) -> None:
    async def scenario() -> tuple[list[Any], dict[str, RunEngine], int]:
        fed = Federation()
        aggregators = {
            o: CkksAggregator(e, model_hashes=fed.rounds[o].model_hashes, timeout=10)
            for o, e in fed.endpoints.items()
        }
        await fed.start()
        trainers = {
            o: FixedTrainer(v, examples=n)
            for o, v, n in zip(ORGS, (0.1, 0.2, 0.6), (10, 10, 20), strict=True)
        }
        engines = {
            o: RunEngine(
                plan(rounds=2, backend="ckks"),
                fast(),
                rounds=fed.rounds[o],
                trainer=trainers[o],
                state_dir=tmp_path / o,
                initial_model=MODEL,
                ckks=aggregators[o],
            )
            for o in ORGS
        }
        try:
            out = await asyncio.gather(*(e.run() for e in engines.values()))
        finally:
            await fed.close()
        return list(out), engines, fed.network.messages_sent["org-a"]

    outcomes, engines, sent = asyncio.run(scenario())
    assert {o.status for o in outcomes} == {"completed"}
    assert len({o.model_hash for o in outcomes}) == 1
    # FedNova with equal steps is the example-weighted mean: 0.375 per round
    np.testing.assert_allclose(engines["org-c"].state.model["w"], 0.75, atol=1e-3)
    assert sent > 0


def test_ckks_needs_its_aggregator_and_takes_no_epsilon(tmp_path: Path) -> None:
    fed = Federation()
    with pytest.raises(EngineError, match=r"^backend:"):
        RunEngine(
            plan(backend="ckks"),
            fast(),
            rounds=fed.rounds["org-a"],
            trainer=FixedTrainer(0.1),
            state_dir=tmp_path,
            initial_model=MODEL,
        )
    agg = CkksAggregator(fed.endpoints["org-a"], model_hashes=fed.rounds["org-a"].model_hashes)
    with pytest.raises(EngineError, match=r"^epsilon:"):
        RunEngine(
            plan(backend="ckks", epsilon=1.0),
            fast(weighting="uniform"),
            rounds=fed.rounds["org-a"],
            trainer=FixedTrainer(0.1),
            state_dir=tmp_path,
            initial_model=MODEL,
            ckks=agg,
        )


def test_run_key_is_the_same_for_the_same_name_and_spec() -> None:
    spec = {"trainer": "breast_cancer", "rounds": 2, "participants": ["b", "a"], "epsilon": 1}
    same = {"trainer": "breast_cancer", "rounds": 2, "participants": ["a", "b"], "epsilon": 1.0}
    assert run_key("r", spec) == run_key("r", same)
    assert run_key("r", spec) != run_key("r2", spec)
    assert run_key("r", spec) != run_key("r", spec | {"rounds": 3})


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"strategy": "nope"}, "engine.strategy"),
        ({"ring_bits": 48}, "engine.ring_bits"),
        ({"weighting": "size"}, "engine.weighting"),
        ({"max_attempts": ATTEMPTS + 1}, "engine.max_attempts"),
        ({"owner_unmask_from": 2}, "engine.owner_unmask_from"),
        ({"owner_unmask_from": -1}, "engine.owner_unmask_from"),
        ({"mask_helper": "gpu"}, "engine.mask_helper"),
        ({"prepared_masks_mb": -1}, "engine.prepared_masks_mb"),
        ({"prepared_masks_mb": 1.5}, "engine.prepared_masks_mb"),
        ({"ring_first": "yes"}, "engine.ring_first"),
        ({"clip": -1.0}, "engine.clip"),
        ({"delta": 1.5}, "engine.delta"),
        ({"bogus": 1}, "engine.bogus"),
    ],
)
def test_engine_config_errors_name_the_field(values: dict[str, Any], field: str) -> None:
    with pytest.raises(EngineError) as info:
        EngineConfig.from_mapping(values)
    assert info.value.field == field


def test_training_config_errors_name_the_field() -> None:
    with pytest.raises(EngineError) as info:
        TrainingConfig.from_mapping({"local_steps": None, "time_budget_s": None})
    assert info.value.field == "training.local_steps"
    with pytest.raises(EngineError, match=r"training\.nope"):
        TrainingConfig.from_mapping({"nope": 1})


class StatsTrainer(FixedTrainer):
    """A trainer that asks for the federation's sum of a statistics vector first, and
    starts from a round-0 model of its own."""

    def __init__(self, value: float, stats: np.ndarray) -> None:
        super().__init__(value)
        self.local = stats
        self.seen: np.ndarray | None = None

    def initial_model(self) -> dict[str, np.ndarray]:
        return {k: v + 1.0 for k, v in MODEL.items()}

    def statistics(self) -> np.ndarray:
        return self.local

    def use_statistics(self, total: np.ndarray) -> None:
        self.seen = total


def test_statistics_are_summed_securely_once_before_round_one_and_kept(tmp_path: Path) -> None:
    stats = {o: np.array([10.0 * (i + 1), 1.5, 1e9]) for i, o in enumerate(ORGS)}

    async def scenario() -> dict[str, RunEngine]:
        fed = Federation()
        await fed.start()
        trainers = {o: StatsTrainer(0.1, stats[o]) for o in ORGS}
        engines = {
            o: RunEngine(
                plan(rounds=1), fast(), rounds=fed.rounds[o], trainer=t, state_dir=tmp_path / o
            )
            for o, t in trainers.items()
        }
        try:
            await asyncio.gather(*(e.run() for e in engines.values()))
        finally:
            await fed.close()
        return engines

    engines = asyncio.run(scenario())
    total = np.sum(list(stats.values()), axis=0)
    for engine in engines.values():
        trainer = engine.trainer
        assert isinstance(trainer, StatsTrainer) and trainer.seen is not None
        np.testing.assert_allclose(trainer.seen, total, rtol=1e-9)
        assert engine.state.statistics is not None
        np.testing.assert_allclose(engine.state.statistics, total, rtol=1e-9)
        # the round-0 model came from the trainer, not from anywhere in the node
        assert float(engine.state.model["w"].min()) > 0.9
    # a restart resumes with the kept sum and asks for no second statistics round
    again = RunEngine(
        plan(rounds=1),
        fast(),
        rounds=Federation().rounds["org-a"],
        trainer=StatsTrainer(0.1, np.array([99.0, 0.0, 0.0])),
        state_dir=tmp_path / "org-a",
    )
    assert again.resume()
    asyncio.run(again.prepare())
    assert isinstance(again.trainer, StatsTrainer) and again.trainer.seen is not None
    np.testing.assert_allclose(again.trainer.seen, total, rtol=1e-9)


def test_a_dp_run_refuses_statistics_released_without_noise(tmp_path: Path) -> None:
    fed = Federation()
    engine = RunEngine(
        plan(rounds=1, epsilon=8.0, dp=DP_CONFIG),
        DP_CONFIG,
        rounds=fed.rounds["org-a"],
        trainer=StatsTrainer(0.1, np.array([1.0, 2.0])),
        state_dir=tmp_path,
    )
    with pytest.raises(EngineError, match=r"without DP noise"):
        asyncio.run(engine.prepare())


def test_a_statistic_beyond_the_secure_sums_range_is_refused(tmp_path: Path) -> None:
    fed = Federation()
    engine = RunEngine(
        plan(rounds=1),
        fast(),
        rounds=fed.rounds["org-a"],
        trainer=StatsTrainer(0.1, np.array([1.0, 2.0**41])),
        state_dir=tmp_path,
    )
    with pytest.raises(UpdateRejected, match=r"exceeds"):
        asyncio.run(engine.prepare())


def test_an_engine_without_a_model_and_a_trainer_that_builds_none_is_refused(
    tmp_path: Path,
) -> None:
    engine = RunEngine(
        plan(rounds=1),
        fast(),
        rounds=Federation().rounds["org-a"],
        trainer=FixedTrainer(0.1),
        state_dir=tmp_path,
    )
    with pytest.raises(EngineError, match=r"no initial model"):
        asyncio.run(engine.prepare())


def test_statistics_beyond_the_ckks_range_are_refused_with_the_way_out(tmp_path: Path) -> None:
    fed = Federation()
    ckks = CkksAggregator(
        fed.endpoints["org-a"], model_hashes=fed.rounds["org-a"].model_hashes, timeout=5
    )
    engine = RunEngine(
        plan(rounds=1, backend="ckks"),
        fast(),
        rounds=fed.rounds["org-a"],
        trainer=StatsTrainer(0.1, np.array([1.0, 1e8])),
        state_dir=tmp_path,
        ckks=ckks,
    )
    with pytest.raises(UpdateRejected, match=r"CKKS sum's range.*masked backend"):
        asyncio.run(engine.prepare())


def test_finding_3_a_dp_run_clips_before_the_range_check(tmp_path: Path) -> None:
    """Issue 21, finding 3: at noise multiplier 200 an update far beyond ``engine.clip``
    is clipped to the L2 bound that DP applies anyway, and the run completes, instead of
    failing the range check that ran before the clip."""

    config = fast(weighting="uniform", l2_clip=1.0, noise_multiplier=200.0)

    async def scenario() -> list[Any]:
        fed = Federation()
        await fed.start()
        trainers = {o: FixedTrainer(5.0e6) for o in ORGS}
        engines = make_engines(
            fed,
            tmp_path,
            trainers,
            plan(rounds=2, epsilon=10.0, dp=config),
            config,
        )
        try:
            return list(await asyncio.gather(*(e.run() for e in engines.values())))
        finally:
            await fed.close()

    outcomes = asyncio.run(scenario())
    assert {o.status for o in outcomes} == {"completed"}
    assert {o.rounds_done for o in outcomes} == {2}
    assert len({o.model_hash for o in outcomes}) == 1
