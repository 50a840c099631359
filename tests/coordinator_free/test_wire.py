"""Envelope encoding: fixed vectors, round trips, and totality of ``from_wire``."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.identity import OrgIdentity, verify_signature
from coordinator_free.wire import Envelope, MalformedMessage, Oversized
from hypothesis import given, settings
from hypothesis import strategies as st

VECTORS = json.loads(
    (Path(__file__).resolve().parents[1] / "vectors" / "coordinator_free_envelope.json").read_text()
)
BIG = 1 << 20


def _fields(raw: dict[str, Any]) -> dict[str, Any]:
    return raw | {"payload": bytes.fromhex(raw["payload"])}


@pytest.mark.parametrize("vector", VECTORS["valid"], ids=lambda v: v["fields"]["kind"])
def test_valid_vectors_are_byte_exact(vector: dict[str, Any]) -> None:
    seed = bytes.fromhex(VECTORS["identity"]["seed"])
    ident = OrgIdentity.generate(VECTORS["identity"]["org_id"], seed)
    env = Envelope(**_fields(vector["fields"]))
    assert env.signing_bytes().hex() == vector["signing_bytes"]
    signed = env.with_signature(ident.sign(env.signing_bytes()))
    assert signed.signature.hex() == vector["signature"]
    assert signed.to_wire().hex() == vector["wire"]
    decoded = Envelope.from_wire(bytes.fromhex(vector["wire"]), BIG)
    assert decoded == signed
    assert verify_signature(ident.public_key, decoded.signing_bytes(), decoded.signature)


@pytest.mark.parametrize("vector", VECTORS["invalid"], ids=lambda v: v["id"])
def test_invalid_vectors_are_refused_as_malformed(vector: dict[str, Any]) -> None:
    with pytest.raises(MalformedMessage) as info:
        Envelope.from_wire(bytes.fromhex(vector["wire"]), BIG)
    assert info.value.reason.value == vector["reason"]


def test_size_is_checked_before_parsing() -> None:
    wire = bytes.fromhex(VECTORS["valid"][1]["wire"])
    assert Envelope.from_wire(wire, len(wire)).payload == bytes(range(16))
    with pytest.raises(Oversized) as info:
        Envelope.from_wire(wire, len(wire) - 1)
    assert info.value.reason is RefusalReason.OVERSIZED
    with pytest.raises(Oversized):
        Envelope.from_wire(b"\x00" * 100, 99)


def test_signature_covers_every_field() -> None:
    base = Envelope(**_fields(VECTORS["valid"][1]["fields"]))
    changes: dict[str, Any] = {
        "federation": "fed-2",
        "run": "run-8",
        "round": 43,
        "stage": "reduce",
        "kind": "round.go",
        "sender": "org-x",
        "recipient": "org-y",
        "seq": base.seq + 1,
        "sent_at": base.sent_at + 1,
        "payload": b"other",
    }
    seen = {base.signing_bytes()}
    for name, value in changes.items():
        other = dataclasses.replace(base, **{name: value})
        assert other.signing_bytes() not in seen, name
        seen.add(other.signing_bytes())


def test_field_boundaries_are_unambiguous() -> None:
    a = Envelope("ab", "c", 0, "", "k", "s", "r", 1, 0.0, b"")
    b = Envelope("a", "bc", 0, "", "k", "s", "r", 1, 0.0, b"")
    assert a.signing_bytes() != b.signing_bytes()


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("round", -1, ValueError),
        ("seq", 1 << 64, ValueError),
        ("seq", True, TypeError),
        ("sent_at", math.nan, ValueError),
        ("sent_at", math.inf, ValueError),
        ("kind", "x" * 70000, ValueError),
        ("sender", "\udc80", ValueError),
        ("payload", "text", TypeError),
        ("run", None, TypeError),
    ],
)
def test_constructor_rejects_unencodable_fields(field: str, value: Any, error: type) -> None:
    fields = _fields(VECTORS["valid"][0]["fields"]) | {field: value}
    with pytest.raises(error):
        Envelope(**fields)


_text = st.text(st.characters(codec="utf-8"), max_size=40)
_u64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
envelopes = st.builds(
    Envelope,
    federation=_text,
    run=_text,
    round=_u64,
    stage=_text,
    kind=_text,
    sender=_text,
    recipient=_text,
    seq=_u64,
    sent_at=st.floats(allow_nan=False, allow_infinity=False),
    payload=st.binary(max_size=512),
    signature=st.binary(max_size=80),
)


@given(envelopes)
def test_round_trip(env: Envelope) -> None:
    wire = env.to_wire()
    assert Envelope.from_wire(wire, len(wire)) == env
    assert Envelope.from_wire(wire, len(wire)).to_wire() == wire


@given(envelopes, st.binary(min_size=1, max_size=80))
def test_an_envelope_read_from_the_wire_signs_as_its_fields_built_anew(
    env: Envelope, signature: bytes
) -> None:
    """What a receiver verifies is taken from the wire as it came, not built again:
    it must equal what the sender signed, the encoding of the same fields built anew;
    and a signature set on a copy leaves the fields, and their encoding, as they were."""
    read = Envelope.from_wire(env.to_wire(), BIG)
    anew = dataclasses.replace(env)
    assert read.signing_bytes() == anew.signing_bytes() == env.signing_bytes()
    signed = read.with_signature(signature)
    assert signed.signature == signature and read.signature == env.signature
    assert signed.signing_bytes() == anew.signing_bytes()
    assert signed.to_wire() == dataclasses.replace(env, signature=signature).to_wire()
    with pytest.raises(ValueError):
        env.with_signature(bytes(70_000))


@given(st.binary(max_size=600))
def test_from_wire_on_random_bytes_only_refuses(data: bytes) -> None:
    try:
        env = Envelope.from_wire(data, 512)
    except Refused as exc:
        assert type(exc) in (MalformedMessage, Oversized)
        assert exc.reason is (
            RefusalReason.OVERSIZED if len(data) > 512 else RefusalReason.MALFORMED
        )
    else:
        assert env.to_wire() == data


@settings(max_examples=200)
@given(envelopes, st.data())
def test_from_wire_on_mutated_envelopes_only_refuses(env: Envelope, data: st.DataObject) -> None:
    wire = bytearray(env.to_wire())
    index = data.draw(st.integers(min_value=0, max_value=len(wire) - 1))
    wire[index] ^= data.draw(st.integers(min_value=1, max_value=255))
    cut = data.draw(st.integers(min_value=0, max_value=len(wire)))
    for candidate in (bytes(wire), bytes(wire[:cut])):
        try:
            decoded = Envelope.from_wire(candidate, BIG)
        except MalformedMessage:
            continue
        assert decoded.to_wire() == candidate
