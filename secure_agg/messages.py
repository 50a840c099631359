"""Wire messages of the serverless masked-sum protocol, with a canonical binary encoding.

The three messages follow the rounds of Bonawitz et al., *Practical Secure
Aggregation for Privacy-Preserving Machine Learning*, CCS'17, §4 (Fig. 4), with the
server removed: AdvertiseKeys (round 0), ShareKeys (round 1) and UnmaskShares
(round 4). Masked vectors (round 2) are plain ring arrays summed by the overlay, and
are not messages here.

Encoding (all integers big-endian)::

    u8 version | u8 stage | str federation | str run | u64 round | str sender
    | body | bytes signature

where ``str`` is ``u16 length || UTF-8`` (non-empty) and ``bytes`` is
``u16 length || raw`` (``u32`` for the ShareKeys ciphertext). The signature covers
``SIGNING_DOMAIN || everything before it``. Lists inside a body are sorted and free
of duplicates, so every message has exactly one encoding; :func:`decode` and every
``from_bytes`` raise :class:`MalformedMessage` on anything else, trailing bytes
included.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import IntEnum
from itertools import pairwise
from typing import Any, ClassVar, TypeVar

from secure_agg.errors import ProtocolError, SecAggError
from secure_agg.keys import RoundContext
from secure_agg.shamir import Share

__all__ = [
    "SIGNING_DOMAIN",
    "VERSION",
    "AdvertiseKeys",
    "Header",
    "MalformedMessage",
    "Message",
    "ShareKeys",
    "Stage",
    "UnmaskShares",
    "decode",
]

VERSION = 1
SIGNING_DOMAIN = b"fedweave/secagg/msg/v1\x00"
_KEY_LEN = 32
_SHARE_LEN = 68
_MAX_ID_BYTES = 1024


class MalformedMessage(ProtocolError, ValueError):
    """Bytes that are not the canonical encoding of a message, or a field out of range."""


class Stage(IntEnum):
    """Stages of a peer's state machine; the first, second and fourth name messages too."""

    ADVERTISE_KEYS = 1
    SHARE_KEYS = 2
    MASKED_INPUT = 3
    UNMASK = 4
    DONE = 5
    ABORTED = 6


_MESSAGE_STAGES = (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.UNMASK)


class _Writer:
    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def u8(self, v: int) -> None:
        self._parts.append(struct.pack(">B", v))

    def u16(self, v: int) -> None:
        self._parts.append(struct.pack(">H", v))

    def u64(self, v: int) -> None:
        self._parts.append(struct.pack(">Q", v))

    def raw(self, b: bytes) -> None:
        self._parts.append(b)

    def blob16(self, b: bytes) -> None:
        self.u16(len(b))
        self._parts.append(b)

    def blob32(self, b: bytes) -> None:
        self._parts.append(struct.pack(">I", len(b)))
        self._parts.append(b)

    def text(self, s: str) -> None:
        self.blob16(s.encode("utf-8"))

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def take(self, n: int, what: str) -> bytes:
        end = self._pos + n
        if end > len(self._data):
            raise MalformedMessage(f"truncated message: {what} needs {n} bytes")
        out = self._data[self._pos : end]
        self._pos = end
        return out

    def u8(self, what: str) -> int:
        return int(self.take(1, what)[0])

    def u16(self, what: str) -> int:
        return int(struct.unpack(">H", self.take(2, what))[0])

    def u32(self, what: str) -> int:
        return int(struct.unpack(">I", self.take(4, what))[0])

    def u64(self, what: str) -> int:
        return int(struct.unpack(">Q", self.take(8, what))[0])

    def blob16(self, what: str) -> bytes:
        return self.take(self.u16(what), what)

    def blob32(self, what: str) -> bytes:
        return self.take(self.u32(what), what)

    def text(self, what: str) -> str:
        (s,) = self.texts(1, what)
        _check_id(s, what)
        return s

    def texts(self, count: int, what: str) -> tuple[str, ...]:
        """``count`` strings as :meth:`text` writes them, in one pass.

        Only UTF-8 decoding is checked here: a list read this way goes into a message
        whose ``__post_init__`` checks every name (``_check_sorted_unique``), so each
        name is validated once rather than twice.
        """
        data, pos, end = self._data, self._pos, len(self._data)
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 2 > end:
                raise MalformedMessage(f"truncated message: {what} needs 2 bytes")
            stop = pos + 2 + ((data[pos] << 8) | data[pos + 1])
            if stop > end:
                raise MalformedMessage(f"truncated message: {what} needs {stop - pos - 2} bytes")
            try:
                append(data[pos + 2 : stop].decode("utf-8"))
            except UnicodeDecodeError:
                raise MalformedMessage(f"{what} is not valid UTF-8") from None
            pos = stop
        self._pos = pos
        return tuple(out)

    def consumed(self) -> bytes:
        return self._data[: self._pos]

    def end(self) -> None:
        if self._pos != len(self._data):
            raise MalformedMessage(
                f"{len(self._data) - self._pos} trailing bytes after the message"
            )


