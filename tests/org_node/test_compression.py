"""Compressed secure updates: the spec field, the random-k support, error feedback, and
runs of three real round engines with q8 and random-k (model hashes agree)."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from coordinator_free.sealed import pack_parts, unpack_parts
from hypothesis import given, settings
from hypothesis import strategies as st

import org_node.compressor as compressor_module
from org_node.compression import Q8_MAX_PARTICIPANTS, Compression, CompressionError
from org_node.compressor import Compressor, run_seed, support, window
from org_node.dp_spec import DpMechanism
from org_node.engine import EngineError, RunEngine, RunFailed, RunPlan, run_key
from org_node.policy import PolicyError, RunSpec
from org_node.run_state import EngineState
from org_node.training.exchange import LocalResult
from secure_agg.codec import FixedPointCodec
from secure_agg.prg import expand
from secure_agg.q8 import MAX_LIMB_SUMMANDS, MAX_SUMMANDS, ring_bits_for
from tests.org_node.test_engine import ORGS, Federation, fast, make_engines

SPEC: dict[str, Any] = {"trainer": "digits", "rounds": 3, "participants": list(ORGS)}
SIZES = [40, 7, 3]
BIG = {"w": np.zeros((40, 50), dtype=np.float32), "b": np.zeros(50, dtype=np.float32)}


# --------------------------------------------------------------------------- the spec


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("none", "none"),
        ("q8", "q8"),
        ("random-k=0.1", "random-k=0.1"),
        ("random-k=0.1,q8", "random-k=0.1,q8"),
        ("q8, random-k=0.25", "random-k=0.25,q8"),
        ("carry,q8,random-k=0.1", "random-k=0.1,q8"),  # carry: what every run does
        ("q8,carry", "q8"),
    ],
)
def test_a_compression_is_stored_in_its_canonical_form(text: str, canonical: str) -> None:
    spec = RunSpec.from_dict(SPEC | {"compression": text})
    assert spec.compression == canonical
    assert spec.to_dict()["compression"] == canonical


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("q4", "'q4' is not random-k=F or q8"),
        ("carry", "carry keeps a residual that only random-k or q8"),
        ("q8,carry,carry", "'carry' comes more than once"),
        ("random-k=0", "strictly between 0 and 1"),
        ("random-k=1", "strictly between 0 and 1"),
        ("random-k=abc", "not a number"),
        ("random-k=nan", "strictly between"),
        ("q8,q8", "'q8' comes more than once"),
        ("random-k=0.1,random-k=0.2", "'random-k=0.2' comes more than once"),
        ("", "must be a string"),
        (3, "must be a string"),
    ],
)
def test_a_bad_compression_is_refused_with_a_clear_error(text: object, words: str) -> None:
    with pytest.raises(PolicyError, match=words):
        RunSpec.from_dict(SPEC | {"compression": text})


def test_compression_is_refused_with_ckks_or_an_epsilon_or_too_many_for_q8() -> None:
    with pytest.raises(PolicyError, match="masked backend"):
        RunSpec.from_dict(SPEC | {"compression": "q8", "backend": "ckks"})
    with pytest.raises(PolicyError, match="epsilon"):
        RunSpec.from_dict(SPEC | {"compression": "random-k=0.1", "epsilon": 1.0})
    many = [f"org{i}" for i in range(Q8_MAX_PARTICIPANTS + 1)]
    with pytest.raises(PolicyError, match="16-bit ring"):
        RunSpec.from_dict(SPEC | {"participants": many, "compression": "q8"})
    # random-k alone sums in the dense ring: any number of participants
    assert RunSpec.from_dict(SPEC | {"participants": many, "compression": "random-k=0.5"})
    # none goes with everything
    assert RunSpec.from_dict(SPEC | {"backend": "ckks", "epsilon": 1.0, "compression": "none"})


def test_q8_participant_limit_is_what_the_16_bit_ring_holds() -> None:
    assert min(MAX_SUMMANDS, MAX_LIMB_SUMMANDS) == Q8_MAX_PARTICIPANTS


def test_only_a_compression_other_than_none_enters_the_run_key() -> None:
    key = run_key("r", SPEC)
    assert run_key("r", SPEC | {"compression": "none"}) == key
    assert run_key("r", RunSpec.from_dict(SPEC).to_dict()) == key
    q8 = run_key("r", SPEC | {"compression": "q8"})
    assert q8 != key
    assert run_key("r", SPEC | {"compression": "random-k=0.1,q8"}) not in (key, q8)


def test_the_engine_refuses_a_plan_whose_compression_it_cannot_run(tmp_path: Path) -> None:
    fed = Federation()
    config = fast(weighting="uniform")
    dp = DpMechanism.of_engine(config).to_dict()  # DP agreed: compression alone refuses
    plan = RunPlan.from_spec("r", SPEC | {"compression": "q8", "epsilon": 1.0, "dp": dp})
    with pytest.raises(EngineError, match="compression"):
        RunEngine(
            plan,
            config,
            rounds=fed.rounds["org-a"],
            trainer=object(),  # type: ignore[arg-type]
            state_dir=tmp_path,
        )


# --------------------------------------------------------------------------- the support


def test_the_support_is_a_pure_function_of_the_run_seed_and_the_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seed = run_seed("run")
    assert seed == run_seed("run") and len(seed) == 32
    first = support(seed, 3, 10_000, 0.1)
    np.testing.assert_array_equal(first, support(seed, 3, 10_000, 0.1))
    # the phases are one AES-CTR expansion of the seed; round 3 takes its window of them
    phases = expand(seed, 10_000, 64)
    start = np.uint64(3 * window(0.1) % 2**64)
    np.testing.assert_array_equal(first, np.flatnonzero(phases - start < np.uint64(window(0.1))))
    assert (np.diff(first) > 0).all() and 850 < first.size < 1150  # about F of them
    monkeypatch.setattr(compressor_module, "_SUPPORT_CHUNK", 999)  # drawn a chunk at a time
    np.testing.assert_array_equal(support(seed, 3, 10_000, 0.1), first)


def test_the_support_differs_across_rounds_and_runs() -> None:
    base = support(run_seed("run"), 3, 10_000, 0.1)
    for other in (
        support(run_seed("run"), 4, 10_000, 0.1),
        support(run_seed("other"), 3, 10_000, 0.1),
    ):
        assert not np.array_equal(other, base)


@given(
    fraction=st.floats(0.04, 0.9),
    first=st.integers(0, 2**40),
    run=st.text(max_size=8),
)
@settings(max_examples=40, deadline=None)
def test_every_coordinate_is_sent_once_a_lap(fraction: float, first: int, run: str) -> None:
    """Sampling without replacement: from any round on, each coordinate is sent within
    the first lap (2^64 / W rounds, about 1 / F) and then once a lap, the gaps between
    its sends the lap's floor or ceiling, never two sends in one round's support."""
    lap = 2**64 / window(fraction)
    rounds = range(first, first + 3 * math.ceil(lap))
    total = 300
    sends: list[list[int]] = [[] for _ in range(total)]
    for r in rounds:
        for i in support(run_seed(run), r, total, fraction):
            sends[i].append(r)
    for times in sends:
        assert times and times[0] - first < math.ceil(lap)
        assert {b - a for a, b in itertools.pairwise(times)} <= {math.floor(lap), math.ceil(lap)}


def test_a_lap_of_a_quarter_partitions_the_coordinates() -> None:
    seed = run_seed("run")
    lap = [support(seed, r, 5_000, 0.25) for r in range(8, 12)]  # W = 2^62 exactly
    together = np.concatenate(lap)
    np.testing.assert_array_equal(np.sort(together), np.arange(5_000))
    np.testing.assert_array_equal(support(seed, 12, 5_000, 0.25), lap[0])


# --------------------------------------------------------------------------- error feedback


def _model() -> dict[str, np.ndarray]:
    return {f"t{i}": np.zeros(s, dtype=np.float32) for i, s in enumerate(SIZES)}


@pytest.mark.parametrize("text", ["random-k=0.2", "q8", "random-k=0.2,q8"])
def test_error_feedback_keeps_what_was_not_sent(text: str) -> None:
    """Over rounds: the sum of what one org's vectors carried plus its residual equals
    the sum of its packed updates (its own decoding, one summand)."""
    codec = FixedPointCodec(bits=32, clip=100.0, max_summands=1)
    comp = Compressor(Compression.parse(text), participants=1, codec=codec)
    rng = np.random.default_rng(0)
    meant = np.zeros(sum(SIZES))
    carried = np.zeros(sum(SIZES))
    for r in range(4):
        comp.start_round("run", r, _model())
        body = rng.normal(size=sum(SIZES)) * 0.1
        packed = np.concatenate([body, [1.0]])
        total = comp.decode(comp.encode(packed, rng))  # one org: the sum is its own vector
        assert total[-1] == pytest.approx(1.0, abs=1e-6)  # the weight travels exactly
        comp.commit(1)
        meant += body
        carried += total[:-1]
        assert comp.residual is not None
        np.testing.assert_allclose(carried + comp.residual, meant, atol=1e-9)
        assert (comp.ranges is not None) == ("q8" in text)
    assert comp.residual is not None and np.abs(comp.residual).max() > 0  # some left to send


def test_q8_ranges_are_the_survivors_mean_of_their_maxima() -> None:
    codec = FixedPointCodec(bits=32, clip=100.0, max_summands=2)
    comps = [Compressor(Compression(q8=True), participants=2, codec=codec) for _ in range(2)]
    rng = np.random.default_rng(1)
    bodies = [np.full(sum(SIZES), 0.5), np.full(sum(SIZES), -1.5)]
    vectors = []
    for comp, body in zip(comps, bodies, strict=True):
        comp.start_round("run", 0, _model())
        vectors.append(comp.encode(np.concatenate([body, [1.0]]), rng))
    total = vectors[0] + vectors[1]  # the 32-bit calibration round: a ring sum
    for comp in comps:
        comp.decode(total)
        comp.commit(2)
        assert comp.ranges is not None
        np.testing.assert_allclose(comp.ranges, np.ones(3), rtol=1e-6)  # (0.5 + 1.5) / 2
        comp.start_round("run", 1, _model())
    vec = comps[0].encode(np.concatenate([bodies[0], [1.0]]), rng)
    assert vec.dtype == np.uint16  # round 1 sends 8-bit levels in the 16-bit ring


def test_a_tensor_random_k_sent_nothing_of_keeps_its_q8_range() -> None:
    codec = FixedPointCodec(bits=32, clip=100.0, max_summands=1)
    comp = Compressor(Compression(0.1, q8=True), participants=1, codec=codec)
    comp.ranges = np.array([7.0, 7.0, 7.0])
    rng = np.random.default_rng(2)
    kept = False
    for r in range(40):
        comp.start_round("run", r, _model())
        plan = comp._plan()
        sent = np.bincount(plan.tensor_of, minlength=3) > 0
        before = comp.ranges.copy()
        body = np.full(sum(SIZES), 0.5)
        target = body if comp.residual is None else body + comp.residual
        comp.decode(comp.encode(np.concatenate([body, [1.0]]), rng))
        comp.commit(1)
        # a tensor sent this round: the largest |value| sent in it (one survivor); a
        # tensor sent nothing of: the range it had (not the floor of a sum of no maxima)
        assert plan.index is not None
        for t in np.flatnonzero(sent):
            mine = np.abs(target[plan.index[plan.tensor_of == t]]).max()
            assert comp.ranges[t] == pytest.approx(mine, rel=1e-9)
        np.testing.assert_array_equal(comp.ranges[~sent], before[~sent])
        kept = kept or not sent.all()
    assert kept  # the 7- and 3-value tensors go without coordinates in some rounds


def test_a_local_job_starts_from_the_model_plus_the_residual_in_model_units() -> None:
    codec = FixedPointCodec(bits=32, clip=100.0, max_summands=1)
    comp = Compressor(Compression(0.5), participants=1, codec=codec)
    model = {"z": np.ones(3, np.float32), "a": np.zeros((2, 2), np.float32)}
    assert comp.local_start(model).keys() == model.keys()  # nothing left to send yet
    comp.residual, comp.scale = np.arange(7.0), 4.0  # sorted names: a (4 values), then z
    start = comp.local_start(model)
    assert list(start) == ["z", "a"]  # the model's own order
    np.testing.assert_array_equal(start["a"], np.arange(4.0).reshape(2, 2) / 4)
    np.testing.assert_array_equal(start["z"], 1 + np.arange(4.0, 7.0) / 4)
    assert {v.dtype for v in start.values()} == {np.dtype(np.float32)}
    np.testing.assert_array_equal(model["z"], np.ones(3))  # the agreed model is untouched
    comp.scale = 0.0  # an org of weight 0 sent nothing of its own
    np.testing.assert_array_equal(comp.local_start(model)["a"], model["a"])
    comp.residual, comp.scale = np.arange(6.0), 1.0
    with pytest.raises(CompressionError, match="does not fit"):
        comp.local_start(model)


def test_the_compressor_state_round_trips_and_refuses_another_compression() -> None:
    codec = FixedPointCodec(bits=32, clip=100.0, max_summands=3)
    comp = Compressor(Compression(0.5, True), participants=3, codec=codec)
    comp.residual = np.arange(5.0)
    comp.ranges = np.array([0.25, 2.0])
    comp.scale = 12.5
    again = Compressor(Compression(0.5, True), participants=3, codec=codec)
    again.load(comp.to_bytes())
    parts = unpack_parts(comp.to_bytes())
    np.testing.assert_array_equal(again.residual, comp.residual)
    np.testing.assert_array_equal(again.ranges, comp.ranges)
    assert again.scale == 12.5
    other = Compressor(Compression(q8=True), participants=3, codec=codec)
    with pytest.raises(CompressionError, match=r"random-k=0\.5,q8"):
        other.load(comp.to_bytes())
    # a state saved under the spelling with carry (before it became the default) loads
    older = pack_parts({"meta": b"random-k=0.5,q8,carry", "residual": parts["residual"]})
    again.load(older)
    np.testing.assert_array_equal(again.residual, comp.residual)
    assert again.scale == 1.0  # no scale saved: 1
    with pytest.raises(CompressionError, match="unreadable"):
        other.load(b"junk")


# --------------------------------------------------------------------------- runs


class NoisyTrainer:
    """A reproducible random update per round (so that compression has work to do)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def train(
        self, global_state: Mapping[str, np.ndarray], round: int, options: Mapping[str, Any]
    ) -> LocalResult:
        rng = np.random.default_rng([self.seed, round])
        update = {
            k: (0.01 * rng.normal(size=np.shape(v)) + 0.005).astype(np.float32)
            for k, v in global_state.items()
        }
        return LocalResult(update, 10 + self.seed, 4, {})


