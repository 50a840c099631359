"""Bad input to the masked-sum state machines: a named error, and the state left untouched."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterable
from dataclasses import replace

import numpy as np
import pytest

from secure_agg.errors import RingError
from secure_agg.keys import RoundContext, agree, encrypt, share_encryption_key
from secure_agg.messages import (
    AdvertiseKeys,
    Header,
    MalformedMessage,
    Message,
    ShareKeys,
    Stage,
    UnmaskShares,
)
from secure_agg.protocol import (
    BadSignature,
    BadVector,
    DoubleRelease,
    DuplicateMessage,
    InconsistentView,
    InvalidShare,
    OutOfStage,
    ProtocolConfig,
    RoundAborted,
    SecAggPeer,
    UnknownSender,
    WrongRecipient,
    WrongRound,
    share_aad,
)
from secure_agg.ring import ring_sum
from secure_agg.shamir import Share

CTX = RoundContext("fed", "run", 9)


def _key(org: str) -> bytes:
    return hashlib.sha256(b"identity/" + org.encode()).digest()


def signer(org: str) -> Callable[[bytes], bytes]:
    return lambda data: hmac.new(_key(org), data, hashlib.sha256).digest()


def verify(sender: str, data: bytes, sig: bytes) -> bool:
    return hmac.compare_digest(hmac.new(_key(sender), data, hashlib.sha256).digest(), sig)


class Harness:
    """Drives every peer of one round by hand, stage by stage."""

    def __init__(self, n: int = 5, t: int = 3, length: int = 8, neighbours: int | None = None):
        self.parts = tuple(f"org-{i}" for i in range(n))
        self.cfg = ProtocolConfig(CTX, self.parts, t, length, 32, neighbours)
        self.peers = {
            p: SecAggPeer(self.cfg, p, signer(p), verify, rng=np.random.default_rng([17, i]).bytes)
            for i, p in enumerate(self.parts)
        }
        rng = np.random.default_rng(3)
        self.inputs = {p: rng.integers(0, 2**32, length, dtype=np.uint32) for p in self.parts}
        self.adverts: dict[str, AdvertiseKeys] = {}
        self.shares: dict[str, dict[str, ShareKeys]] = {}
        self.masked: dict[str, np.ndarray] = {}
        self.unmasks: dict[str, UnmaskShares] = {}

    def live(self, who: Iterable[str] | None) -> list[str]:
        return list(self.parts if who is None else who)

    def advertise(self, who: Iterable[str] | None = None) -> None:
        who = self.live(who)
        for p in who:
            self.adverts[p] = self.peers[p].advertise_keys()
        for p in who:
            for q in who:
                if q != p:
                    self.peers[q].receive(self.adverts[p])
        for p in who:
            self.peers[p].close_advertise()

    def share(self, who: Iterable[str] | None = None) -> None:
        who = self.live(who)
        for p in who:
            self.shares[p] = self.peers[p].share_keys()
        for p in who:
            for q, m in self.shares[p].items():
                if q in who:
                    self.peers[q].receive(m)
        for p in who:
            self.peers[p].close_shares()

    def mask(self, who: Iterable[str] | None = None) -> None:
        for p in self.live(who):
            self.masked[p] = self.peers[p].masked_input(self.inputs[p])

    def unmask(self, who: Iterable[str] | None = None) -> None:
        who = self.live(who)
        u3 = frozenset(self.masked)
        for p in who:
            self.unmasks[p] = self.peers[p].unmask(u3)

    def exchange_unmask(self, who: Iterable[str] | None = None) -> None:
        who = self.live(who)
        for p in who:
            for q in self.unmasks:
                if q != p:
                    self.peers[p].receive(self.unmasks[q])

    def to_unmask(self) -> None:
        self.advertise()
        self.share()
        self.mask()
        self.unmask()

    def total(self) -> np.ndarray:
        return ring_sum(self.masked[p] for p in sorted(self.masked))

    def plain(self) -> np.ndarray:
        return ring_sum(self.inputs[p] for p in sorted(self.masked))


def rejected(
    peer: SecAggPeer, exc: type[Exception], match: str, call: Callable[[], object]
) -> None:
    """``call`` raises ``exc`` and leaves ``peer`` exactly as it was."""
    before = peer.snapshot()
    with pytest.raises(exc, match=match):
        call()
    assert peer.snapshot() == before


def resign(msg: Message, org: str) -> Message:
    return msg.signed(signer(org))


# --------------------------------------------------------------------------- authentication


def test_tampered_message_fails_its_signature() -> None:
    h = Harness()
    ad = h.peers["org-0"].advertise_keys()
    b = h.peers["org-1"]
    forged = replace(ad, s_pk=h.peers["org-2"].advertise_keys().s_pk)
    rejected(b, BadSignature, "signature does not verify", lambda: b.receive(forged))
    flipped = replace(ad, signature=bytes([ad.signature[0] ^ 1]) + ad.signature[1:])
    rejected(b, BadSignature, "org-0", lambda: b.receive(flipped))
    b.receive(ad)  # the genuine one is still accepted


def test_verifier_that_raises_counts_as_bad_signature() -> None:
    h = Harness()

    def broken(sender: str, data: bytes, sig: bytes) -> bool:
        raise RuntimeError("key store offline")

    peer = SecAggPeer(h.cfg, "org-1", signer("org-1"), broken)
    ad = h.peers["org-0"].advertise_keys()
    rejected(peer, BadSignature, "signature", lambda: peer.receive(ad))


def test_an_authenticated_caller_skips_only_the_signature_check() -> None:
    # the round engine verified the envelope these bytes came in, signed by the
    # message's sender: the message's own signature is not checked again...
    h = Harness()
    ad = h.peers["org-0"].advertise_keys()
    b = h.peers["org-1"]
    unsigned = replace(ad, signature=bytes(len(ad.signature)))
    rejected(b, BadSignature, "org-0", lambda: b.receive_advertise(unsigned))
    b.receive_advertise(unsigned, authenticated=True)
    # ...but every other check still runs
    rejected(b, DuplicateMessage, "second", lambda: b.receive_advertise(ad, authenticated=True))
    other = ProtocolConfig(RoundContext("fed", "run", 10), h.parts, 3, 8)
    stale = SecAggPeer(other, "org-2", signer("org-2"), verify).advertise_keys()
    rejected(b, WrongRound, "round=10", lambda: b.receive_advertise(stale, authenticated=True))
    mallory = replace(ad, header=Header(CTX, Stage.ADVERTISE_KEYS, "mallory"))
    rejected(
        b,
        UnknownSender,
        "not a participant",
        lambda: b.receive_advertise(mallory, authenticated=True),
    )


def test_wrong_round_is_refused() -> None:
    h = Harness()
    other = ProtocolConfig(RoundContext("fed", "run", 10), h.parts, 3, 8)
    stale = SecAggPeer(other, "org-0", signer("org-0"), verify).advertise_keys()
    b = h.peers["org-1"]
    rejected(b, WrongRound, "round=10", lambda: b.receive(stale))
    rejected(b, WrongRound, "this round", lambda: b.receive(stale.to_bytes()))


def test_non_participant_is_refused() -> None:
    h = Harness()
    ad = h.peers["org-0"].advertise_keys()
    mallory = replace(ad, header=Header(CTX, Stage.ADVERTISE_KEYS, "mallory"))
    b = h.peers["org-1"]
    rejected(b, UnknownSender, "not a participant", lambda: b.receive(resign(mallory, "mallory")))


def test_malformed_bytes_and_objects_are_refused() -> None:
    h = Harness()
    b = h.peers["org-1"]
    rejected(b, MalformedMessage, "truncated", lambda: b.receive(b"\x01\x01\x00"))
    rejected(b, MalformedMessage, "protocol message", lambda: b.receive(42))  # type: ignore[arg-type]


def test_low_order_public_key_is_refused() -> None:
    h = Harness()
    ad = h.peers["org-0"].advertise_keys()
    bad = resign(replace(ad, c_pk=bytes(32)), "org-0")
    b = h.peers["org-1"]
    rejected(b, MalformedMessage, "c_pk of 'org-0' is not a usable", lambda: b.receive(bad))


# --------------------------------------------------------------------------- replay and order


def test_duplicates_and_reflections_are_refused() -> None:
    h = Harness()
    a, b = h.peers["org-0"], h.peers["org-1"]
    ad = a.advertise_keys()
    b.receive(ad)
    rejected(b, DuplicateMessage, "second AdvertiseKeys", lambda: b.receive(ad))
    rejected(a, DuplicateMessage, "its own", lambda: a.receive(ad))


def test_duplicate_share_keys_and_unmask_shares() -> None:
    h = Harness()
    h.advertise()
    sk = {p: h.peers[p].share_keys() for p in h.parts}
    b = h.peers["org-1"]
    b.receive(sk["org-0"]["org-1"])
    rejected(b, DuplicateMessage, "second ShareKeys", lambda: b.receive(sk["org-0"]["org-1"]))
    for p in h.parts:
        for q, m in sk[p].items():
            if (p, q) != ("org-0", "org-1"):
                h.peers[q].receive(m)
    for p in h.parts:
        h.peers[p].close_shares()
    h.mask()
    h.unmask()
    b.receive(h.unmasks["org-0"])
    rejected(b, DuplicateMessage, "second UnmaskShares", lambda: b.receive(h.unmasks["org-0"]))


def test_out_of_stage_calls_and_messages() -> None:
    h = Harness()
    a, b = h.peers["org-0"], h.peers["org-1"]
    rejected(a, OutOfStage, "advertise_keys\\(\\) has not been called", a.close_advertise)
    rejected(a, OutOfStage, "share_keys\\(\\) needs stage SHARE_KEYS", a.share_keys)
    rejected(a, OutOfStage, "masked_input", lambda: a.masked_input(h.inputs["org-0"]))
    rejected(a, OutOfStage, "unmask", lambda: a.unmask(h.parts))
    rejected(a, OutOfStage, "finalize", lambda: a.finalize(h.inputs["org-0"]))
    a.advertise_keys()
    rejected(a, OutOfStage, "already advertised", a.advertise_keys)
    # org-0..3 move on; org-4 is still collecting advertisements
    h.adverts["org-0"] = a._adverts["org-0"]
    for p in h.parts[1:]:
        h.adverts[p] = h.peers[p].advertise_keys()
    for p in h.parts:
        for q in h.parts:
            if q != p:
                h.peers[q].receive(h.adverts[p])
    for p in h.parts[:4]:
        h.peers[p].close_advertise()
    early = a.share_keys()
    rejected(a, OutOfStage, "already sent", a.share_keys)
    late = h.peers["org-4"]
    rejected(late, OutOfStage, "receiving ShareKeys", lambda: late.receive(early["org-4"]))
    rejected(b, OutOfStage, "receiving AdvertiseKeys", lambda: b.receive(h.adverts["org-4"]))
    rejected(b, OutOfStage, "share_keys\\(\\) must be called", b.close_shares)


def test_unmask_shares_before_unmask_is_out_of_stage() -> None:
    h = Harness()
    h.advertise()
    h.share()
    h.mask()
    h.unmasks["org-0"] = h.peers["org-0"].unmask(frozenset(h.masked))
    b = h.peers["org-1"]
    rejected(b, OutOfStage, "receiving UnmaskShares", lambda: b.receive(h.unmasks["org-0"]))
    rejected(b, OutOfStage, "already produced", lambda: b.masked_input(h.inputs["org-1"]))


# --------------------------------------------------------------------------- share keys


def test_share_keys_for_someone_else_is_refused() -> None:
    h = Harness()
    h.advertise()
    sk = h.peers["org-0"].share_keys()
    c = h.peers["org-2"]
    rejected(c, WrongRecipient, "addressed to 'org-1'", lambda: c.receive(sk["org-1"]))


def test_share_keys_from_outside_u1_or_the_neighbourhood() -> None:
    h = Harness()
    h.advertise(h.parts[:4])
    outsider = h.peers["org-4"]
    outsider.advertise_keys()
    fake = ShareKeys(
        Header(CTX, Stage.SHARE_KEYS, "org-4"), recipient="org-0", ciphertext=b"x" * 164
    )
    a = h.peers["org-0"]
    rejected(a, UnknownSender, "not in U1", lambda: a.receive(resign(fake, "org-4")))

    g = Harness(n=10, t=3, neighbours=4)
    g.advertise()
    stranger = next(p for p in g.parts if p not in g.peers["org-0"].neighbours and p != "org-0")
    fake = ShareKeys(
        Header(CTX, Stage.SHARE_KEYS, stranger), recipient="org-0", ciphertext=b"x" * 164
    )
    a = g.peers["org-0"]
    rejected(a, UnknownSender, "not a neighbour", lambda: a.receive(resign(fake, stranger)))


def test_undecryptable_or_misindexed_shares_are_refused() -> None:
    h = Harness()
    h.advertise()
    sk = h.peers["org-0"].share_keys()
    b = h.peers["org-1"]
    m = sk["org-1"]
    garbled = resign(
        replace(m, ciphertext=m.ciphertext[:-1] + bytes([m.ciphertext[-1] ^ 1])), "org-0"
    )
    rejected(b, InvalidShare, "do not decrypt", lambda: b.receive(garbled))
    # correctly encrypted, signed, but carrying the share meant for org-2 (x = 3)
    c_sk = h.peers["org-0"]._own().c.private
    key = share_encryption_key(agree(c_sk, h.adverts["org-1"].c_pk), CTX, "org-0", "org-1")
    wrong = Share(3, 5).to_bytes() * 2
    blob = encrypt(key, wrong, share_aad(CTX, "org-0", "org-1"))
    misindexed = resign(replace(m, ciphertext=blob), "org-0")
    rejected(b, InvalidShare, "expected 2", lambda: b.receive(misindexed))
    short = resign(
        replace(m, ciphertext=encrypt(key, b"short", share_aad(CTX, "org-0", "org-1"))), "org-0"
    )
    rejected(b, InvalidShare, "bytes, expected", lambda: b.receive(short))
    # a ciphertext bound to another (sender, recipient) pair does not decrypt: AAD binding
    reflected = encrypt(key, wrong, share_aad(CTX, "org-1", "org-0"))
    rejected(
        b,
        InvalidShare,
        "do not decrypt",
        lambda: b.receive(resign(replace(m, ciphertext=reflected), "org-0")),
    )
    b.receive(m)


# --------------------------------------------------------------------------- vectors


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (np.zeros(7, np.uint32), "length 8"),
        (np.zeros(8, np.uint64), "dtype"),
        (np.zeros(8, np.int64), "dtype"),
        (np.zeros((2, 4), np.uint32), "one-dimensional"),
        ([0] * 8, "numpy array"),
    ],
    ids=["length", "ring64", "signed", "2d", "list"],
)
def test_bad_vectors_are_refused(bad: object, match: str) -> None:
    h = Harness()
    h.advertise()
    h.share()
    a = h.peers["org-0"]
    rejected(a, BadVector, match, lambda: a.masked_input(bad))  # type: ignore[arg-type]
    assert issubclass(BadVector, RingError)
    h.mask()
    h.unmask()
    h.exchange_unmask()
    rejected(a, BadVector, match, lambda: a.finalize(bad))  # type: ignore[arg-type]
    assert np.array_equal(a.finalize(h.total()), h.plain())


@pytest.mark.parametrize("mode", ["in-place", "separate", "fresh"])
def test_masked_input_into_out_equals_a_new_array(mode: str) -> None:
    """``out=x`` masks in place, ``out=buf`` fills buf: both give exactly the new array's y."""
    fresh, other = Harness(), Harness()
    for h in (fresh, other):
        h.advertise()
        h.share()
    x = other.inputs["org-2"].copy()
    expected = fresh.peers["org-2"].masked_input(x)
    assert np.array_equal(x, other.inputs["org-2"])  # a new array leaves x alone
    peer = other.peers["org-2"]
    if mode == "in-place":
        y = peer.masked_input(x, out=x)
        assert y is x
    elif mode == "separate":
        buf = np.full_like(x, 0xDEADBEEF)
        y = peer.masked_input(x, out=buf)
        assert y is buf and np.array_equal(x, other.inputs["org-2"])
    else:
        y = peer.masked_input(x, out=None)
    assert np.array_equal(y, expected)


