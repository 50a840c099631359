"""Shares sealed a round ahead: the keys, the ready's bytes, and rounds that use them."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib

import numpy as np
import pytest
from coordinator_free.rounds import RoundConfig
from coordinator_free.rounds.ahead import (
    KEY_ID_BYTES,
    RETAINED,
    Ahead,
    AheadKeys,
    Blob,
    Ready,
    encode_blobs,
    kept_blobs,
    key_id,
    read_blobs,
)
from coordinator_free.rounds.context import StageContext
from coordinator_free.rounds.ready_relay import ReadyRelay, decode_batch, encode_batch
from coordinator_free.rounds.wire import Token, mutual_set
from coordinator_free.sim import Fault, FaultSpec, RoundOutcome, SimConfig, Simulation
from hypothesis import given, settings
from hypothesis import strategies as st

from secure_agg import shamir
from secure_agg.keys import RoundContext, generate_keypair
from secure_agg.protocol import InvalidShare, ProtocolConfig, SecAggPeer
from secure_agg.protocol.errors import DuplicateMessage, UnknownSender
from secure_agg.protocol.simulate import _ed25519_identities

# the shares sealed ahead from three members on (the default starts with SecAgg+)
FAST = RoundConfig(
    ready_timeout=0.6,
    stage_timeout=4.0,
    step_timeout=2.0,
    send_timeout=4.0,
    ring_min_chunk=1,
    shares_ahead_from=3,
)

# -- the ready's bytes ---------------------------------------------------------------------


def test_a_ready_has_fixed_bytes() -> None:
    blob = Blob(b"\x02" * 8, b"ct")
    spk = bytes(range(32, 64))
    ahead = Ahead.sealing(bytes(range(32)), frozenset({b"\x01" * 8}), {3: blob}, spk)
    digest = hashlib.sha256(b"fedweave/ahead-blob/v1\x00" + b"\x02" * 8 + b"ct").digest()[:8]
    assert blob.digest() == digest
    core = (
        "aa" * 32
        + "00000006"
        + b"advert".hex()
        + bytes(range(32)).hex()
        + spk.hex()  # the masking key of the next round
        + "01"
        + "01" * 8
        + "0001"  # one blob sealed: its holder and digest
        + "0003"
        + digest.hex()
    )
    ready = Ready(b"\xaa" * 32, b"advert", ahead)
    assert ready.core().hex() == core
    data = ready.to_bytes()
    assert data.hex() == core + "0001" + "0003" + "02" * 8 + "0002" + b"ct".hex()
    assert Ready.from_bytes(data, 32) == ready
    assert Ready.split(data, 32) == (bytes.fromhex(core), data[len(core) // 2 :])
    # the core alone is a ready whose blobs travel elsewhere
    assert Ready.from_bytes(ready.core(), 32) == Ready(
        b"\xaa" * 32, b"advert", dataclasses.replace(ahead, blobs={})
    )


def test_a_ready_without_ahead_part_is_the_hash_and_the_advertisement() -> None:
    data = Ready(b"\xbb" * 32, b"keys").to_bytes()
    assert data == b"\xbb" * 32 + b"\x00\x00\x00\x04keys"
    assert Ready.from_bytes(data, 32) == Ready(b"\xbb" * 32, b"keys", None)
    assert Ready.split(data, 32) == (data, b"")


_blobs = st.dictionaries(
    st.integers(0, 65535),
    st.builds(Blob, st.binary(min_size=8, max_size=8), st.binary(max_size=200)),
    max_size=6,
)


@settings(max_examples=80, deadline=None)
@given(
    advert=st.binary(max_size=300),
    next_pk=st.binary(min_size=32, max_size=32),
    held=st.frozensets(st.binary(min_size=8, max_size=8), max_size=RETAINED),
    blobs=_blobs,
    travelling=st.sets(st.integers(0, 65535)),
)
def test_a_ready_round_trips_with_any_of_its_blobs(
    advert: bytes,
    next_pk: bytes,
    held: frozenset[bytes],
    blobs: dict[int, Blob],
    travelling: set[int],
) -> None:
    sealed = Ahead.sealing(next_pk, held, blobs)
    ready = Ready(b"\x01" * 32, advert, sealed)
    assert Ready.from_bytes(ready.to_bytes(), 32) == ready
    # whichever blobs travel with it, the core is the same bytes, and lists every digest
    some = Ready(
        b"\x01" * 32,
        advert,
        dataclasses.replace(sealed, blobs={i: blobs[i] for i in travelling & blobs.keys()}),
    )
    core, rest = Ready.split(some.to_bytes(), 32)
    assert core == ready.core() and core + rest == some.to_bytes()
    assert Ready.from_bytes(some.to_bytes(), 32) == some
    for index, blob in blobs.items():
        assert sealed.digest_for(index) == blob.digest()
    assert all(sealed.digest_for(i) is None for i in travelling - blobs.keys())


@settings(max_examples=80, deadline=None)
@given(blobs=_blobs, cut=st.integers(1, 400))
def test_a_cut_ready_is_refused_never_misread(blobs: dict[int, Blob], cut: int) -> None:
    data = Ready(b"\x01" * 32, b"adv", Ahead.sealing(b"\x07" * 32, frozenset(), blobs)).to_bytes()
    cut = min(cut, len(data) - 33)  # keep the hash and part of the rest
    short = data[:-cut]
    try:
        parsed = Ready.from_bytes(short, 32)
    except ValueError:
        return
    # a cut that leaves a well-formed ready can only have dropped the ahead part whole,
    # or every blob after the core
    core = Ready(b"\x01" * 32, b"adv", Ahead.sealing(b"\x07" * 32, frozenset(), blobs)).core()
    assert short == data[: len(short)]
    assert parsed.ahead is None or (short == core and parsed.ahead.blobs == {})


@settings(max_examples=80, deadline=None)
@given(blobs=_blobs, holder=st.integers(0, 65535), cut=st.integers(0, 300))
def test_a_holder_reads_its_own_blob_of_a_ready_and_refuses_what_the_full_parse_refuses(
    blobs: dict[int, Blob], holder: int, cut: int
) -> None:
    # a node reads only its own blob of what came with a ready (``only``): the same
    # fields, the other holders' blobs left out, and every malformed ready refused all
    # the same
    holder = next(iter(blobs), holder) if cut % 2 else holder
    ahead = Ahead.sealing(b"\x07" * 32, frozenset({b"\x01" * 8}), blobs)
    data = Ready(b"\x01" * 32, b"adv", ahead).to_bytes()
    mine = Ready.from_bytes(data, 32, only=holder)
    assert mine.ahead == dataclasses.replace(
        ahead, blobs={holder: blobs[holder]} if holder in blobs else {}
    )
    assert read_blobs(Ready.split(data, 32)[1], only=holder) == mine.ahead.blobs
    short = data[: max(33, len(data) - cut)]
    for only in (None, holder):
        try:
            parsed = Ready.from_bytes(short, 32, only=only)
        except ValueError:
            refused = True
        else:
            refused = False
            assert parsed.h0 == data[:32]
        if only is None:
            full_refused = refused
    assert refused == full_refused


def test_blobs_out_of_holder_order_are_refused() -> None:
    one = b"\x00\x05" + b"\x02" * 8 + b"\x00\x01x"
    two = b"\x00\x03" + b"\x02" * 8 + b"\x00\x01y"
    head = b"\x07" * 64 + b"\x00" + b"\x00\x00" + b"\x00\x02"
    assert Ahead.from_bytes(head + two + one).blobs.keys() == {3, 5}
    for only in (None, 3, 5):
        with pytest.raises(ValueError, match="out of order"):
            Ahead.from_bytes(head + one + two, only)
    digests = b"\x07" * 64 + b"\x00" + b"\x00\x02"
    with pytest.raises(ValueError, match="out of holder order"):
        Ahead.from_bytes(digests + b"\x00\x05" + b"\x01" * 8 + b"\x00\x03" + b"\x01" * 8)


def test_malformed_ahead_parts_are_refused() -> None:
    good = Ahead.sealing(
        b"\x07" * 32, frozenset({b"\x01" * 8}), {1: Blob(b"\x02" * 8, b"x")}
    ).to_bytes()
    for bad in (
        good + b"\x00",  # trailing bytes
        good[:40],  # cut in the held list
        good[:60],  # cut in the digests
        b"\x07" * 32 + bytes([RETAINED + 1]) + b"\x01" * 8 * (RETAINED + 1) + b"\x00\x00",
        b"\x07" * 32 + b"\x02" + b"\x01" * 16 + b"\x00\x00",  # one key listed twice
        b"\x07" * 32
        + b"\x00"
        + b"\x00\x00"
        + b"\x00\x02"
        + (b"\x00\x01" + b"\x02" * 8 + b"\x00\x00") * 2,
    ):
        with pytest.raises(ValueError):
            Ahead.from_bytes(bad)


def test_a_relay_passes_on_one_blob_per_holder_it_reaches_and_skips_malformed_copies() -> None:
    a, b = Blob(b"\x01" * 8, b"aa"), Blob(b"\x02" * 8, b"bb")
    spoiled = Blob(b"\x01" * 8, b"zz")
    first = encode_blobs({1: a, 4: b})
    second = encode_blobs({1: spoiled, 7: b})
    kept = read_blobs(kept_blobs([b"\x00", first, second], frozenset({1, 7})))
    assert kept == {1: a, 7: b}  # the first copy's blob of a holder; others' left out
    assert kept_blobs([first], frozenset({9})) == b""


# -- the keys -------------------------------------------------------------------------------


def test_a_node_keeps_its_last_keys_only_and_opens_with_those_it_held_before() -> None:
    keys = AheadKeys()
    published: list[bytes] = []
    for i in range(RETAINED + 3):
        public, held = keys.rotate(bytes([i]) * 32)
        # what a ready of this round may open: the keys held before this one
        assert set(held) == {key_id(p) for p in published[-RETAINED:]}
        published.append(public)
    # the oldest beyond RETAINED are gone: a share sealed to one of them does not open
    assert keys.held_ids() == {key_id(p) for p in published[-RETAINED:]}
    assert key_id(published[0]) not in keys.held_ids()
    assert all(len(k) == KEY_ID_BYTES for k in keys.held_ids())


def test_a_peer_key_that_is_not_usable_is_never_sealed_to() -> None:
    keys = AheadKeys()
    assert not keys.learn("b", b"\x09" * 31)
    assert keys.learn("b", bytes(32))  # the all-zero point: low order, kept but not used
    assert keys.known(["a", "b"]) == {}
    good = generate_keypair(b"\x05" * 32).public
    assert keys.learn("b", good)
    assert keys.known(["a", "b"]) == {"b": good}


# -- the peer's side ----------------------------------------------------------------------


def _peers(n: int, round: int = 1) -> dict[str, SecAggPeer]:
    orgs = [f"o{i}" for i in range(n)]
    signers, verify = _ed25519_identities(orgs, seed=3)
    config = ProtocolConfig(
        ctx=RoundContext("fed", "run", round),
        participants=tuple(orgs),
        threshold=n // 2 + 1,
        vector_length=4,
    )
    peers = {o: SecAggPeer(config, o, signers[o], verify) for o in orgs}
    adverts = {o: p.advertise_keys() for o, p in peers.items()}
    for o, p in peers.items():
        for other, msg in adverts.items():
            if other != o:
                p.receive_advertise(msg, authenticated=True)
    return peers


def test_shares_sealed_ahead_and_by_the_exchange_are_one_sharing() -> None:
    peers = _peers(5)
    ahead = {o: generate_keypair(bytes([i + 1]) * 32) for i, o in enumerate(peers)}
    sender = peers["o0"]
    sealed = sender.seal_ahead({o: ahead[o].public for o in ("o1", "o2")})
    assert set(sealed) == {"o1", "o2"}
    for o in ("o1", "o2"):
        peers[o].open_ahead("o0", sealed[o], ahead[o].private)
    sender.close_advertise()
    by_exchange = sender.share_keys(only=["o3", "o4"])
    assert set(by_exchange) == {"o3", "o4"}
    for o in ("o3", "o4"):
        peers[o].close_advertise()
        peers[o].receive_shares(by_exchange[o], authenticated=True)
    # any t of the shares, from either path, give back the one secret
    held = [peers[o]._held["o0"][0] for o in ("o1", "o3", "o4")]
    assert shamir.combine(held, 3, len(sender._own().b)) == sender._own().b


def test_shares_sealed_ahead_open_only_for_their_round_pair_and_key() -> None:
    peers, later = _peers(3, round=1), _peers(3, round=2)
    key, other = generate_keypair(b"\x01" * 32), generate_keypair(b"\x02" * 32)
    blob = peers["o0"].seal_ahead({"o1": key.public})["o1"]
    with pytest.raises(InvalidShare):
        peers["o1"].open_ahead("o0", blob, other.private)  # another key
    with pytest.raises(InvalidShare):
        peers["o2"].open_ahead("o0", blob, key.private)  # another recipient
    with pytest.raises(InvalidShare):
        later["o1"].open_ahead("o0", blob, key.private)  # another round
    assert "o0" not in peers["o1"]._held
    peers["o1"].open_ahead("o0", blob, key.private)
    with pytest.raises(DuplicateMessage):
        peers["o1"].open_ahead("o0", blob, key.private)
    with pytest.raises(UnknownSender):
        peers["o1"].open_ahead("o9", blob, key.private)


def test_a_blob_sealed_ahead_is_no_share_message_of_round_one() -> None:
    """The two paths seal under different associated data: a blob sealed ahead, replayed
    as a round-1 ciphertext to the same key, does not open."""
    peers = _peers(3)
    c_key = peers["o1"]._own().c
    blob = peers["o0"].seal_ahead({"o1": c_key.public})["o1"]
    peers["o0"].close_advertise()
    msg = peers["o0"].share_keys(only=["o1"])["o1"]
    forged = dataclasses.replace(msg, ciphertext=blob)
    peers["o1"].close_advertise()
    with pytest.raises(InvalidShare):
        peers["o1"].receive_shares(forged, authenticated=True)


# -- rounds -------------------------------------------------------------------------------


def _check(out: RoundOutcome) -> None:
    assert out.problems() == []
    for res in out.results.values():
        assert (res.sum == out.expected(res.survivors)).all()


def _share_messages(out: RoundOutcome) -> int:
    return sum(c["round.share"] + c["round.share.reply"] for c in out.signed.values())


def test_from_the_second_round_on_the_shares_ride_with_the_readies() -> None:
    n = 6

    async def scenario() -> list[RoundOutcome]:
        async with Simulation(SimConfig(peers=n, length=64, seed=5, round_config=FAST)) as sim:
            return [await sim.round(r) for r in (1, 2, 3)]

    first, *later = asyncio.run(scenario())
    for out in (first, *later):
        _check(out)
        assert len(out.results) == n
    # a first round knows no keys: the shares go by one request per pair
    assert _share_messages(first) == n * (n - 1)
    # then no share message at all, and n (n - 1) / 2 fewer signed messages per round
    for out in later:
        assert _share_messages(out) == 0
        assert out.results.keys() == first.results.keys()
    sent = [sum(r.messages_sent for r in out.results.values()) for out in (first, *later)]
    assert sent[1] <= sent[0] - n * (n - 1) // 2 + n


def _spoiling(relay: ReadyRelay, me: str) -> None:
    """Make ``me`` a relay that spoils the blobs of the records it passes on: one in
    two holders' dropped, the others' ciphertext flipped (its own record untouched).
    The records stay authentic: blobs are neither signed nor tagged, their digests are."""
    send = relay._send

    async def spoiled(ctx: StageContext, dest: str, batch: bytes) -> set[str]:
        step, records = decode_batch(batch)
        out = []
        for rec in records:
            if rec.author != me:
                blobs = {
                    i: Blob(b.key, bytes(x ^ 0xFF for x in b.ciphertext))
                    for i, b in read_blobs(rec.blobs).items()
                    if i % 2
                }
                rec = dataclasses.replace(rec, blobs=encode_blobs(blobs))
            out.append(rec.raw)
        return await send(ctx, dest, encode_batch(step, out))

    relay._send = spoiled  # type: ignore[method-assign]


def test_blobs_a_relay_drops_or_spoils_are_taken_by_a_direct_ready() -> None:
    """The blobs travel beside the signed records, towards their holders only. A relay
    that drops or spoils them costs each holder it cut off one direct ready to the
    blob's author, nothing else: every pair's shares still ride ahead (no share
    message), every member takes part, and the sum is exact."""
    n = 8
    config = dataclasses.replace(FAST, ready_relay_from=4)

    async def scenario() -> list[RoundOutcome]:
        async with Simulation(SimConfig(peers=n, length=64, seed=9, round_config=config)) as sim:
            outs = [await sim.round(r) for r in (1, 2)]
            relay = sim.engines["org-3"]._ready.relay
            assert relay is not None
            _spoiling(relay, "org-3")
            outs.append(await sim.round(3))
            return outs

    first, steady, spoiled = asyncio.run(scenario())
    for out in (first, steady, spoiled):
        _check(out)
        assert len(out.results) == n

    def direct(out: RoundOutcome) -> dict[str, int]:
        return {o: c["round.ready"] for o, c in out.signed.items() if c["round.ready"]}

    # relayed whole, every blob reaches its holder: no direct ready, no share message
    assert direct(steady) == {} and _share_messages(steady) == 0
    # spoiled: the holders it cut off ask the authors directly, and the shares still
    # all ride ahead
    assert direct(spoiled) and "org-3" not in direct(spoiled)
    assert _share_messages(spoiled) == 0


def test_a_node_that_lost_its_keys_gets_and_sends_its_shares_by_the_exchange() -> None:
    """A restart loses the keys (they live in memory only): the restarted node lists
    none, its pairs take the share exchange, the others keep riding, the sum is exact."""
    n = 5

    async def scenario() -> RoundOutcome:
        async with Simulation(SimConfig(peers=n, length=64, seed=6, round_config=FAST)) as sim:
            _check(await sim.round(1))
            sim.engines["org-2"].ahead_keys._own.clear()  # what a restart loses
            return await sim.round(2)

    out = asyncio.run(scenario())
    _check(out)
    assert len(out.results) == n
    by_org = {o: c["round.share"] + c["round.share.reply"] for o, c in out.signed.items()}
    # one request (or reply) each way for each of org-2's four pairs, nothing else
    assert by_org["org-2"] == n - 1
    assert sum(by_org.values()) == 2 * (n - 1)


def test_a_garbled_share_sealed_ahead_costs_its_sender_its_place_never_the_sum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """org-1 seals org-3's shares wrongly in round 2: org-3 cannot open them and asks by
    the exchange; org-1 believes the pair done and sends nothing, so org-3 proposes no
    org-1 and the participants are agreed without it. The sum is the others', exact."""
    n = 5
    seal = SecAggPeer.seal_ahead

    def garbled(self: SecAggPeer, keys: dict[str, bytes]) -> dict[str, bytes]:
        sealed = seal(self, keys)
        if self.me == "org-1" and self.config.ctx.round == 2 and "org-3" in sealed:
            blob = bytearray(sealed["org-3"])
            blob[-1] ^= 1
            sealed["org-3"] = bytes(blob)
        return sealed

    monkeypatch.setattr(SecAggPeer, "seal_ahead", garbled)

    async def scenario() -> RoundOutcome:
        async with Simulation(SimConfig(peers=n, length=64, seed=8, round_config=FAST)) as sim:
            _check(await sim.round(1))
            return await sim.round(2)

    out = asyncio.run(scenario())
    _check(out)
    assert out.completed
    survivors = {frozenset(r.survivors) for r in out.results.values()}
    assert len(survivors) == 1
    (agreed,) = survivors
    assert "org-1" not in agreed and len(agreed) == n - 1
    assert np.array_equal(
        out.results["org-0"].sum, out.expected(agreed)
    )  # the sum of exactly the agreed participants


