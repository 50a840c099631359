"""Survivors that reveal their own self-mask seeds instead of having them reconstructed."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_agg import shamir
from secure_agg.keys import RoundContext
from secure_agg.messages import MalformedMessage
from secure_agg.protocol import (
    DoubleRelease,
    InconsistentView,
    InvalidShare,
    OutOfStage,
    ProtocolConfig,
    SecAggPeer,
)
from secure_agg.ring import ring_dtype, ring_sum
from tests.secure_agg.test_protocol import hmac_identities, orgs, random_inputs

CTX = RoundContext("fed", "run", 9)


def _masked_round(
    n: int, t: int, bits: int, seed: int, dropped: frozenset[str] = frozenset()
) -> tuple[ProtocolConfig, dict[str, SecAggPeer], dict[str, np.ndarray], np.ndarray]:
    """Every peer through MASKED_INPUT, all agreed as participants after the shares
    (as the round engine does); ``dropped`` send their shares but no masked input.
    Returns the config, the peers, the inputs and the survivors' masked sum."""
    parts = orgs(n)
    cfg = ProtocolConfig(CTX, parts, t, 37, bits)
    signers, verify = hmac_identities(parts)
    rng = np.random.default_rng(seed)
    peers = {p: SecAggPeer(cfg, p, signers[p], verify, rng=lambda k: rng.bytes(k)) for p in parts}
    adverts = {p: peer.advertise_keys() for p, peer in peers.items()}
    for p, peer in peers.items():
        for q, msg in adverts.items():
            if q != p:
                peer.receive_advertise(msg)
        peer.close_advertise()
    shares = {p: peer.share_keys() for p, peer in peers.items()}
    for out in shares.values():
        for q, share in out.items():
            peers[q].receive_shares(share)
    for peer in peers.values():
        peer.close_shares(parts)
    inputs = random_inputs(cfg, rng)
    masked = {p: peers[p].masked_input(inputs[p]) for p in parts if p not in dropped}
    return cfg, peers, inputs, ring_sum(masked[p] for p in sorted(masked))


def _plain(cfg: ProtocolConfig, inputs: dict[str, np.ndarray], who: frozenset[str]) -> np.ndarray:
    acc = np.zeros(cfg.vector_length, dtype=ring_dtype(cfg.bits))
    for p in who:
        acc += inputs[p]
    return acc


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(3, 7),
    bits=st.sampled_from([32, 64]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_revealed_seeds_and_released_shares_together_give_the_exact_sum(
    n: int, bits: int, seed: int, data: st.DataObject
) -> None:
    # any mix: the survivors that reveal their seed need no share released for it;
    # the rest are reconstructed from the b-shares of t releases, as before
    t = n // 2 + 1
    cfg, peers, inputs, total = _masked_round(n, t, bits, seed)
    u3 = frozenset(cfg.participants)
    revealing = data.draw(st.sets(st.sampled_from(sorted(u3))), label="revealing")
    releases = {p: peer.unmask(u3) for p, peer in peers.items()}
    seeds = {p: peers[p].self_seed() for p in revealing}
    finisher = peers[cfg.participants[0]]
    for owner, b in seeds.items():
        finisher.receive_seed(owner, b)
    missing = finisher.missing_shares()
    assert set(missing) == set(u3 - revealing - {finisher.me})
    if revealing >= u3 - {finisher.me}:
        assert missing == {}  # every seed revealed: no release at all is needed
    for p in sorted(u3 - {finisher.me})[: t - 1]:
        finisher.receive_unmask(releases[p])
    assert finisher.missing_shares() == {}
    np.testing.assert_array_equal(finisher.finalize(total), _plain(cfg, inputs, u3))


def test_a_seed_is_refused_unless_it_matches_the_commitment_and_state_is_unchanged() -> None:
    cfg, peers, _, _ = _masked_round(4, 3, 32, 1)
    u3 = frozenset(cfg.participants)
    for peer in peers.values():
        peer.unmask(u3)
    me, other = peers["org-00"], peers["org-01"]
    seed = other.self_seed()
    before = me.snapshot()
    with pytest.raises(InvalidShare, match="commitment"):
        me.receive_seed("org-01", bytes(32))
    with pytest.raises(InvalidShare, match="commitment"):
        me.receive_seed("org-02", seed)  # org-01's seed offered as org-02's
    with pytest.raises(MalformedMessage, match="32 bytes"):
        me.receive_seed("org-01", seed[:31])
    assert me.snapshot() == before
    assert me.receive_seed("org-01", seed) is True
    assert me.receive_seed("org-01", seed) is False  # the same seed relayed again
    assert me.seeds == {"org-01": seed}
    assert shamir.commitment(seed) == me._adverts["org-01"].b_commitment


def test_a_seed_of_a_dropped_org_is_refused_and_its_masks_still_come_off() -> None:
    # org-03 dropped before its masked input: its seed is not a survivor's, and the
    # others' pairwise masks with it come off with its reconstructed mask key
    dropped = frozenset({"org-03"})
    cfg, peers, inputs, total = _masked_round(5, 3, 32, 2, dropped)
    u3 = frozenset(cfg.participants) - dropped
    releases = {p: peers[p].unmask(u3) for p in sorted(u3)}
    me = peers["org-00"]
    with pytest.raises(InconsistentView, match="not a survivor"):
        me.receive_seed("org-03", peers["org-03"]._own().b)
    for p in sorted(u3 - {"org-00"}):
        me.receive_seed(p, peers[p].self_seed())
    # the dangling masks with org-03 still need its mask key: t releases
    assert set(me.missing_shares()) == {"org-03"}
    for p in ("org-01", "org-02"):
        me.receive_unmask(releases[p])
    np.testing.assert_array_equal(me.finalize(total), _plain(cfg, inputs, u3))


def test_a_seed_is_revealed_only_after_unmask_and_only_by_a_survivor() -> None:
    cfg, peers, _, _ = _masked_round(4, 3, 32, 3)
    peer = peers["org-00"]
    with pytest.raises(OutOfStage, match="UNMASK"):
        peer.self_seed()
    peer.unmask(frozenset(cfg.participants) - {"org-00"})
    with pytest.raises(InconsistentView, match="not a survivor"):
        peer.self_seed()


def test_no_other_survivor_set_once_seeds_were_revealed() -> None:
    # after a reveal, releasing the s_sk-share of a revealed org would expose both of
    # its secrets: unmask refuses any other survivor set
    cfg, peers, _, _ = _masked_round(4, 3, 32, 4)
    u3 = frozenset(cfg.participants)
    me = peers["org-00"]
    for peer in peers.values():
        peer.unmask(u3)
    me.receive_seed("org-02", peers["org-02"].self_seed())
    with pytest.raises(DoubleRelease, match="revealed"):
        me.unmask(u3 - {"org-02"})
    me.unmask(u3)  # the same set again is allowed
