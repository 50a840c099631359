"""The signed message envelope and its canonical binary encoding.

Every protocol message between orgs travels as an :class:`Envelope`: who sends it to
whom, in which federation, run, round and protocol stage, with a per-sender sequence
number and send time (replay and staleness checks, see ``docs/SECURITY.md``), the
opaque payload, and the sender's Ed25519 signature over every other field.

Encoding (``to_wire``), all integers big-endian::

    magic   b"FWE" | version u8 (=1)
    federation, run, stage, kind, sender, recipient : u16 length + UTF-8
    round u64 | seq u64 | sent_at IEEE-754 f64
    payload : u64 length + bytes
    signature : u16 length + bytes

``signing_bytes`` is the domain tag ``b"fedweave/envelope/v1\\x00"`` followed by the same
encoding without the signature, so a signature can never be replayed as a signature
over another kind of object. ``from_wire`` is total: on any input it returns an
envelope or raises :class:`MalformedMessage` / :class:`Oversized`, nothing else.

The encoding is canonical (one encoding per envelope), so a received envelope's
``signing_bytes`` are the bytes it came in, not an encoding built again from its
fields; a sent one's head (everything before the payload) is built once. A payload is
copied twice on each side: into the signed bytes and the wire bytes when sent, out of
the wire bytes and into the signed bytes when received.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from coordinator_free.errors import RefusalReason, Refused

__all__ = [
    "MAX_STRING_BYTES",
    "Envelope",
    "MalformedMessage",
    "Oversized",
    "RefusalReason",
]

MAGIC = b"FWE"
VERSION = 1
SIGNING_DOMAIN = b"fedweave/envelope/v1\x00"
MAX_STRING_BYTES = 0xFFFF
_U64_MAX = (1 << 64) - 1
_STRING_FIELDS = ("federation", "run", "stage", "kind", "sender", "recipient")


class MalformedMessage(Refused):
    """The bytes are not a well-formed envelope."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(RefusalReason.MALFORMED, detail)


class Oversized(Refused):
    """The message is larger than the receiver accepts."""

    def __init__(self, detail: str = "") -> None:
        super().__init__(RefusalReason.OVERSIZED, detail)