def _run(
    tmp_path: Path, compression: str, rounds: int = 3
) -> tuple[list[Any], dict[str, RunEngine], list[Any]]:
    plan = RunPlan.from_spec("r", SPEC | {"rounds": rounds, "compression": compression})
    reports: list[Any] = []

    async def scenario() -> list[Any]:
        fed = Federation()
        await fed.start()
        engines.update(
            {
                o: RunEngine(
                    plan,
                    fast(ring_bits=32, clip=100.0),
                    rounds=fed.rounds[o],
                    trainer=NoisyTrainer(i),
                    state_dir=tmp_path / compression / o,
                    initial_model=BIG,
                    rng=np.random.default_rng(i),
                    on_round=reports.append,
                )
                for i, o in enumerate(ORGS)
            }
        )
        try:
            return list(await asyncio.gather(*(e.run() for e in engines.values())))
        finally:
            await fed.close()

    engines: dict[str, RunEngine] = {}
    return asyncio.run(scenario()), engines, reports


OPTIMUM = {"w": np.full((40, 50), 0.5, np.float32), "b": np.full(50, -0.25, np.float32)}


class FixedPointTrainer:
    """A local job that reaches the same point ``OPTIMUM`` from wherever it starts (a
    long local loop on a shared optimum), recording where it started."""

    def __init__(self, examples: int) -> None:
        self.examples = examples
        self.starts: list[dict[str, np.ndarray]] = []

    def train(
        self, global_state: Mapping[str, np.ndarray], round: int, options: Mapping[str, Any]
    ) -> LocalResult:
        self.starts.append({k: np.array(v) for k, v in global_state.items()})
        update = {k: OPTIMUM[k] - np.asarray(v) for k, v in global_state.items()}
        return LocalResult(update, self.examples, 4, {})