@pytest.mark.parametrize(
    ("make_out", "match"),
    [
        (lambda x: np.zeros(8, np.uint64), "length 8|dtype"),
        (lambda x: np.zeros(7, np.uint32), "length 8"),
        (lambda x: np.zeros(16, np.uint32)[::2], "contiguous"),
        (lambda x: _read_only(np.zeros(8, np.uint32)), "writeable"),
        (lambda x: np.concatenate([x, x])[1:9], None),  # a copy: allowed
    ],
    ids=["ring64", "length", "strided", "read-only", "copy"],
)
def test_masked_input_refuses_a_bad_out(
    make_out: Callable[[np.ndarray], np.ndarray], match: str | None
) -> None:
    h = Harness()
    h.advertise()
    h.share()
    a = h.peers["org-0"]
    x = h.inputs["org-0"]
    out = make_out(x)
    if match is None:
        assert np.array_equal(a.masked_input(x, out=out), out)
        return
    rejected(a, BadVector, match, lambda: a.masked_input(x, out=out))
    h.mask()  # the refusal left org-0 able to mask
    h.unmask()
    h.exchange_unmask()
    assert np.array_equal(a.finalize(h.total()), h.plain())


def test_masked_input_refuses_an_out_overlapping_the_input() -> None:
    h = Harness(length=8)
    h.advertise()
    h.share()
    a = h.peers["org-0"]
    backing = np.zeros(9, np.uint32)
    backing[:8] = h.inputs["org-0"]
    x, out = backing[:8], backing[1:9]
    rejected(a, BadVector, "overlaps", lambda: a.masked_input(x, out=out))
    assert np.array_equal(backing[:8], h.inputs["org-0"])  # untouched


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