def _check_id(s: object, what: str) -> None:
    if not isinstance(s, str) or not s:
        raise MalformedMessage(f"{what} must be a non-empty string")
    if len(s) * 4 <= _MAX_ID_BYTES and s.isascii():
        return
    try:
        n = len(s.encode("utf-8"))
    except UnicodeEncodeError:
        raise MalformedMessage(f"{what} is not encodable as UTF-8") from None
    if n > _MAX_ID_BYTES:
        raise MalformedMessage(f"{what} is longer than {_MAX_ID_BYTES} bytes")


def _check_sorted_unique(items: tuple[str, ...], what: str) -> None:
    for s in items:
        # the common case (a short ASCII id) inline; anything else gets the full check
        if not (isinstance(s, str) and s and len(s) * 4 <= _MAX_ID_BYTES and s.isascii()):
            _check_id(s, what)
    if any(a >= b for a, b in pairwise(items)):
        raise MalformedMessage(f"{what} must be sorted and free of duplicates")


@functools.lru_cache(maxsize=64)
def _header_prefix(ctx: RoundContext, stage: Stage) -> bytes:
    """A header's bytes before its sender: the same for every member's message of one
    stage of one round (a receiver reads every member's advertisement each round)."""
    w = _Writer()
    w.u8(VERSION)
    w.u8(int(stage))
    w.text(ctx.federation)
    w.text(ctx.run)
    w.u64(ctx.round)
    return w.getvalue()


@dataclass(frozen=True)
class Header:
    """What every message starts with: the round, the stage it belongs to, its sender."""

    ctx: RoundContext
    stage: Stage
    sender: str

    def __post_init__(self) -> None:
        if not isinstance(self.ctx, RoundContext):
            raise MalformedMessage("header ctx must be a RoundContext")
        if self.stage not in _MESSAGE_STAGES:
            raise MalformedMessage(f"no message belongs to stage {self.stage!r}")
        _check_id(self.sender, "sender")
        _check_id(self.ctx.federation, "federation")
        _check_id(self.ctx.run, "run")
        if not isinstance(self.ctx.round, int) or not 0 <= self.ctx.round < 2**64:
            raise MalformedMessage("round must be an integer in [0, 2**64)")

    def encoded(self) -> bytes:
        """The header's bytes, as every message under it starts."""
        w = _Writer()
        self._write(w)
        return w.getvalue()

    def _write(self, w: _Writer) -> None:
        w.raw(_header_prefix(self.ctx, self.stage))
        w.text(self.sender)

    @classmethod
    def _read(cls, r: _Reader) -> Header:
        version = r.u8("version")
        if version != VERSION:
            raise MalformedMessage(
                f"unsupported message version {version} (this build speaks {VERSION})"
            )
        stage_byte = r.u8("stage")
        if stage_byte not in {int(s) for s in _MESSAGE_STAGES}:
            raise MalformedMessage(f"unknown message stage {stage_byte}")
        federation = r.text("federation")
        run = r.text("run")
        rnd = r.u64("round")
        sender = r.text("sender")
        try:
            ctx = RoundContext(federation=federation, run=run, round=rnd)
        except (SecAggError, ValueError, TypeError) as exc:
            raise MalformedMessage(f"invalid round context: {exc}") from None
        return cls(ctx=ctx, stage=Stage(stage_byte), sender=sender)


_M = TypeVar("_M", bound="Message")