def test_each_local_job_starts_from_the_model_plus_its_residual(tmp_path: Path) -> None:
    """With random-k the coordinates an org did not send stay in its residual, and its
    next local job starts from the agreed model plus that residual (÷ its w / tau), so
    an update adds only what is new: the model reaches the shared optimum and never
    passes it. (Started from the agreed model alone, a left-out coordinate would carry
    the same step again for every round it waited, and the model would overshoot.)"""
    compression = "random-k=0.3"
    plan = RunPlan.from_spec("r", SPEC | {"rounds": 6, "compression": compression})
    trainers = {o: FixedPointTrainer(i + 1) for i, o in enumerate(ORGS)}
    models: list[dict[str, np.ndarray]] = []
    residuals: dict[str, list[tuple[np.ndarray, float]]] = {o: [] for o in ORGS}

    async def scenario() -> None:
        fed = Federation()
        await fed.start()

        def on_round(report: Any, org: str) -> None:
            comp = engines[org].compressor
            assert comp is not None and comp.residual is not None
            residuals[org].append((comp.residual.copy(), comp.scale))
            if org == ORGS[0]:
                models.append(dict(engines[org].state.model))

        engines = {
            o: RunEngine(
                plan,
                fast(ring_bits=32, clip=100.0),
                rounds=fed.rounds[o],
                trainer=trainers[o],
                state_dir=tmp_path / o,
                initial_model=BIG,
                rng=np.random.default_rng(i),
                on_round=lambda report, o=o: on_round(report, o),  # type: ignore[misc]
            )
            for i, o in enumerate(ORGS)
        }
        try:
            outcomes = await asyncio.gather(*(e.run() for e in engines.values()))
        finally:
            await fed.close()
        assert len({o.model_hash for o in outcomes}) == 1

    asyncio.run(scenario())
    for org, trainer in trainers.items():
        for r in range(1, 6):  # round r's job started from M[r] (+ residual / (w / tau))
            left, scale = residuals[org][r - 1]
            assert scale == trainer.examples / 4  # FedNova's w / tau (4 steps)
            flat = np.concatenate([models[r - 1][k].ravel() for k in ("b", "w")])
            start = np.concatenate([trainer.starts[r][k].ravel() for k in ("b", "w")])
            np.testing.assert_allclose(start, flat + left / scale, atol=1e-6)
    passed = 0.0
    for k, target in OPTIMUM.items():
        for model in models:  # how far any coordinate went past its target
            passed = max(passed, float(np.max(model[k] * np.sign(target) - np.abs(target))))
    assert passed < 1e-4
    final = models[-1]
    sent = np.concatenate([np.abs(final[k] - t).ravel() < 1e-4 for k, t in OPTIMUM.items()])
    # 6 rounds of 30 %, without replacement: a lap of 3.3 rounds, every coordinate sent
    # (its optimum reached) by round 4; rounds 5 and 6 send it once more
    assert sent.all()