# --------------------------------------------------------------------------- unmask


def test_unmask_refuses_inconsistent_survivor_sets() -> None:
    h = Harness()
    h.advertise(h.parts[:4])
    h.share(h.parts[:4])
    h.mask(h.parts[:3])
    a, d = h.peers["org-0"], h.peers["org-3"]
    rejected(a, InconsistentView, "never advertised", lambda: a.unmask(["org-0", "org-1", "org-4"]))
    rejected(d, InconsistentView, "produced no masked input", lambda: d.unmask(["org-0", "org-3"]))


def test_unmask_refuses_a_survivor_that_sent_no_shares() -> None:
    h = Harness()
    h.advertise()
    sk = {p: h.peers[p].share_keys() for p in h.parts}
    for p in h.parts:
        for q, m in sk[p].items():
            if not (p == "org-4" and q == "org-0"):  # org-4's shares to org-0 are lost
                h.peers[q].receive(m)
    for p in h.parts:
        h.peers[p].close_shares()
    h.mask()
    a = h.peers["org-0"]
    rejected(a, InconsistentView, "sent no shares to org-0", lambda: a.unmask(h.parts))


def test_double_release_is_refused() -> None:
    h = Harness()
    h.to_unmask()
    a = h.peers["org-0"]
    assert a.released == {p: "b" for p in h.parts}
    # a revised survivor set that declares org-3 dropped would release its s_sk-share too
    rejected(
        a,
        DoubleRelease,
        "s_sk-share of 'org-3'",
        lambda: a.unmask(["org-0", "org-1", "org-2", "org-4"]),
    )
    assert a.released["org-3"] == "b"
    # the same survivor set again is harmless
    again = a.unmask(h.parts)
    assert {o for o, _ in again.b_shares} == set(h.parts) and again.s_shares == ()