# -- the participants' decision -------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from([f"o{i}" for i in range(7)]),
        st.frozensets(st.sampled_from([f"o{i}" for i in range(7)])),
        min_size=1,
    )
)
def test_the_participants_decided_hold_each_other_and_are_the_same_on_every_node(
    proposals: dict[str, frozenset[str]],
) -> None:
    # proposals of U1 go unflagged (a flag says the proposer's ring completed)
    entries = tuple((o, p | {o}, False) for o, p in proposals.items())
    members, ok = Token(1, "ready", bytes(32), "o0", entries).decision()
    shuffled, _ = Token(1, "ready", bytes(32), "o0", tuple(reversed(entries))).decision()
    assert not ok and members == shuffled
    # every member decided proposed the whole decision: each holds the others' shares
    mine = {o: p for o, p, _ in entries}
    assert all(o in mine and members <= mine[o] for o in members)
    # never fewer than the intersection of the proposals
    assert len(members) >= len(frozenset(mine).intersection(*mine.values()))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.frozensets(st.sampled_from([f"o{i}" for i in range(6)])), st.booleans()),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from(["ready", "scatter:0"]),
)
def test_a_decoded_token_decides_as_the_token_it_was_encoded_from(
    picks: list[tuple[frozenset[str], bool]], tag: str
) -> None:
    # a decoded token holds each distinct proposal once and intersects it once: the
    # decision is the one every entry's own proposal gives
    entries = tuple((f"o{i}", proposal, flag) for i, (proposal, flag) in enumerate(picks))
    token = Token(1, tag, bytes(32), "o0", entries)
    members = frozenset(o for o, _, _ in entries).intersection(*(p for _, p, _ in entries))
    decided, ok = Token.from_bytes(token.to_bytes()).decision()
    assert (decided, ok) == token.decision()
    flagged = [p for _, p, flag in entries if flag]
    if tag == "ready" and flagged:  # a member whose ring completed decides U1
        assert (decided, ok) == (flagged[0], True)
    elif tag == "ready":  # the larger of the intersection and a mutual set
        assert not ok and len(decided) >= len(members)
    else:
        assert ok == all(flag for _, _, flag in entries)
        assert decided == members