@pytest.mark.parametrize("compression", ["q8", "random-k=0.5,q8", "random-k=0.5"])
def test_compressed_runs_end_with_the_same_model_at_every_node(
    tmp_path: Path, compression: str
) -> None:
    outcomes, engines, reports = _run(tmp_path, compression)
    assert {o.status for o in outcomes} == {"completed"}
    assert len({o.model_hash for o in outcomes}) == 1  # compression identical everywhere
    dense, _, dense_reports = _run(tmp_path, "none")
    # the compressed model follows the dense one (same updates): q8 closely, random-k
    # a round or two behind on the coordinates it has not sent yet (error feedback)
    a = engines["org-a"].state.model
    b = dict(_final(tmp_path / "none"))
    gap = max(float(np.max(np.abs(a[k] - b[k]))) for k in a)
    assert 0 < gap < (0.002 if compression == "q8" else 0.05)
    # the last round's vectors are smaller than the dense ones (32-bit ring): q8's
    # levels travel packed in the narrow ring that len(ORGS) summands need (10 bits)
    last = sum(r.metrics["ring_bytes_sent"] for r in reports if r.round == 3)
    dense_last = sum(r.metrics["ring_bytes_sent"] for r in dense_reports if r.round == 3)
    q8 = ring_bits_for(len(ORGS)) / 32
    expected = {"q8": q8, "random-k=0.5,q8": q8 / 2, "random-k=0.5": 0.5}[compression]
    # (frame headers and the exact weight limbs weigh more in the smaller vectors)
    assert last / dense_last == pytest.approx(expected, rel=0.08)
    del dense


