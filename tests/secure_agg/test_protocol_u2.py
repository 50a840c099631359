"""The U2 gap: an org drops half-way through sending its shares, and the survivors it
reached fall silent before unmasking. The sum is exact, or the round fails naming the
dropped org: never a wrong sum."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_agg.keys import RoundContext
from secure_agg.messages import UnmaskShares
from secure_agg.protocol import (
    InconsistentView,
    ProtocolConfig,
    RoundAborted,
    RoundResult,
    SecAggPeer,
    Stage,
    simulate_round,
)
from secure_agg.ring import ring_sum

CTX = RoundContext("fed", "run", 4)


def _advertise(peers: dict[str, SecAggPeer], parts: Sequence[str]) -> None:
    """Round 0: every participant's keys reach every other one, and the stage closes."""
    adverts = {p: peers[p].advertise_keys() for p in parts}
    for p in parts:
        for q in parts:
            if q != p:
                peers[q].receive(adverts[p])
    for p in parts:
        peers[p].close_advertise()


def _signer(org: str) -> Callable[[bytes], bytes]:
    key = hashlib.sha256(b"u2/" + org.encode()).digest()
    return lambda data: hmac.new(key, data, hashlib.sha256).digest()


def _verify(sender: str, data: bytes, sig: bytes) -> bool:
    key = hashlib.sha256(b"u2/" + sender.encode()).digest()
    return hmac.compare_digest(hmac.new(key, data, hashlib.sha256).digest(), sig)


def orgs(n: int) -> tuple[str, ...]:
    return tuple(f"org-{i:02d}" for i in range(n))