@dataclass(frozen=True)
class Envelope:
    """A signed protocol message (see the module docstring for the encoding)."""

    federation: str
    run: str
    round: int
    stage: str
    kind: str
    sender: str
    recipient: str
    seq: int
    sent_at: float
    payload: bytes
    signature: bytes = b""

    def __post_init__(self) -> None:
        for name in _STRING_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"Envelope.{name} must be str, got {type(value).__name__}")
            try:
                encoded = value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"Envelope.{name} is not encodable as UTF-8") from exc
            if len(encoded) > MAX_STRING_BYTES:
                raise ValueError(f"Envelope.{name} is longer than {MAX_STRING_BYTES} bytes")
        for name in ("round", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Envelope.{name} must be int")
            if not 0 <= value <= _U64_MAX:
                raise ValueError(f"Envelope.{name} must be in [0, 2**64)")
        if not isinstance(self.sent_at, float | int) or isinstance(self.sent_at, bool):
            raise TypeError("Envelope.sent_at must be a float")
        if not math.isfinite(self.sent_at):
            raise ValueError("Envelope.sent_at must be finite")
        if not isinstance(self.payload, bytes) or not isinstance(self.signature, bytes):
            raise TypeError("Envelope.payload and Envelope.signature must be bytes")
        if len(self.signature) > MAX_STRING_BYTES:
            raise ValueError("Envelope.signature is too long")

    def _head(self) -> bytes:
        """The encoding up to the payload's bytes (its length included); built once."""
        head: bytes | None = self.__dict__.get("_head_cache")
        if head is None:
            parts = [MAGIC, bytes([VERSION])]
            for name in _STRING_FIELDS:
                encoded = getattr(self, name).encode("utf-8")
                parts.append(struct.pack(">H", len(encoded)))
                parts.append(encoded)
            parts.append(
                struct.pack(">QQdQ", self.round, self.seq, float(self.sent_at), len(self.payload))
            )
            head = b"".join(parts)
            object.__setattr__(self, "_head_cache", head)
        return head

    def signing_bytes(self) -> bytes:
        """Canonical encoding of every field but the signature, domain-separated.

        An envelope read by :meth:`from_wire` takes these bytes from the wire as they
        came (the encoding is canonical, so they equal the fields' encoding): one copy
        of the payload, no encoding built again."""
        wire: bytes | None = self.__dict__.get("_wire")
        if wire is not None:
            body = memoryview(wire)[: len(wire) - 2 - len(self.signature)]
            return b"".join((SIGNING_DOMAIN, body))
        return b"".join((SIGNING_DOMAIN, self._head(), self.payload))

    def to_wire(self) -> bytes:
        """Canonical binary encoding, signature included."""
        sig = self.signature
        return b"".join((self._head(), self.payload, struct.pack(">H", len(sig)), sig))

    def with_signature(self, signature: bytes) -> Envelope:
        """A copy of this envelope carrying ``signature`` (its fields are not checked
        again, and its encoding is not built again)."""
        if not isinstance(signature, bytes) or len(signature) > MAX_STRING_BYTES:
            raise ValueError("Envelope.signature must be bytes of at most 65535")
        copy = object.__new__(Envelope)
        copy.__dict__.update(self.__dict__)
        copy.__dict__.pop("_wire", None)
        object.__setattr__(copy, "signature", signature)
        return copy

    @classmethod
    def from_wire(cls, data: bytes, max_size: int) -> Envelope:
        """Decode ``data``; raise :class:`Oversized` or :class:`MalformedMessage`.

        The size check comes first, so an oversized message is never parsed. The
        payload is the one copy made of the data; the fields parsed are those the
        constructor would check, so they are not checked twice.
        """
        if len(data) > max_size:
            raise Oversized(f"{len(data)} bytes > limit {max_size}")
        if not isinstance(data, bytes):
            data = bytes(data)
        if data[:3] != MAGIC:
            raise MalformedMessage("bad magic")
        if len(data) < 4:
            raise MalformedMessage("truncated")
        if data[3] != VERSION:
            raise MalformedMessage(f"unknown version {data[3]}")
        fields: dict[str, object] = {}
        pos = 4
        try:
            for name in _STRING_FIELDS:
                (size,) = _U16.unpack_from(data, pos)
                end = pos + 2 + size
                if end > len(data):
                    raise MalformedMessage("truncated")
                try:
                    fields[name] = data[pos + 2 : end].decode("utf-8")
                except UnicodeDecodeError:
                    raise MalformedMessage(f"{name} is not UTF-8") from None
                pos = end
            round_, seq, sent_at, size = _NUMBERS.unpack_from(data, pos)
            pos += _NUMBERS.size
            body_end = pos + size
            if body_end + 2 > len(data):
                raise MalformedMessage("truncated")
            (sig_size,) = _U16.unpack_from(data, body_end)
        except struct.error:
            raise MalformedMessage("truncated") from None
        if body_end + 2 + sig_size != len(data):
            if body_end + 2 + sig_size > len(data):
                raise MalformedMessage("truncated")
            raise MalformedMessage(f"{len(data) - body_end - 2 - sig_size} trailing bytes")
        if not math.isfinite(sent_at):
            raise MalformedMessage("Envelope.sent_at must be finite")
        fields.update(
            round=round_,
            seq=seq,
            sent_at=sent_at,
            payload=data[pos:body_end],
            signature=data[body_end + 2 :],
            _wire=data,
        )
        env = object.__new__(cls)
        env.__dict__.update(fields)
        return env


_U16 = struct.Struct(">H")
_NUMBERS = struct.Struct(">QQdQ")  # round, seq, sent_at, payload length