def test_revised_survivor_set_releases_only_consistent_shares() -> None:
    h = Harness()
    h.advertise()
    h.share()
    h.mask(h.parts[:4])
    a = h.peers["org-0"]
    first = a.unmask(h.parts)  # org-4 wrongly listed (it never masked, but a claims nothing)
    assert {o for o, _ in first.b_shares} == set(h.parts)
    rejected(a, DoubleRelease, "org-4", lambda: a.unmask(h.parts[:4]))


def test_unmask_shares_must_answer_the_same_survivors() -> None:
    h = Harness()
    h.advertise()
    h.share()
    h.mask(h.parts[:4])
    u3 = frozenset(h.parts[:4])
    a = h.peers["org-0"]
    a.unmask(u3)
    other = h.peers["org-1"].unmask(h.parts[:4])
    forked = UnmaskShares(
        other.header,
        survivors=("org-0", "org-1", "org-2"),
        received_from=other.received_from,
        b_shares=tuple((o, s) for o, s in other.b_shares if o != "org-3"),
        s_shares=(),
    )
    rejected(
        a, InconsistentView, "another survivor set", lambda: a.receive(resign(forked, "org-1"))
    )
    # a b-share of an org that is not a survivor, and a share with another holder's x
    sneaky = replace(other, b_shares=(("org-4", Share(2, 1)),), s_shares=())
    rejected(a, InconsistentView, "b-share of 'org-4'", lambda: a.receive(resign(sneaky, "org-1")))
    misindexed = replace(other, b_shares=(("org-0", Share(4, 1)),), s_shares=())
    rejected(a, InvalidShare, "x=4", lambda: a.receive(resign(misindexed, "org-1")))
    s_of_survivor = replace(other, b_shares=(), s_shares=(("org-2", Share(2, 1)),))
    rejected(
        a,
        InconsistentView,
        "s_sk-share of 'org-2'",
        lambda: a.receive(resign(s_of_survivor, "org-1")),
    )
    lying_view = replace(other, received_from=("org-0", "org-1", "org-2"))
    rejected(
        a,
        InconsistentView,
        "holds no shares of survivors",
        lambda: a.receive(resign(lying_view, "org-1")),
    )
    a.receive(other)