def _by_hand(
    n: int, reach: Iterable[str], silent: Iterable[str]
) -> tuple[dict[str, np.ndarray], dict[str, str], np.ndarray]:
    """A round of ``n`` orgs (``t`` a majority) driven through the peers' own calls
    alone: the last org's ShareKeys reach only ``reach``, then it drops; ``silent``
    survivors mask and then say nothing more. Returns each finisher's sum, each
    finisher's abort reason, and the plaintext sum of the survivors."""
    parts = orgs(n)
    dropped = parts[-1]
    cfg = ProtocolConfig(CTX, parts, n // 2 + 1, 16, 32)
    peers = {
        p: SecAggPeer(cfg, p, _signer(p), _verify, rng=np.random.default_rng([4, i]).bytes)
        for i, p in enumerate(parts)
    }
    rng = np.random.default_rng(n)
    inputs = {p: rng.integers(0, 2**32, 16, dtype=np.uint32) for p in parts}
    _advertise(peers, parts)
    reached = set(reach)
    for p in parts:
        for q, msg in peers[p].share_keys().items():
            if p != dropped or q in reached:
                peers[q].receive(msg)
    survivors = parts[:-1]
    for p in survivors:
        peers[p].close_shares()
    total = ring_sum(peers[p].masked_input(inputs[p]) for p in survivors)
    plain = ring_sum(inputs[p] for p in survivors)
    finishers = [p for p in survivors if p not in set(silent)]
    sums: dict[str, np.ndarray] = {}
    aborted: dict[str, str] = {}
    releases: dict[str, UnmaskShares] = {}
    for p in finishers:
        try:
            releases[p] = peers[p].unmask(frozenset(survivors))
        except RoundAborted as exc:
            aborted[p] = str(exc)
    for p in finishers:
        if p in aborted:
            continue
        for q, release in releases.items():
            if q != p:
                peers[p].receive(release)
        try:
            sums[p] = peers[p].finalize(total)
        except RoundAborted as exc:
            aborted[p] = str(exc)
    return sums, aborted, plain


@pytest.mark.parametrize("n", [7, 12])
def test_finding_4_a_dropped_org_whose_only_holder_falls_silent_never_gives_a_wrong_sum(
    n: int,
) -> None:
    # the last org reaches org-00 only and drops; org-00 masks with it, then falls
    # silent. The others cannot know whether org-00's input carries that mask: they
    # fail the round naming the dropped org, and none finishes with a wrong sum
    dropped = orgs(n)[-1]
    sums, aborted, plain = _by_hand(n, reach=["org-00"], silent=["org-00"])
    for org, total in sums.items():
        assert np.array_equal(total, plain), f"{org} finished with a wrong sum"
    assert sums == {}
    assert len(aborted) == n - 2
    for reason in aborted.values():
        assert repr(dropped) in reason


# --------------------------------------------------------------------------- agreed views


def _u2_round(n: int, reach: Iterable[str], silent: Iterable[str], seed: int = 0) -> RoundResult:
    """The simulated round of ``n`` orgs (``t`` a majority): the last org's ShareKeys
    reach only ``reach`` and it drops before masking; ``silent`` survivors mask, then
    fall silent. The survivors unmask with U3 and the U2 views their masked inputs
    committed to."""
    parts = orgs(n)
    cfg = ProtocolConfig(CTX, parts, n // 2 + 1, 16, 32)
    rng = np.random.default_rng(seed)
    inputs = {p: rng.integers(0, 2**32, 16, dtype=np.uint32) for p in parts}
    drop = {parts[-1]: Stage.MASKED_INPUT} | dict.fromkeys(silent, Stage.UNMASK)
    return simulate_round(cfg, inputs, drop, seed=seed, reach={parts[-1]: frozenset(reach)})


def _plain(result: RoundResult, n: int, seed: int = 0) -> np.ndarray:
    parts = orgs(n)
    rng = np.random.default_rng(seed)
    inputs = {p: rng.integers(0, 2**32, 16, dtype=np.uint32) for p in parts}
    return ring_sum(inputs[p] for p in sorted(result.survivors))


@pytest.mark.parametrize("n", [7, 12])
def test_finding_4_a_dropped_org_reaching_only_a_silent_holder_fails_the_round_by_name(
    n: int,
) -> None:
    # org-00 masked with the dropped org, whose mask key only org-00 holds a share of:
    # that mask can never come off, and every finisher fails the round naming the
    # dropped org before it releases anything
    dropped = orgs(n)[-1]
    result = _u2_round(n, reach=["org-00"], silent=["org-00"])
    assert result.sums == {}
    assert set(result.aborted) == set(orgs(n)[1:-1])
    for org, reason in result.aborted.items():
        assert f"dropped {dropped!r} with survivors ['org-00']" in reason
        assert "cannot be removed" in reason
        assert result.peers[org].released == {}


@pytest.mark.parametrize("n", [7, 12])
def test_finding_4_a_dropped_org_reaching_too_few_holders_fails_the_round_by_name(n: int) -> None:
    # it reached t - 1 survivors, one of them silent: t - 1 survivors hold shares of
    # its mask key, one fewer than the threshold
    t = n // 2 + 1
    dropped = orgs(n)[-1]
    result = _u2_round(n, reach=orgs(n)[: t - 1], silent=["org-00"])
    assert result.sums == {}
    for reason in result.aborted.values():
        assert f"dropped {dropped!r}" in reason and f"threshold t={t}" in reason


@pytest.mark.parametrize("n", [7, 12])
def test_finding_4_a_dropped_org_whose_holders_release_enough_is_removed_exactly(n: int) -> None:
    # it reached org-00 (silent) and t others, which report: its masks with every one
    # of them, org-00 included, come off its reconstructed key, and the sum is exact
    # (before, the finishers aborted: a silent survivor's view was guessed or unknown)
    t = n // 2 + 1
    result = _u2_round(n, reach=orgs(n)[: t + 1], silent=["org-00"])
    assert result.aborted == {}
    assert set(result.sums) == set(orgs(n)[1:-1])
    assert result.survivors == frozenset(orgs(n)[:-1])
    assert np.array_equal(result.total, _plain(result, n))


@pytest.mark.parametrize("n", [7, 12])
def test_finding_4_a_dropped_org_that_reached_no_survivor_costs_nothing(n: int) -> None:
    # it reached nobody: no survivor masked with it, so nothing of it is in the sum
    result = _u2_round(n, reach=[], silent=["org-00"])
    assert result.aborted == {}
    assert np.array_equal(result.total, _plain(result, n))


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(4, 12),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_finding_4_any_partial_send_and_silence_gives_the_exact_sum_or_a_named_failure(
    n: int, seed: int, data: st.DataObject
) -> None:
    # any orgs drop half-way through their shares, any survivors fall silent: whoever
    # finishes holds the exact sum; whoever fails names why; and the round finishes
    # exactly when every dropped org's key can be rebuilt from the survivors' releases
    parts = orgs(n)
    t = n // 2 + 1
    cfg = ProtocolConfig(RoundContext("fed", "run", seed), parts, t, 8, 32)
    shuffled = data.draw(st.permutations(parts))
    dropping = shuffled[: data.draw(st.integers(0, n - t))]
    alive = [p for p in parts if p not in dropping]
    silent = data.draw(st.lists(st.sampled_from(alive), unique=True, max_size=len(alive) - t))
    reach = {
        k: frozenset(data.draw(st.lists(st.sampled_from(parts), unique=True))) for k in dropping
    }
    rng = np.random.default_rng(seed)
    inputs = {p: rng.integers(0, 2**32, 8, dtype=np.uint32) for p in parts}
    drop = dict.fromkeys(dropping, Stage.MASKED_INPUT) | dict.fromkeys(silent, Stage.UNMASK)
    result = simulate_round(cfg, inputs, drop, seed=seed, reach=reach)
    u3 = frozenset(alive)
    assert result.survivors == u3
    plain = ring_sum(inputs[p] for p in sorted(u3))
    for total in result.sums.values():
        assert np.array_equal(total, plain)
    for reason in result.aborted.values():
        assert "'org-" in reason
    releasers = u3 - set(silent)
    # every dropped org that some survivor masked with: its survivor holders release
    feasible = (
        all(len(reach[k] & u3) == 0 or len(reach[k] & releasers) >= t for k in dropping)
        and len(releasers) >= t
    )
    assert bool(result.sums) is feasible
    if feasible:
        assert set(result.sums) == releasers


# --------------------------------------------------------------------------- refusals


def _shared(n: int, lost: Iterable[tuple[str, str]] = ()) -> dict[str, SecAggPeer]:
    """Every peer of ``n`` through SHARE_KEYS; the ShareKeys of each ``(sender,
    recipient)`` in ``lost`` never arrive."""
    parts = orgs(n)
    cfg = ProtocolConfig(CTX, parts, n // 2 + 1, 8, 32)
    peers = {
        p: SecAggPeer(cfg, p, _signer(p), _verify, rng=np.random.default_rng([9, i]).bytes)
        for i, p in enumerate(parts)
    }
    _advertise(peers, parts)
    gone = set(lost)
    for p in parts:
        for q, msg in peers[p].share_keys().items():
            if (p, q) not in gone:
                peers[q].receive(msg)
    return peers


def _refused(peer: SecAggPeer, match: str, call: Callable[[], object]) -> None:
    before = peer.snapshot()
    with pytest.raises(InconsistentView, match=match):
        call()
    assert peer.snapshot() == before


def test_a_peer_lacking_the_shares_of_an_agreed_participant_refuses_to_mask() -> None:
    peers = _shared(5, lost=[("org-04", "org-01")])
    parts = orgs(5)
    _refused(
        peers["org-01"],
        r"holds no shares of participants \['org-04'\]",
        lambda: peers["org-01"].close_shares(parts),
    )
    _refused(peers["org-02"], "not a set of U1 orgs", lambda: peers["org-02"].close_shares(["x"]))
    # without org-04 among the participants, org-01 masks with the others only, and
    # org-02 neither masks with org-04 nor ever releases a share of it
    assert peers["org-01"].close_shares(parts[:4]) == frozenset(parts[:4])
    assert peers["org-02"].close_shares(parts[:4]) == frozenset(parts[:4])
    x = np.zeros(8, dtype=np.uint32)
    peers["org-02"].masked_input(x)
    release = peers["org-02"].unmask(parts[:3])
    assert peers["org-02"].views == {p: frozenset(parts[:4]) for p in parts[:3]}
    assert {o for o, _ in release.s_shares} == {"org-03"}
    assert release.received_from == parts[:4]


def test_agreed_views_that_do_not_fit_the_round_are_refused() -> None:
    parts = orgs(5)
    peers = _shared(5)
    for p in parts:
        peers[p].close_shares()
        peers[p].masked_input(np.zeros(8, dtype=np.uint32))
    a = peers["org-00"]
    u3 = parts[:4]
    views = {p: frozenset(parts) for p in u3}
    partial = {p: views[p] for p in u3[:3]}
    _refused(a, r"no agreed U2 view of survivors \['org-03'\]", lambda: a.unmask(u3, partial))
    short = views | {"org-02": frozenset(parts[:3])}
    _refused(a, "holds no shares of survivors", lambda: a.unmask(u3, short))
    stranger = views | {"org-02": frozenset([*parts, "org-99"])}
    _refused(a, "impossible", lambda: a.unmask(u3, stranger))
    mine = views | {"org-00": frozenset(parts[:4])}
    _refused(a, "not the set whose shares it masked with", lambda: a.unmask(u3, mine))
    a.unmask(u3, views)
    # the same survivors again, with other views: refused
    other = views | {"org-01": frozenset(parts[:4])}
    _refused(a, "other U2 views", lambda: a.unmask(u3, other))
    # a release reporting another U2 than its sender's agreed one: refused
    honest = peers["org-01"].unmask(u3, views)
    lying = replace(honest, received_from=parts[:4]).signed(_signer("org-01"))
    _refused(a, "another U2 view than the agreed one", lambda: a.receive(lying))
    a.receive(honest)
