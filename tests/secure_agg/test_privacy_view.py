"""A peer's view does not depend on another org's input, only on the sum.

Bonawitz et al. CCS'17 §6 (honest-but-curious security): the view of any set of
fewer than t parties can be simulated from the sum of the survivors' inputs alone.
Here an observer org runs the round twice per seed, once with each of two input
pairs that have the same sum, and we check that

* every protocol message it receives is byte-identical in both runs (keys, shares and
  ciphertexts never depend on inputs), and the final sums are equal;
* the target's masked vector, even after the observer strips everything it knows
  (its own pairwise mask with the target and, after unmasking, the target's self mask),
  is uniform on the ring and distributed identically under both inputs.
"""

from __future__ import annotations

import hashlib
import hmac

import numpy as np
import pytest
from scipy import stats

from secure_agg import prg
from secure_agg.keys import RoundContext, agree, pairwise_mask_seed
from secure_agg.protocol import ProtocolConfig, RoundResult, SignFn, Stage, VerifyFn, simulate_round

PARTS = ("obs", "target", "u", "v")
LENGTH = 32
SEEDS = range(100)
TARGET, PARTNER, OBSERVER = "target", "u", "obs"


def identities() -> tuple[dict[str, SignFn], VerifyFn]:
    keys = {p: hashlib.sha256(p.encode()).digest() for p in PARTS}

    def verify(sender: str, data: bytes, sig: bytes) -> bool:
        return hmac.compare_digest(hmac.new(keys[sender], data, hashlib.sha256).digest(), sig)

    def signer(key: bytes) -> SignFn:
        return lambda data: hmac.new(key, data, hashlib.sha256).digest()

    return {p: signer(keys[p]) for p in PARTS}, verify


def inputs_with_sum(target_value: int) -> dict[str, np.ndarray]:
    """target gets ``target_value`` everywhere; u compensates, so the total is fixed."""
    base = np.arange(LENGTH, dtype=np.uint32)
    x_t = np.full(LENGTH, target_value, dtype=np.uint32)
    fixed_pair_sum = np.full(LENGTH, 1000, dtype=np.uint32)
    return {
        "obs": base * 3,
        "target": x_t,
        "u": fixed_pair_sum - x_t,
        "v": base + 7,
    }


def observer_strips(result: RoundResult) -> np.ndarray:
    """What the observer can remove from y_target with everything it knows after the round."""
    cfg = result.peers[OBSERVER].config
    obs = result.peers[OBSERVER]._own()
    target_adv = result.peers[TARGET]._own()
    z = result.masked[TARGET].copy()
    # the target's self-mask seed is reconstructed by every finisher at the end of the round
    prg.add_mask(z, target_adv.b, -1)
    seed = pairwise_mask_seed(agree(obs.s.private, target_adv.s.public), cfg.ctx, OBSERVER, TARGET)
    prg.add_mask(z, seed, -cfg.mask_sign(TARGET, OBSERVER))
    return z


def run(target_value: int, seed: int, drop: dict[str, Stage] | None = None) -> RoundResult:
    cfg = ProtocolConfig(RoundContext("fed", "privacy", seed), PARTS, 3, LENGTH)
    return simulate_round(
        cfg, inputs_with_sum(target_value), drop, seed=seed, identities=identities()
    )


@pytest.fixture(scope="module")
def runs() -> dict[int, list[RoundResult]]:
    return {value: [run(value, s) for s in SEEDS] for value in (5, 2**31 + 12345)}


def test_messages_and_sum_do_not_depend_on_the_target_input(
    runs: dict[int, list[RoundResult]],
) -> None:
    a, b = runs.values()
    for ra, rb in zip(a, b, strict=True):
        assert ra.views[OBSERVER] == rb.views[OBSERVER]
        assert np.array_equal(ra.sums[OBSERVER], rb.sums[OBSERVER])
        # ...while the target's masked vector does differ between the two inputs
        assert not np.array_equal(ra.masked[TARGET], rb.masked[TARGET])


def test_dropout_views_do_not_depend_on_the_target_input() -> None:
    drop = {"v": Stage.MASKED_INPUT}  # v's mask key is reconstructed and seen by everyone
    for seed in range(10):
        ra, rb = run(5, seed, drop), run(2**31 + 12345, seed, drop)
        assert ra.views[OBSERVER] == rb.views[OBSERVER]
        assert np.array_equal(ra.sums[OBSERVER], rb.sums[OBSERVER])


def _low_bytes(results: list[RoundResult]) -> np.ndarray:
    return np.concatenate([observer_strips(r) & 0xFF for r in results])


def test_stripped_masked_vector_is_uniform(runs: dict[int, list[RoundResult]]) -> None:
    for results in runs.values():
        low = _low_bytes(results)
        counts = np.bincount(low.astype(np.int64), minlength=256)
        assert stats.chisquare(counts).pvalue > 1e-4
        high = np.concatenate([observer_strips(r) for r in results]).astype(np.float64) / 2**32
        assert stats.kstest(high, "uniform").pvalue > 1e-4


def test_stripped_masked_vector_has_the_same_distribution_under_both_inputs(
    runs: dict[int, list[RoundResult]],
) -> None:
    a, b = (np.bincount(_low_bytes(r).astype(np.int64), minlength=256) for r in runs.values())
    assert stats.chi2_contingency(np.vstack([a, b])).pvalue > 1e-4


def test_the_statistics_have_power(runs: dict[int, list[RoundResult]]) -> None:
    """Control: without the pairwise masks of u and v the target's input shows through."""
    for value, results in runs.items():
        leaked = []
        for r in results:
            z = observer_strips(r)
            cfg = r.peers[OBSERVER].config
            target = r.peers[TARGET]._own()
            for other in ("u", "v"):
                s = pairwise_mask_seed(
                    agree(target.s.private, r.peers[other]._own().s.public), cfg.ctx, TARGET, other
                )
                prg.add_mask(z, s, -cfg.mask_sign(TARGET, other))
            assert np.all(z == np.uint32(value))  # the input itself
            leaked.append(z & 0xFF)
        counts = np.bincount(np.concatenate(leaked).astype(np.int64), minlength=256)
        assert stats.chisquare(counts).pvalue < 1e-12
