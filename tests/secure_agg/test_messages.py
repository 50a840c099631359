"""Canonical encoding of the masked-sum protocol messages: round trips, vectors, fuzzing."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from secure_agg.errors import ProtocolError
from secure_agg.keys import RoundContext
from secure_agg.messages import (
    SIGNING_DOMAIN,
    VERSION,
    AdvertiseKeys,
    Header,
    MalformedMessage,
    Message,
    ShareKeys,
    Stage,
    UnmaskShares,
    decode,
)
from secure_agg.shamir import PRIME, Share

VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "secagg_messages.json"
CTX = RoundContext("fed-α", "run-1", 7)


def _sign(data: bytes) -> bytes:
    return hmac.new(b"test-key", data, hashlib.sha256).digest()


def _advertise(sender: str = "org-a") -> AdvertiseKeys:
    return AdvertiseKeys(
        Header(CTX, Stage.ADVERTISE_KEYS, sender),
        c_pk=bytes(range(32)),
        s_pk=bytes(range(32, 64)),
        b_commitment=bytes(range(64, 96)),
    ).signed(_sign)


def _share_keys() -> ShareKeys:
    return ShareKeys(
        Header(CTX, Stage.SHARE_KEYS, "org-a"), recipient="org-b", ciphertext=b"\x01" * 164
    ).signed(_sign)


def _unmask() -> UnmaskShares:
    return UnmaskShares(
        Header(CTX, Stage.UNMASK, "org-b"),
        survivors=("org-a", "org-b"),
        received_from=("org-a", "org-b", "org-c"),
        b_shares=(("org-a", Share(2, 12345)), ("org-b", Share(2, PRIME - 1))),
        s_shares=(("org-c", Share(2, 0)),),
    ).signed(_sign)


SAMPLES: dict[str, Callable[[], Message]] = {
    "advertise": _advertise,
    "share_keys": _share_keys,
    "unmask": _unmask,
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_round_trip_is_exact(name: str) -> None:
    msg = SAMPLES[name]()
    wire = msg.to_bytes()
    back = decode(wire)
    assert back == msg
    assert type(back).from_bytes(wire) == msg
    assert back.to_bytes() == wire
    assert wire[0] == VERSION
    assert back.signed_payload() == SIGNING_DOMAIN + wire[: len(wire) - 2 - len(msg.signature)]


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_vectors_are_byte_exact(name: str) -> None:
    vectors = json.loads(VECTORS.read_text())
    assert SAMPLES[name]().to_bytes().hex() == vectors[name]["wire"]
    assert decode(bytes.fromhex(vectors[name]["wire"])).sender == vectors[name]["sender"]


def test_from_bytes_refuses_another_type() -> None:
    with pytest.raises(MalformedMessage, match="expected a ShareKeys"):
        ShareKeys.from_bytes(_advertise().to_bytes())


def test_signature_covers_every_field() -> None:
    base = _unmask()
    variants: list[Message] = [
        UnmaskShares(
            Header(RoundContext("fed-α", "run-1", 8), Stage.UNMASK, "org-b"),
            survivors=base.survivors,
            received_from=base.received_from,
            b_shares=base.b_shares,
            s_shares=base.s_shares,
        ),
        UnmaskShares(
            base.header,
            survivors=("org-a",),
            received_from=base.received_from,
            b_shares=(("org-a", Share(2, 12345)),),
            s_shares=base.s_shares,
        ),
        UnmaskShares(
            base.header,
            survivors=base.survivors,
            received_from=base.received_from,
            b_shares=(("org-a", Share(2, 12346)), ("org-b", Share(2, PRIME - 1))),
            s_shares=base.s_shares,
        ),
    ]
    payloads = {base.signed_payload()} | {v.signed_payload() for v in variants}
    assert len(payloads) == 1 + len(variants)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda w: bytes([VERSION + 1]) + w[1:], "unsupported message version"),
        (lambda w: w[:1] + b"\x09" + w[2:], "unknown message stage"),
        (lambda w: w[:-1], "truncated"),
        (lambda w: w + b"\x00", "trailing bytes"),
        (lambda w: b"", "truncated"),
    ],
    ids=["version", "stage", "truncated", "trailing", "empty"],
)
def test_bad_framing_is_malformed(mutate: Callable[[bytes], bytes], match: str) -> None:
    wire = _advertise().to_bytes()
    with pytest.raises(MalformedMessage, match=match):
        decode(mutate(wire))


def test_non_canonical_lists_are_refused() -> None:
    h = Header(CTX, Stage.UNMASK, "org-b")
    with pytest.raises(MalformedMessage, match="sorted"):
        UnmaskShares(h, survivors=("org-b", "org-a"), received_from=(), b_shares=(), s_shares=())
    with pytest.raises(MalformedMessage, match="sorted"):
        UnmaskShares(h, survivors=("a", "a"), received_from=(), b_shares=(), s_shares=())
    with pytest.raises(MalformedMessage, match="both kinds"):
        UnmaskShares(
            h,
            survivors=("a",),
            received_from=("a",),
            b_shares=(("a", Share(1, 1)),),
            s_shares=(("a", Share(1, 2)),),
        )


def test_field_validation() -> None:
    with pytest.raises(MalformedMessage, match="c_pk"):
        AdvertiseKeys(
            Header(CTX, Stage.ADVERTISE_KEYS, "a"),
            c_pk=b"x",
            s_pk=bytes(32),
            b_commitment=bytes(32),
        )
    with pytest.raises(MalformedMessage, match="distinct"):
        AdvertiseKeys(
            Header(CTX, Stage.ADVERTISE_KEYS, "a"),
            c_pk=bytes(32),
            s_pk=bytes(32),
            b_commitment=bytes(32),
        )
    with pytest.raises(MalformedMessage, match="own sender"):
        ShareKeys(Header(CTX, Stage.SHARE_KEYS, "a"), recipient="a", ciphertext=b"x")
    with pytest.raises(MalformedMessage, match="belongs to stage"):
        ShareKeys(Header(CTX, Stage.UNMASK, "a"), recipient="b", ciphertext=b"x")
    with pytest.raises(MalformedMessage, match="no message belongs"):
        Header(CTX, Stage.DONE, "a")
    with pytest.raises(MalformedMessage, match="sender"):
        Header(CTX, Stage.UNMASK, "")


def test_malformed_is_a_protocol_error() -> None:
    assert issubclass(MalformedMessage, ProtocolError)


def test_invalid_utf8_and_bad_share_are_malformed() -> None:
    wire = bytearray(_advertise("org-a").to_bytes())
    pos = wire.index(b"org-a")
    wire[pos] = 0xFF
    with pytest.raises(MalformedMessage, match="UTF-8"):
        decode(bytes(wire))
    unmask = _unmask().to_bytes()
    share_at = unmask.index(Share(2, PRIME - 1).to_bytes())
    bad = unmask[:share_at] + b"\x00\x02" + b"\xff" * 66 + unmask[share_at + 68 :]
    with pytest.raises(MalformedMessage, match="share"):
        decode(bad)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_fuzz_random_bytes_only_raise_malformed(data: bytes) -> None:
    try:
        msg = decode(data)
    except MalformedMessage:
        return
    assert msg.to_bytes() == data


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(sorted(SAMPLES)),
    st.integers(min_value=0, max_value=10_000),
    st.integers(min_value=0, max_value=255),
    st.sampled_from(["flip", "cut", "insert"]),
)
def test_fuzz_mutated_messages(name: str, pos: int, byte: int, how: str) -> None:
    wire = SAMPLES[name]().to_bytes()
    i = pos % len(wire)
    if how == "flip":
        mutated = wire[:i] + bytes([wire[i] ^ (byte or 1)]) + wire[i + 1 :]
    elif how == "cut":
        mutated = wire[:i]
    else:
        mutated = wire[:i] + bytes([byte]) + wire[i:]
    try:
        msg = decode(mutated)
    except MalformedMessage:
        return
    # whatever still parses re-encodes to exactly the same bytes (one encoding per message)
    assert msg.to_bytes() == mutated
    assert msg != SAMPLES[name]()


@settings(max_examples=100, deadline=None)
@given(
    survivors=st.lists(
        st.text(st.characters(codec="utf-8"), min_size=1, max_size=8), max_size=6, unique=True
    ),
    ys=st.lists(st.integers(min_value=0, max_value=PRIME - 1), max_size=6),
    rnd=st.integers(min_value=0, max_value=2**64 - 1),
)
def test_unmask_round_trip_property(survivors: list[str], ys: list[int], rnd: int) -> None:
    orgs = tuple(sorted(survivors))
    shares = tuple((o, Share(3, y)) for o, y in zip(orgs, ys, strict=False))
    msg = UnmaskShares(
        Header(RoundContext("f", "r", rnd), Stage.UNMASK, "holder"),
        survivors=orgs,
        received_from=orgs,
        b_shares=shares,
        s_shares=(),
        signature=b"sig",
    )
    assert decode(msg.to_bytes()) == msg


def _read(read: Callable[[], AdvertiseKeys]) -> AdvertiseKeys | str:
    """The message ``read`` returns, or the text of the MalformedMessage it raises."""
    try:
        return read()
    except MalformedMessage as exc:
        return str(exc)


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["flip", "cut", "insert", "none"]),
    st.integers(min_value=0, max_value=10_000),
    st.integers(min_value=0, max_value=255),
    st.sampled_from(["org-a", "org-b", "org-a\x00"]),
)
def test_an_advertisement_read_under_its_expected_header_is_what_from_bytes_reads(
    how: str, pos: int, byte: int, expected: str
) -> None:
    # the receiver's shortcut (the header's bytes compared, not parsed) gives the
    # same message or the same refusal as the full parse, for any bytes
    wire = _advertise().to_bytes()
    i = pos % len(wire)
    if how == "flip":
        wire = wire[:i] + bytes([wire[i] ^ (byte or 1)]) + wire[i + 1 :]
    elif how == "cut":
        wire = wire[:i]
    elif how == "insert":
        wire = wire[:i] + bytes([byte]) + wire[i:]
    header = Header(CTX, Stage.ADVERTISE_KEYS, expected)
    under = _read(lambda: AdvertiseKeys.from_bytes_under(wire, header))
    assert under == _read(lambda: AdvertiseKeys.from_bytes(wire))
    if isinstance(under, AdvertiseKeys):
        assert under.to_bytes() == wire
        assert under.signed_payload() == AdvertiseKeys.from_bytes(wire).signed_payload()


def test_an_advertisement_with_equal_keys_is_refused_under_its_header_too() -> None:
    good = _advertise()
    wire = good.to_bytes()
    head = good.header.encoded()
    same = wire[: len(head)] + good.c_pk + good.c_pk + wire[len(head) + 64 :]
    with pytest.raises(MalformedMessage, match="distinct"):
        AdvertiseKeys.from_bytes_under(same, good.header)