def _final(state_dir: Path) -> list[tuple[str, np.ndarray]]:
    state = EngineState.from_bytes((state_dir / "org-a" / "engine-state.bin").read_bytes())
    return sorted(state.model.items())


def test_the_residual_and_ranges_are_persisted_and_restored(tmp_path: Path) -> None:
    outcomes, engines, _ = _run(tmp_path, "random-k=0.5,q8", rounds=2)
    assert {o.status for o in outcomes} == {"completed"}
    before = engines["org-b"].compressor
    assert before is not None and before.residual is not None and before.ranges is not None
    fed = Federation()
    again = RunEngine(
        engines["org-b"].plan,
        engines["org-b"].config,
        rounds=fed.rounds["org-b"],
        trainer=NoisyTrainer(1),
        state_dir=engines["org-b"].state_dir,
    )
    assert again.resume()
    assert again.compressor is not None
    np.testing.assert_array_equal(again.compressor.residual, before.residual)
    np.testing.assert_array_equal(again.compressor.ranges, before.ranges)
    # each org keeps its own residual: they differ between orgs
    other = engines["org-a"].compressor
    assert other is not None and other.residual is not None
    assert not np.array_equal(other.residual, before.residual)


def test_a_q8_run_cannot_catch_a_node_up_by_the_model(tmp_path: Path) -> None:
    fed = Federation()
    plan = RunPlan.from_spec("r", SPEC | {"compression": "q8"})

    async def ahead(run: str, round: int) -> tuple[int, dict[str, np.ndarray]] | None:
        return 2, {"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32)}

    engines = make_engines(
        fed, tmp_path, {o: NoisyTrainer(0) for o in ORGS}, plan, fast(), catch_up=ahead
    )
    with pytest.raises(RunFailed, match="q8"):
        asyncio.run(engines["org-a"].try_catch_up())


@pytest.mark.parametrize("text", ["q8", "random-k=0.3,q8", "random-k=0.3"])
def test_the_ring_sum_decodes_to_the_sum_of_each_orgs_contribution(text: str) -> None:
    """What the harness's plaintext check relies on: every org's own decoding of its
    vector, summed, is what the secure sum decodes to (q8: from its second round)."""
    codec = FixedPointCodec(bits=32, clip=100.0, max_summands=3)
    comps = [Compressor(Compression.parse(text), participants=3, codec=codec) for _ in range(3)]
    rng = np.random.default_rng(2)
    for r in range(2):
        vectors, mine = [], []
        for comp in comps:
            comp.start_round("run", r, _model())
            packed = np.concatenate([rng.normal(size=sum(SIZES)) * 0.2, [3.0, 1.0]])
            vectors.append(comp.encode(packed, rng))
            mine.append(comp.contribution())
        total = vectors[0] + vectors[1] + vectors[2]  # the ring sum (wraps like the ring)
        for comp in comps:
            np.testing.assert_allclose(comp.decode(total), np.sum(mine, axis=0), atol=1e-6)
            comp.commit(3)
        assert total.dtype == (np.uint16 if r == 1 and "q8" in text else np.uint32)
