"""The U2 gap: an org drops half-way through sending its shares, and the survivors it
reached fall silent before unmasking. The sum is exact, or the round fails naming the
dropped org: never a wrong sum."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable

import numpy as np
import pytest

from secure_agg.keys import RoundContext
from secure_agg.messages import UnmaskShares
from secure_agg.protocol import ProtocolConfig, RoundAborted, SecAggPeer
from secure_agg.ring import ring_sum

CTX = RoundContext("fed", "run", 4)


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
    adverts = {p: peers[p].advertise_keys() for p in parts}
    for p in parts:
        for q in parts:
            if q != p:
                peers[q].receive(adverts[p])
    for p in parts:
        peers[p].close_advertise()
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
        for q, msg in releases.items():
            if q != p:
                peers[p].receive(msg)
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