@dataclass(frozen=True)
class Message:
    """Base of the three messages: a header, a body, and the sender's signature."""

    STAGE: ClassVar[Stage]

    header: Header
    signature: bytes = field(default=b"", kw_only=True)
    _unsigned_cache: bytes | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.header, Header):
            raise MalformedMessage("header must be a Header")
        if self.header.stage is not self.STAGE:
            raise MalformedMessage(
                f"{type(self).__name__} belongs to stage {self.STAGE.name}, header says {self.header.stage.name}"
            )
        if not isinstance(self.signature, bytes) or len(self.signature) > 0xFFFF:
            raise MalformedMessage("signature must be at most 65535 bytes")
        self._check_body()

    @property
    def sender(self) -> str:
        return self.header.sender

    @property
    def ctx(self) -> RoundContext:
        return self.header.ctx

    def _check_body(self) -> None:
        raise NotImplementedError

    def _write_body(self, w: _Writer) -> None:
        raise NotImplementedError

    @classmethod
    def _read_body(cls, r: _Reader) -> dict[str, Any]:
        raise NotImplementedError

    def _unsigned(self) -> bytes:
        if self._unsigned_cache is None:
            w = _Writer()
            self.header._write(w)
            self._write_body(w)
            object.__setattr__(self, "_unsigned_cache", w.getvalue())
        assert self._unsigned_cache is not None
        return self._unsigned_cache

    def signed_payload(self) -> bytes:
        """The bytes the sender signs: a domain label and every encoded field but the signature."""
        return SIGNING_DOMAIN + self._unsigned()

    def signed(self: _M, sign: Callable[[bytes], bytes]) -> _M:
        """A copy carrying ``sign(self.signed_payload())`` as its signature."""
        return replace(self, signature=sign(self.signed_payload()))

    def to_bytes(self) -> bytes:
        w = _Writer()
        w.raw(self._unsigned())
        w.blob16(self.signature)
        return w.getvalue()

    @classmethod
    def from_bytes(cls: type[_M], data: bytes) -> _M:
        msg = decode(data)
        if not isinstance(msg, cls):
            raise MalformedMessage(f"expected a {cls.__name__}, got a {type(msg).__name__}")
        return msg


@dataclass(frozen=True)
class AdvertiseKeys(Message):
    """Round 0: the sender's two X25519 public keys and a commitment to its self-mask seed.

    c_pk: key for the authenticated encryption of Shamir shares sent to the sender.
    s_pk: key from which pairwise mask seeds s_ij are agreed (Bonawitz §4, round 0).
    b_commitment: ``shamir.commitment(b_i)``, so that a reconstructed self-mask seed is checked.
    """

    STAGE: ClassVar[Stage] = Stage.ADVERTISE_KEYS

    c_pk: bytes
    s_pk: bytes
    b_commitment: bytes

    def _check_body(self) -> None:
        for name in ("c_pk", "s_pk", "b_commitment"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != _KEY_LEN:
                raise MalformedMessage(f"{name} must be {_KEY_LEN} bytes")
        if self.c_pk == self.s_pk:
            raise MalformedMessage("c_pk and s_pk must be distinct keys")

    def _write_body(self, w: _Writer) -> None:
        w.raw(self.c_pk)
        w.raw(self.s_pk)
        w.raw(self.b_commitment)

    @classmethod
    def from_bytes_under(cls, data: bytes, header: Header) -> AdvertiseKeys:
        """:meth:`from_bytes` of an advertisement expected under ``header``, as every
        honest member's is: when ``data`` starts with that header's bytes and has the
        length of a body and a signature, the body is read and the header is not
        parsed again (a receiver reads every member's advertisement each round);
        anything else is read by :meth:`from_bytes`. Same message, same errors."""
        head = header.encoded()
        body = len(head) + 3 * _KEY_LEN
        if isinstance(data, bytes) and data[: len(head)] == head and len(data) >= body + 2:
            size = (data[body] << 8) | data[body + 1]
            if body + 2 + size == len(data):
                keys = [data[i : i + _KEY_LEN] for i in range(len(head), body, _KEY_LEN)]
                msg = cls(
                    header,
                    c_pk=keys[0],
                    s_pk=keys[1],
                    b_commitment=keys[2],
                    signature=data[body + 2 :],
                )
                object.__setattr__(msg, "_unsigned_cache", data[:body])
                return msg
        return cls.from_bytes(data)

    @classmethod
    def _read_body(cls, r: _Reader) -> dict[str, Any]:
        c_pk = r.take(_KEY_LEN, "c_pk")
        s_pk = r.take(_KEY_LEN, "s_pk")
        b_commitment = r.take(_KEY_LEN, "b_commitment")
        return {"c_pk": c_pk, "s_pk": s_pk, "b_commitment": b_commitment}


@dataclass(frozen=True)
class ShareKeys(Message):
    """Round 1, to one recipient: AES-GCM encryption of the sender's shares for it.

    The plaintext is ``share(b_sender) || share(s_sk_sender)`` (two fixed-size
    :class:`~secure_agg.shamir.Share` encodings); the AAD binds the round, the sender
    and the recipient (:func:`secure_agg.protocol.share_aad`).
    """

    STAGE: ClassVar[Stage] = Stage.SHARE_KEYS

    recipient: str
    ciphertext: bytes

    def _check_body(self) -> None:
        _check_id(self.recipient, "recipient")
        if self.recipient == self.header.sender:
            raise MalformedMessage("a ShareKeys message cannot be addressed to its own sender")
        if (
            not isinstance(self.ciphertext, bytes)
            or not self.ciphertext
            or len(self.ciphertext) > 2**20
        ):
            raise MalformedMessage("ciphertext must be 1 byte to 1 MiB")

    def _write_body(self, w: _Writer) -> None:
        w.text(self.recipient)
        w.blob32(self.ciphertext)

    @classmethod
    def _read_body(cls, r: _Reader) -> dict[str, Any]:
        recipient = r.text("recipient")
        ciphertext = r.blob32("ciphertext")
        return {"recipient": recipient, "ciphertext": ciphertext}


def _check_share_list(items: tuple[tuple[str, Share], ...], what: str) -> None:
    if not isinstance(items, tuple):
        raise MalformedMessage(f"{what} must be a tuple of (org, Share) pairs")
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[1], Share):
            raise MalformedMessage(f"{what} must hold (org, Share) pairs")
    _check_sorted_unique(tuple(org for org, _ in items), f"{what} owners")