def test_one_member_in_conflict_with_all_is_left_out_rather_than_those_it_proposes_without() -> (
    None
):
    everyone = frozenset(f"o{i}" for i in range(6))
    proposals = {o: everyone - {"o2"} for o in everyone - {"o2"}}
    proposals["o2"] = everyone - {"o4", "o5"}  # it could not exchange shares with these
    assert mutual_set(proposals) == everyone - {"o2"}
    entries = tuple((o, p, False) for o, p in sorted(proposals.items()))
    assert Token(1, "ready", bytes(32), "o0", entries).decision() == (everyone - {"o2"}, False)
    # a ring attempt's outcome keeps the plain intersection
    assert Token(1, "scatter:0", bytes(32), "o0", entries).decision()[0] == everyone - {
        "o2",
        "o4",
        "o5",
    }


def test_a_member_that_equivocates_in_the_share_stage_is_left_out_and_no_one_else() -> None:
    """org-2 sends every other member a garbage share before its real one: they hold two
    different shares from it and propose no org-2; org-2, refused, lacks their shares
    and proposes none of them. The token's decision leaves out org-2 alone (in
    conflict with the most), where the plain intersection would leave out all."""

    async def scenario() -> tuple[RoundOutcome, RoundOutcome]:
        faults = [FaultSpec("org-2", Fault.GARBAGE, "share", round=1)]
        config = SimConfig(peers=6, length=64, seed=7, round_config=FAST)
        async with Simulation(config, faults) as sim:
            return await sim.round(1), await sim.round(2)

    out, after = asyncio.run(scenario())
    _check(out)
    assert set(out.results) == {"org-0", "org-1", "org-3", "org-4", "org-5"}
    for res in out.results.values():
        assert "org-2" not in res.survivors
    _check(after)
    assert len(after.results) == 6


def test_by_default_a_federation_of_three_seals_its_shares_ahead() -> None:
    """``shares_ahead_from`` is 3 by default (docs/SECURITY.md, "Shares sealed a round
    ahead", "from three members on"): with the simulator's defaults, three members
    exchange shares in their first round and none in their second, each share riding
    with its ready."""
    assert RoundConfig().shares_ahead_from == 3

    async def scenario() -> list[RoundOutcome]:
        async with Simulation(SimConfig(peers=3, length=300, seed=4)) as sim:
            return [await sim.round(r) for r in (1, 2)]

    first, second = asyncio.run(scenario())
    for outcome in (first, second):
        assert not outcome.problems() and len(outcome.results) == 3
    shares = [sum(c["round.share"] for c in o.signed.values()) for o in (first, second)]
    assert shares[0] > 0 and shares[1] == 0
