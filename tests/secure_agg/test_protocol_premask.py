"""Masking while the shares travel: ``premask`` then ``settle_premask`` make exactly
``masked_input``'s vector."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_agg import prg
from secure_agg.protocol import OutOfStage, SecAggPeer
from tests.secure_agg.test_protocol_u2 import _shared, orgs


def _premasked(peer: SecAggPeer, x: np.ndarray, participants: Iterable[str]) -> np.ndarray:
    """``peer``'s masked input the premask way: the masks of every neighbour in U1
    first, then U2 fixed, then the settling masks."""
    y = x.copy()
    prg.add_masks(y, peer.premask())
    assert not peer.premask_exact()  # U2 is not fixed yet
    peer.close_shares(participants)
    exact = peer.premask_exact()
    settling = peer.settle_premask()
    assert exact == (settling == [])  # exact: nothing left to add or take off
    assert not peer.premask_exact()  # settled once
    prg.add_masks(y, settling)
    return y


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(3, 7),
    lost_to=st.integers(0, 6),
    seed=st.integers(0, 2**32 - 1),
)
def test_premask_then_settle_is_masked_input_bit_for_bit(n: int, lost_to: int, seed: int) -> None:
    """Whether or not a neighbour's shares came (the last org's shares never reach one
    other org, which then leaves it out of the agreed participants)."""
    parts = orgs(n)
    lost = [(parts[-1], parts[lost_to % (n - 1)])]
    participants = parts[:-1]
    x = np.random.default_rng(seed).integers(0, 2**32, 8, dtype=np.uint32)
    by_premask, by_mask = _shared(n, lost), _shared(n, lost)  # the same keys twice
    for p in participants:
        y = _premasked(by_premask[p], x, participants)
        by_mask[p].close_shares(participants)
        np.testing.assert_array_equal(y, by_mask[p].masked_input(x))
        # what follows is the same too: a later attempt's masked input
        np.testing.assert_array_equal(by_premask[p].masked_again(x), y)


def test_premask_comes_once_in_its_stage_and_instead_of_masked_input() -> None:
    peers = _shared(4)
    parts = orgs(4)
    a = peers["org-00"]
    with pytest.raises(OutOfStage):
        a.settle_premask()  # nothing premasked, and U2 not fixed
    a.premask()
    with pytest.raises(OutOfStage):
        a.premask()
    with pytest.raises(OutOfStage):
        a.settle_premask()  # U2 is not fixed yet
    a.close_shares(parts)
    with pytest.raises(OutOfStage):
        a.masked_input(np.zeros(8, dtype=np.uint32))
    assert a.premask_exact()
    assert a.settle_premask() == []  # every neighbour shared: nothing to take off
    with pytest.raises(OutOfStage):
        a.settle_premask()
    # before the keys are shared there is nothing to premask with
    fresh = _shared(4)["org-01"]
    fresh.close_shares(parts)
    with pytest.raises(OutOfStage):
        fresh.premask()
    early = SecAggPeer(a.config, "org-02", lambda d: d, lambda s, d, g: True)
    with pytest.raises(OutOfStage):
        early.premask()