@dataclass(frozen=True)
class UnmaskShares(Message):
    """Round 4: the Shamir shares the sender releases, answering one survivor set.

    survivors: U3 as the sender was told it (sorted); the signature binds the answer to it.
    received_from: the sender's U2 view, the orgs whose ShareKeys it received (itself
        included) and thus the dropped orgs it masked with; a receiver holding the
        survivors' agreed views refuses one that differs from the sender's.
    b_shares: (owner, share of b_owner) for owners in U3.
    s_shares: (owner, share of s_sk_owner) for owners dropped after sharing keys.
    No owner appears in both lists (Bonawitz §4: releasing both reveals x_owner).
    """

    STAGE: ClassVar[Stage] = Stage.UNMASK

    survivors: tuple[str, ...]
    received_from: tuple[str, ...]
    b_shares: tuple[tuple[str, Share], ...]
    s_shares: tuple[tuple[str, Share], ...]

    def _check_body(self) -> None:
        for name in ("survivors", "received_from"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                raise MalformedMessage(f"{name} must be a tuple")
            _check_sorted_unique(value, name)
        if len(self.survivors) > 0xFFFF or len(self.received_from) > 0xFFFF:
            raise MalformedMessage("at most 65535 orgs per list")
        _check_share_list(self.b_shares, "b_shares")
        _check_share_list(self.s_shares, "s_shares")
        both = {o for o, _ in self.b_shares} & {o for o, _ in self.s_shares}
        if both:
            raise MalformedMessage(f"both kinds of share released for {sorted(both)}")

    def _write_body(self, w: _Writer) -> None:
        for orgs in (self.survivors, self.received_from):
            w.u16(len(orgs))
            for org in orgs:
                w.text(org)
        for shares in (self.b_shares, self.s_shares):
            w.u16(len(shares))
            for org, share in shares:
                w.text(org)
                w.blob16(share.to_bytes())

    @classmethod
    def _read_body(cls, r: _Reader) -> dict[str, Any]:
        lists: list[tuple[str, ...]] = []
        for what in ("survivors", "received_from"):
            lists.append(r.texts(r.u16(what), what))
        share_lists: list[tuple[tuple[str, Share], ...]] = []
        for what in ("b_shares", "s_shares"):
            count = r.u16(what)
            items: list[tuple[str, Share]] = []
            for _ in range(count):
                (owner,) = r.texts(1, f"{what} owner")
                raw = r.blob16(f"{what} share")
                if len(raw) != _SHARE_LEN:
                    raise MalformedMessage(
                        f"{what} share must be {_SHARE_LEN} bytes, got {len(raw)}"
                    )
                try:
                    share = Share.from_bytes(raw)
                except (SecAggError, ValueError) as exc:
                    raise MalformedMessage(f"invalid {what} share: {exc}") from None
                items.append((owner, share))
            share_lists.append(tuple(items))
        return {
            "survivors": lists[0],
            "received_from": lists[1],
            "b_shares": share_lists[0],
            "s_shares": share_lists[1],
        }


_BY_STAGE: dict[Stage, type[Message]] = {
    Stage.ADVERTISE_KEYS: AdvertiseKeys,
    Stage.SHARE_KEYS: ShareKeys,
    Stage.UNMASK: UnmaskShares,
}


def decode(data: bytes) -> Message:
    """Parse any message; :class:`MalformedMessage` on any bad input (never another error)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MalformedMessage(f"expected bytes, got {type(data).__name__}")
    r = _Reader(bytes(data))
    try:
        header = Header._read(r)
        cls = _BY_STAGE[header.stage]
        fields = cls._read_body(r)
        unsigned = r.consumed()
        signature = r.blob16("signature")
        r.end()
        msg = cls(header, signature=signature, **fields)
    except MalformedMessage:
        raise
    except (SecAggError, ValueError, TypeError, KeyError, struct.error) as exc:
        raise MalformedMessage(f"malformed message: {exc}") from None
    object.__setattr__(msg, "_unsigned_cache", unsigned)
    return msg