def test_finalize_waits_for_shares_and_reports_missing() -> None:
    h = Harness(n=5, t=3)
    h.to_unmask()
    a = h.peers["org-0"]
    # its own self-mask seed it knows: only the others' are reconstructed
    others = [p for p in h.parts if p != "org-0"]
    assert a.missing_shares() == {p: 2 for p in others}
    a.receive(h.unmasks["org-1"])
    assert a.missing_shares() == {p: 1 for p in others}
    a.receive(h.unmasks["org-2"])
    assert a.missing_shares() == {}
    assert np.array_equal(a.finalize(h.total()), h.plain())
    assert a.stage is Stage.DONE
    b = h.peers["org-1"]
    b.receive(h.unmasks["org-0"])
    with pytest.raises(RoundAborted, match="cannot reconstruct the self-mask seed"):
        b.finalize(h.total())
    assert b.stage is Stage.ABORTED


def test_tampered_released_share_is_caught_by_the_commitment() -> None:
    h = Harness(n=4, t=3)
    h.to_unmask()
    a = h.peers["org-0"]
    good = h.unmasks["org-1"]
    bad = replace(
        good, b_shares=tuple((o, Share(s.x, (s.y + 1) % 2**500)) for o, s in good.b_shares)
    )
    a.receive(resign(bad, "org-1"))
    a.receive(h.unmasks["org-2"])
    with pytest.raises(RoundAborted, match="cannot reconstruct the self-mask seed"):
        a.finalize(h.total())


