"""``SecAggPeer.narrow``: a peer that masked with the participants it proposed, and sent
that input, takes a smaller settled set. The sum over the smaller set is exact, the
two masked inputs differ by nothing that depends on the input (only the pairwise masks
with the orgs left out), and no share of an org left out is ever released."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_agg.keys import RoundContext
from secure_agg.messages import UnmaskShares
from secure_agg.protocol import (
    InconsistentView,
    OutOfStage,
    ProtocolConfig,
    RoundAborted,
    SecAggPeer,
    Stage,
)
from secure_agg.ring import ring_sum
from tests.secure_agg.test_protocol_u2 import _advertise, _signer, _verify, orgs

CTX = RoundContext("fed", "run", 9)


def _shared(n: int, t: int, seed: int = 0) -> dict[str, SecAggPeer]:
    """``n`` peers whose keys and shares all reached each other, each closed on every
    org as the participants (what a node whose proposal holds every member settles
    before the agreement decides)."""
    parts = orgs(n)
    cfg = ProtocolConfig(CTX, parts, t, 16, 32)
    peers = {
        p: SecAggPeer(cfg, p, _signer(p), _verify, rng=np.random.default_rng([seed, i]).bytes)
        for i, p in enumerate(parts)
    }
    _advertise(peers, parts)
    for p in parts:
        for q, msg in peers[p].share_keys().items():
            peers[q].receive(msg)
    for p in parts:
        peers[p].close_shares(frozenset(parts))
    return peers


def _finish(
    peers: dict[str, SecAggPeer], kept: Sequence[str], total: np.ndarray
) -> tuple[dict[str, np.ndarray], dict[str, UnmaskShares]]:
    releases = {p: peers[p].unmask(frozenset(kept)) for p in kept}
    sums = {}
    for p in kept:
        for q, release in releases.items():
            if q != p:
                peers[p].receive(release)
        sums[p] = peers[p].finalize(total)
    return sums, releases


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(min_value=3, max_value=8),
    left_out=st.integers(min_value=1, max_value=3),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_a_narrowed_round_sums_exactly_the_settled_participants(
    n: int, left_out: int, seed: int
) -> None:
    t = max(2, n // 2)
    kept = orgs(n)[: max(t, n - left_out)]
    peers = _shared(n, t, seed)
    rng = np.random.default_rng(seed)
    inputs = {p: rng.integers(0, 2**32, 16, dtype=np.uint32) for p in orgs(n)}
    # every org masked with all of them and sent that input (a ring that never completes)
    first = {p: peers[p].masked_input(inputs[p]) for p in orgs(n)}
    for p in kept:
        assert peers[p].narrow(kept) == frozenset(kept)
    again = {p: peers[p].masked_again(inputs[p]) for p in kept}
    sums, releases = _finish(peers, kept, ring_sum(again.values()))
    plain = ring_sum(inputs[p] for p in kept)
    for org, total in sums.items():
        assert np.array_equal(total, plain), org
    # the input sent first is not the one summed when an org was left out
    if len(kept) < n:
        assert not any(np.array_equal(first[p], again[p]) for p in kept)
    # no share of an org left out is released, of either kind
    for release in releases.values():
        owners = {o for o, _ in release.b_shares} | {o for o, _ in release.s_shares}
        assert owners <= set(kept)


def test_the_two_masked_inputs_differ_by_the_left_out_masks_alone() -> None:
    # the same keys, two different inputs: the difference between the input masked
    # with every org and the one masked with the settled subset is the same, so it
    # says nothing about the input (it is the pairwise masks with the orgs left out)
    n, t = 6, 3
    kept = orgs(n)[:4]
    diffs = []
    for value in (0, 12345):
        peers = _shared(n, t, seed=7)
        x = np.full(16, value, dtype=np.uint32)
        first = peers["org-00"].masked_input(x).copy()
        peers["org-00"].narrow(kept)
        again = peers["org-00"].masked_again(x)
        diffs.append(first - again)
    assert np.array_equal(diffs[0], diffs[1])
    assert diffs[0].any()


def test_narrowing_to_the_same_set_changes_nothing() -> None:
    peers = _shared(4, 3)
    x = np.arange(16, dtype=np.uint32)
    first = peers["org-01"].masked_input(x).copy()
    peers["org-01"].narrow(orgs(4))
    assert np.array_equal(first, peers["org-01"].masked_again(x))


@pytest.mark.parametrize(
    ("participants", "why"),
    [
        (["org-00", "org-01", "org-02", "org-09"], "not a subset"),
        (["org-01", "org-02", "org-03"], "not a subset"),
    ],
)
def test_a_set_that_is_not_a_subset_with_the_peer_is_refused_and_changes_nothing(
    participants: list[str], why: str
) -> None:
    peers = _shared(5, 3)
    x = np.arange(16, dtype=np.uint32)
    first = peers["org-00"].masked_input(x).copy()
    with pytest.raises(InconsistentView, match=why):
        peers["org-00"].narrow(participants)
    assert peers["org-00"].stage is Stage.MASKED_INPUT
    assert np.array_equal(first, peers["org-00"].masked_again(x))


def test_a_set_below_the_threshold_aborts_the_round() -> None:
    peers = _shared(5, 3)
    with pytest.raises(RoundAborted, match="threshold is 3"):
        peers["org-00"].narrow(["org-00", "org-01"])
    assert peers["org-00"].stage is Stage.ABORTED


def test_narrow_needs_settled_participants() -> None:
    peers = _shared(4, 3)
    peers["org-00"].masked_input(np.arange(16, dtype=np.uint32))
    peers["org-00"].unmask(frozenset(orgs(4)))
    with pytest.raises(OutOfStage):
        peers["org-00"].narrow(orgs(3))
