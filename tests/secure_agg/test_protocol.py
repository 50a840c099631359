"""The serverless masked-sum protocol: exact sums under dropouts, SecAgg+ graphs, config."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_agg import prg
from secure_agg.errors import ConfigError
from secure_agg.graph import NeighbourGraph, graph_seed
from secure_agg.keys import RoundContext
from secure_agg.messages import UnmaskShares, decode
from secure_agg.protocol import (
    BadVector,
    ProtocolConfig,
    RoundAborted,
    SignFn,
    Stage,
    VerifyFn,
    run_round,
    simulate_round,
)
from secure_agg.ring import ring_dtype, ring_sum

VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "secagg_protocol.json"
CTX = RoundContext("fed", "run", 3)
DROP_STAGES = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASK)


def orgs(n: int) -> tuple[str, ...]:
    return tuple(f"org-{i:02d}" for i in range(n))


def hmac_identities(parts: tuple[str, ...]) -> tuple[dict[str, SignFn], VerifyFn]:
    """Fast stand-in signatures (HMAC per org) for large rounds in tests."""
    keys = {p: hashlib.sha256(p.encode()).digest() for p in parts}

    def signer(p: str) -> SignFn:
        return lambda data: hmac.new(keys[p], data, hashlib.sha256).digest()

    def verify(sender: str, data: bytes, sig: bytes) -> bool:
        key = keys.get(sender)
        return key is not None and hmac.compare_digest(
            hmac.new(key, data, hashlib.sha256).digest(), sig
        )

    return {p: signer(p) for p in parts}, verify


def random_inputs(cfg: ProtocolConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    dtype = ring_dtype(cfg.bits)
    info = np.iinfo(dtype)
    return {
        p: rng.integers(0, int(info.max), cfg.vector_length, dtype=dtype, endpoint=True)
        for p in cfg.participants
    }


def plain_sum(
    cfg: ProtocolConfig, inputs: Mapping[str, np.ndarray], survivors: frozenset[str]
) -> np.ndarray:
    acc = np.zeros(cfg.vector_length, dtype=ring_dtype(cfg.bits))
    for p in survivors:
        acc += inputs[p]
    return acc


def expected_survivors(cfg: ProtocolConfig, drop: Mapping[str, Stage]) -> frozenset[str]:
    return frozenset(p for p in cfg.participants if p not in drop or drop[p] is Stage.UNMASK)


def random_drop(
    parts: tuple[str, ...], rng: np.random.Generator, max_drop: int
) -> dict[str, Stage]:
    count = int(rng.integers(0, max_drop + 1))
    chosen = rng.choice(len(parts), size=count, replace=False)
    return {parts[int(i)]: DROP_STAGES[int(rng.integers(0, 4))] for i in chosen}


def chunked_random_order(
    rng: np.random.Generator,
) -> Callable[[Mapping[str, np.ndarray]], np.ndarray]:
    """An aggregator that adds masked vectors chunk by chunk, in a random order per chunk."""

    def aggregate(masked: Mapping[str, np.ndarray]) -> np.ndarray:
        length = next(iter(masked.values())).shape[0]
        out = np.empty_like(next(iter(masked.values())))
        cuts = np.sort(rng.choice(np.arange(1, length), size=min(3, length - 1), replace=False))
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), length], strict=True):
            names = list(masked)
            rng.shuffle(names)
            # partial sums of two halves, added together: any grouping works
            half = len(names) // 2
            left = np.zeros(hi - lo, dtype=out.dtype)
            right = np.zeros(hi - lo, dtype=out.dtype)
            for name in names[:half]:
                left += masked[name][lo:hi]
            for name in names[half:]:
                right += masked[name][lo:hi]
            out[lo:hi] = right + left
        return out

    return aggregate


# --------------------------------------------------------------------------- sums


@pytest.mark.parametrize(
    ("n", "t", "k", "length", "max_drop", "trials"),
    [
        (3, 2, None, 17, 1, 6),
        (5, 3, None, 33, 2, 6),
        (10, 6, None, 64, 4, 4),
        (50, 5, 8, 8, 6, 2),
    ],
    ids=["n3", "n5", "n10", "n50-secagg+"],
)
def test_exact_sum_with_random_dropouts(
    n: int, t: int, k: int | None, length: int, max_drop: int, trials: int
) -> None:
    parts = orgs(n)
    identities = hmac_identities(parts)
    rng = np.random.default_rng(1000 + n)
    finished = 0
    for trial in range(trials):
        cfg = ProtocolConfig(RoundContext("fed", "run", trial), parts, t, length, 32, k)
        inputs = random_inputs(cfg, rng)
        drop = random_drop(parts, rng, max_drop)
        result = simulate_round(
            cfg,
            inputs,
            drop,
            seed=trial,
            aggregate=chunked_random_order(rng),
            identities=identities,
        )
        assert result.survivors == expected_survivors(cfg, drop)
        finishers = {p for p in parts if p not in drop}
        if not result.aborted:
            assert set(result.sums) == finishers
        for reason in result.aborted.values():
            assert "threshold is" in reason or "cannot reconstruct" in reason
        if result.sums:
            # whoever finishes holds exactly the plaintext ring sum over U3
            assert np.array_equal(result.total, plain_sum(cfg, inputs, result.survivors))
            finished += 1
    assert finished >= 1


@pytest.mark.parametrize("stage", DROP_STAGES, ids=lambda s: s.name)
@pytest.mark.parametrize("bits", [32, 64])
def test_one_dropout_per_stage(stage: Stage, bits: int) -> None:
    parts = orgs(5)
    cfg = ProtocolConfig(CTX, parts, 3, 40, bits)
    inputs = random_inputs(cfg, np.random.default_rng(7))
    drop = {"org-01": stage, "org-03": stage}
    result = simulate_round(cfg, inputs, drop, seed=5)
    assert not result.aborted
    assert result.survivors == expected_survivors(cfg, drop)
    assert np.array_equal(result.total, plain_sum(cfg, inputs, result.survivors))
    assert result.total.dtype == ring_dtype(bits)


def test_dropouts_at_every_stage_in_one_round() -> None:
    parts = orgs(10)
    cfg = ProtocolConfig(CTX, parts, 5, 100)
    inputs = random_inputs(cfg, np.random.default_rng(3))
    drop = {
        "org-00": Stage.ADVERTISE_KEYS,
        "org-02": Stage.SHARE_KEYS,
        "org-05": Stage.MASKED_INPUT,
        "org-09": Stage.UNMASK,
    }
    total = run_round(cfg, inputs, drop, seed=11)
    assert np.array_equal(total, plain_sum(cfg, inputs, expected_survivors(cfg, drop)))


@pytest.mark.parametrize("bits", [32, 64], ids=["b32", "b64"])
def test_parts_unmasked_apart_are_slices_of_the_whole_sum(bits: int) -> None:
    # a ring member unmasks only the chunks it holds: with dropouts (dangling pairwise
    # masks) and chunk bounds inside a keystream block, each part equals its slice
    parts = orgs(7)
    cfg = ProtocolConfig(CTX, parts, 4, 103, bits)
    inputs = random_inputs(cfg, np.random.default_rng(4))
    drop = {"org-02": Stage.MASKED_INPUT, "org-05": Stage.UNMASK}
    seen: list[np.ndarray] = []

    def aggregate(masked: Mapping[str, np.ndarray]) -> np.ndarray:
        total = ring_sum(masked[o] for o in sorted(masked))
        seen.append(total.copy())
        return total

    result = simulate_round(cfg, inputs, drop, seed=6, aggregate=aggregate)
    assert not result.aborted and result.sums
    (masked_total,) = seen
    expected = plain_sum(cfg, inputs, result.survivors)
    for org in result.sums:
        peer = result.peers[org]
        for lo, hi in ((0, 103), (0, 1), (5, 37), (37, 103), (101, 103), (50, 50)):
            got = peer.finalize_part(masked_total[lo:hi], lo)
            np.testing.assert_array_equal(got, expected[lo:hi])
    peer = result.peers[next(iter(result.sums))]
    with pytest.raises(BadVector, match="runs past"):
        peer.finalize_part(masked_total[:10], 100)
    with pytest.raises(BadVector, match="offset"):
        peer.finalize_part(masked_total[:10], -1)


def _releasers_per_survivor(cfg: ProtocolConfig, drop: Mapping[str, Stage]) -> dict[str, int]:
    """For each survivor j: how many of N[j] release shares (they reach UNMASK)."""
    survivors = expected_survivors(cfg, drop)
    releasing = {p for p in cfg.participants if p not in drop}
    return {j: len(cfg.graph.closed(j) & releasing) for j in survivors}


def test_secagg_plus_dropouts_per_neighbourhood() -> None:
    parts = orgs(20)
    cfg = ProtocolConfig(CTX, parts, 3, 16, 32, neighbours=4)
    inputs = random_inputs(cfg, np.random.default_rng(9))
    identities = hmac_identities(parts)
    victim = "org-07"
    first, second = sorted(cfg.graph.neighbours(victim))[:2]
    # the victim drops after sharing keys and one neighbour stays silent in UNMASK:
    # its mask key is rebuilt from the 3 = t of N[victim] that remain
    drop = {victim: Stage.MASKED_INPUT, first: Stage.UNMASK}
    assert min(_releasers_per_survivor(cfg, drop).values()) >= 3
    result = simulate_round(cfg, inputs, drop, seed=2, identities=identities)
    assert not result.aborted
    assert np.array_equal(result.total, plain_sum(cfg, inputs, result.survivors))
    # with a second neighbour gone, some survivor's neighbourhood holds fewer than t
    # releasers: the round aborts instead of producing a wrong or partial sum
    drop[second] = Stage.UNMASK
    starved = [j for j, c in _releasers_per_survivor(cfg, drop).items() if c < 3]
    assert starved
    result = simulate_round(cfg, inputs, drop, seed=2, identities=identities)
    assert result.sums == {}
    assert all("cannot reconstruct" in r for r in result.aborted.values())


def test_no_dropout_large_vector_is_exact() -> None:
    parts = orgs(4)
    cfg = ProtocolConfig(CTX, parts, 3, 200_000)
    inputs = random_inputs(cfg, np.random.default_rng(0))
    assert np.array_equal(run_round(cfg, inputs, seed=1), plain_sum(cfg, inputs, frozenset(parts)))


def test_masked_vectors_look_nothing_like_inputs() -> None:
    parts = orgs(3)
    cfg = ProtocolConfig(CTX, parts, 2, 256)
    inputs = {p: np.zeros(256, dtype=np.uint32) for p in parts}
    result = simulate_round(cfg, inputs, seed=4)
    for y in result.masked.values():
        assert np.count_nonzero(y) > 250
    assert np.array_equal(result.total, np.zeros(256, dtype=np.uint32))


def test_masked_input_costs_k_plus_one_expansions(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = orgs(12)
    cfg = ProtocolConfig(CTX, parts, 3, 32, neighbours=4)
    calls: list[int] = []
    real = prg.add_masks

    def counting(
        target: np.ndarray, masks: Sequence[tuple[bytes, int]], base: np.ndarray | None = None
    ) -> None:
        calls.extend(sign for _, sign in masks)
        real(target, masks, base=base)

    inputs = random_inputs(cfg, np.random.default_rng(1))
    monkeypatch.setattr(prg, "add_masks", counting)

    def aggregate(masked: Mapping[str, np.ndarray]) -> np.ndarray:
        # every peer added 1 self mask + 4 pairwise masks, nothing else
        assert len(calls) == len(parts) * (4 + 1)
        return sum(masked.values(), np.zeros(32, np.uint32))

    result = simulate_round(cfg, inputs, seed=0, aggregate=aggregate)
    assert np.array_equal(result.total, plain_sum(cfg, inputs, frozenset(parts)))


def test_seeded_round_is_byte_exact() -> None:
    """The whole transcript is a pure function of the seed (the seam for test vectors)."""
    parts = orgs(3)
    cfg = ProtocolConfig(RoundContext("vector-fed", "vector-run", 1), parts, 2, 8)
    inputs = {p: np.arange(8, dtype=np.uint32) * (i + 1) for i, p in enumerate(parts)}
    a = simulate_round(cfg, inputs, {"org-02": Stage.UNMASK}, seed=42)
    b = simulate_round(cfg, inputs, {"org-02": Stage.UNMASK}, seed=42)
    assert a.views == b.views
    digest = hashlib.sha256(b"".join(w for p in parts for w in a.views[p])).hexdigest()
    vector = json.loads(VECTORS.read_text())["n3_seed42_drop_org02_at_unmask"]
    assert digest == vector["transcript_sha256"]
    assert a.masked["org-00"].tolist() == vector["masked_org00"]
    assert a.total.tolist() == vector["sum"]
    other = simulate_round(cfg, inputs, {"org-02": Stage.UNMASK}, seed=43)
    assert other.views != a.views
    assert np.array_equal(other.total, a.total)


# --------------------------------------------------------------------------- unmask shares


def test_unmask_shares_never_hold_both_kinds_for_one_org() -> None:
    parts = orgs(10)
    rng = np.random.default_rng(5)
    seen_both_kinds_in_round = False
    for trial in range(6):
        cfg = ProtocolConfig(RoundContext("fed", "run", trial), parts, 5, 8)
        drop = random_drop(parts, rng, 4) | {"org-04": Stage.MASKED_INPUT}
        result = simulate_round(cfg, random_inputs(cfg, rng), drop, seed=trial)
        for view in result.views.values():
            for wire in view:
                msg = decode(wire)
                if isinstance(msg, UnmaskShares):
                    b = {o for o, _ in msg.b_shares}
                    s = {o for o, _ in msg.s_shares}
                    assert not b & s
                    assert b <= set(msg.survivors)
                    assert not s & set(msg.survivors)
                    seen_both_kinds_in_round |= bool(b) and bool(s)
    assert seen_both_kinds_in_round


# --------------------------------------------------------------------------- aborts


@pytest.mark.parametrize("stage", DROP_STAGES, ids=lambda s: s.name)
def test_below_threshold_aborts(stage: Stage) -> None:
    parts = orgs(5)
    cfg = ProtocolConfig(CTX, parts, 4, 8)
    inputs = random_inputs(cfg, np.random.default_rng(0))
    drop = {"org-00": stage, "org-01": stage}
    result = simulate_round(cfg, inputs, drop, seed=0)
    assert result.sums == {}
    assert set(result.aborted) == {"org-02", "org-03", "org-04"}
    if stage is Stage.UNMASK:
        # all 5 masked, but only 3 < t = 4 holders release shares
        assert all("cannot reconstruct" in r for r in result.aborted.values())
    else:
        assert all("threshold is 4" in r for r in result.aborted.values())
    with pytest.raises(RoundAborted, match="no participant finished"):
        run_round(cfg, inputs, drop, seed=0)


def test_dropout_during_unmask_below_threshold_of_shares_aborts() -> None:
    # 5 orgs, t=3; 3 mask, then 2 of them vanish before releasing shares: only one
    # UnmaskShares remains per finisher, fewer than t shares of every seed.
    parts = orgs(5)
    cfg = ProtocolConfig(CTX, parts, 3, 8)
    drop = {
        "org-00": Stage.MASKED_INPUT,
        "org-01": Stage.MASKED_INPUT,
        "org-02": Stage.UNMASK,
        "org-03": Stage.UNMASK,
    }
    result = simulate_round(cfg, random_inputs(cfg, np.random.default_rng(1)), drop, seed=3)
    assert result.sums == {}
    assert "cannot reconstruct" in result.aborted["org-04"]


# --------------------------------------------------------------------------- config and graph


def test_config_sorts_participants_and_indexes() -> None:
    cfg = ProtocolConfig(CTX, ("c", "a", "b"), 2, 4)
    assert cfg.participants == ("a", "b", "c")
    assert cfg.index("c") == 2 and cfg.share_x("a") == 1
    assert cfg.mask_sign("a", "c") == 1 and cfg.mask_sign("c", "a") == -1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"participants": ("a", "a", "b")}, "unique"),
        ({"participants": ("a",)}, "2 to 65535"),
        ({"participants": ("a", "")}, "non-empty"),
        ({"threshold": 1}, "threshold"),
        ({"threshold": 4}, "threshold"),
        ({"vector_length": 0}, "vector_length"),
        ({"bits": 8}, "bits"),
        ({"neighbours": 1}, "neighbours"),
        ({"neighbours": 3}, "neighbours"),
        ({"ctx": "fed/run/3"}, "ctx"),
    ],
)
def test_config_rejects(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {
        "ctx": CTX,
        "participants": ("a", "b", "c"),
        "threshold": 2,
        "vector_length": 4,
    }
    with pytest.raises(ConfigError, match=match):
        ProtocolConfig(**(base | kwargs))  # type: ignore[arg-type]


def test_config_threshold_bounded_by_neighbourhood() -> None:
    with pytest.raises(ConfigError, match="neighbours \\+ 1"):
        ProtocolConfig(CTX, orgs(10), 6, 4, neighbours=4)
    with pytest.raises(TypeError):
        ProtocolConfig(CTX, orgs(3), 2, 4, neighbour=2)  # type: ignore[call-arg]


@pytest.mark.parametrize(("n", "k"), [(10, 4), (11, 4), (12, 5), (50, 8), (7, 6), (20, 2)])
def test_graph_is_regular_symmetric_and_deterministic(n: int, k: int) -> None:
    parts = orgs(n)
    seed = graph_seed(CTX.to_bytes(), parts)
    g = NeighbourGraph(parts, k, seed)
    for p in parts:
        assert len(g.neighbours(p)) == k
        assert p not in g.neighbours(p)
        assert g.closed(p) == g.neighbours(p) | {p}
        for q in g.neighbours(p):
            assert p in g.neighbours(q)
    assert len(g.edges()) == n * k // 2
    assert NeighbourGraph(tuple(reversed(parts)), k, seed).edges() == g.edges()
    if k < n - 1:
        other = graph_seed(RoundContext("fed", "run", 4).to_bytes(), parts)
        assert NeighbourGraph(parts, k, other).edges() != g.edges()


def test_complete_graph_and_graph_errors() -> None:
    parts = orgs(5)
    seed = bytes(32)
    assert NeighbourGraph(parts, None, seed).neighbours("org-00") == frozenset(parts[1:])
    assert NeighbourGraph(parts, 4, seed).edges() == NeighbourGraph(parts, None, seed).edges()
    with pytest.raises(ConfigError, match="odd k"):
        NeighbourGraph(parts, 3, seed)
    with pytest.raises(ConfigError, match="seed"):
        NeighbourGraph(parts, 2, b"short")
    with pytest.raises(ConfigError, match="not a participant"):
        NeighbourGraph(parts, 2, seed).neighbours("stranger")


def test_driver_rejects_bad_drop_and_missing_inputs() -> None:
    cfg = ProtocolConfig(CTX, orgs(3), 2, 4)
    inputs = {p: np.zeros(4, np.uint32) for p in cfg.participants}
    with pytest.raises(ConfigError, match="drop"):
        run_round(cfg, inputs, {"org-00": Stage.DONE})
    with pytest.raises(ConfigError, match="drop"):
        run_round(cfg, inputs, {"stranger": Stage.UNMASK})
    with pytest.raises(ConfigError, match="inputs"):
        run_round(cfg, {"org-00": inputs["org-00"]})


_FAST_IDS = hmac_identities(orgs(6))


@settings(max_examples=40, deadline=None)
@given(
    drops=st.dictionaries(st.sampled_from(orgs(6)), st.sampled_from(DROP_STAGES), max_size=6),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_any_dropout_pattern_gives_the_exact_sum_or_a_clean_abort(
    drops: dict[str, Stage], seed: int
) -> None:
    parts = orgs(6)
    cfg = ProtocolConfig(CTX, parts, 4, 5)
    inputs = random_inputs(cfg, np.random.default_rng(seed))
    result = simulate_round(cfg, inputs, drops, seed=seed, identities=_FAST_IDS)
    survivors = expected_survivors(cfg, drops)
    releasers = {p for p in parts if p not in drops}  # releasers <= survivors <= sharers
    if len(releasers) >= 4:
        assert not result.aborted
        assert result.survivors == survivors
        assert np.array_equal(result.total, plain_sum(cfg, inputs, survivors))
    else:
        # whichever stage it happens at, every remaining peer aborts and nobody sums
        assert result.sums == {}
        assert releasers <= set(result.aborted)
        assert all(result.peers[p].stage is Stage.ABORTED for p in result.aborted)
        assert all(result.aborted.values())