def test_in_place_finalize() -> None:
    h = Harness()
    h.to_unmask()
    h.exchange_unmask()
    total = h.total()
    out = h.peers["org-2"].finalize(total, in_place=True)
    assert out is total
    assert np.array_equal(total, h.plain())


# --------------------------------------------------------------------------- partial sends


def _partial_round(silent_survivor: bool) -> Harness:
    """org-5 sends its shares to org-0..2 only, then vanishes before masking."""
    h = Harness(n=6, t=3)
    h.advertise()
    sk = {p: h.peers[p].share_keys() for p in h.parts}
    for p in h.parts:
        for q, m in sk[p].items():
            if p != "org-5" or q in {"org-0", "org-1", "org-2"}:
                h.peers[q].receive(m)
    for p in h.parts:
        h.peers[p].close_shares()
    h.mask(h.parts[:5])
    h.unmask(h.parts[1:5] if silent_survivor else h.parts[:5])
    h.exchange_unmask(h.parts[1:5])
    return h


def test_partial_share_sends_are_unmasked_from_the_reported_views() -> None:
    h = _partial_round(silent_survivor=False)
    for p in h.parts[1:5]:
        assert np.array_equal(h.peers[p].finalize(h.total()), h.plain())


def test_partial_share_sends_with_a_silent_survivor_abort() -> None:
    h = _partial_round(silent_survivor=True)
    with pytest.raises(RoundAborted, match="did not report"):
        h.peers["org-1"].finalize(h.total())


# --------------------------------------------------------------------------- aborts


def test_after_abort_everything_raises_round_aborted() -> None:
    h = Harness(n=5, t=4)
    a = h.peers["org-0"]
    a.advertise_keys()
    a.receive(h.peers["org-1"].advertise_keys())
    with pytest.raises(
        RoundAborted, match="only 2 of org-0's share holders advertised keys, threshold is 4"
    ):
        a.close_advertise()
    assert a.stage is Stage.ABORTED
    assert a.abort_reason is not None and "threshold is 4" in a.abort_reason
    for call in (a.share_keys, a.close_shares, lambda: a.unmask(h.parts)):
        rejected(a, RoundAborted, "already aborted", call)
    rejected(
        a, RoundAborted, "already aborted", lambda: a.receive(h.peers["org-2"].advertise_keys())
    )


def test_unmask_below_threshold_aborts_without_releasing() -> None:
    h = Harness(n=5, t=3)
    h.advertise()
    h.share()
    h.mask(h.parts[:2])
    a = h.peers["org-0"]
    with pytest.raises(RoundAborted, match="only 2 survivors, threshold is 3"):
        a.unmask(h.parts[:2])
    assert a.released == {}
    assert a.stage is Stage.ABORTED
