"""The egress log's records: their canonical bytes, hashes, and parsing.

``docs/SECURITY.md``, "Privacy audit". A log file is JSON lines, one canonical record
per line (sorted keys, compact, UTF-8): a ``header`` naming the org and its Ed25519
public key, then ``entry`` records (:class:`EgressEntry`), the org's signed ``head``
records and the ``peer_head`` records it holds (:class:`SignedHead`).

Chain. ``genesis = SHA-256("fedweave/audit-log/v1\\0" || canonical header)``
(:func:`genesis_hash`); entry ``i`` has ``entry_hash = SHA-256(prev_hash || canonical
entry bytes)`` (:func:`entry_hash`) where ``prev_hash`` is the previous entry's hash
(the genesis for entry 0) and the canonical bytes are those of every field but the two
hashes. A signed head signs ``(org, index, head_hash, run, round, time)`` under the
domain tag ``"fedweave/audit-head/v1\\0"`` (:meth:`SignedHead.signing_bytes`).

:func:`read_log` checks the form only (canonical JSON, known record types, typed
fields); :mod:`org_node.audit.chain` checks the links and the signatures, and
:class:`~org_node.audit.log.EgressLog` writes the records. This module imports no
other module of the audit package.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from coordinator_free.identity import verify_signature

__all__ = [
    "ENTRY_FIELDS",
    "HEADER_FIELDS",
    "HEAD_DOMAIN",
    "HEAD_FIELDS",
    "LOG_DOMAIN",
    "LOG_VERSION",
    "REPAIR_DOMAIN",
    "REPAIR_FIELDS",
    "AuditError",
    "EgressEntry",
    "LogFormatError",
    "LogRecords",
    "LogRepair",
    "SignedHead",
    "canonical",
    "check_header",
    "entry_hash",
    "format_time",
    "genesis_hash",
    "parse_line",
    "read_log",
    "torn_tail",
]

LOG_VERSION = 1
LOG_DOMAIN = b"fedweave/audit-log/v1\x00"
HEAD_DOMAIN = b"fedweave/audit-head/v1\x00"
REPAIR_DOMAIN = b"fedweave/audit-repair/v1\x00"
REPAIR_FIELDS = ("after_line", "cut_bytes", "cut_sha256", "time", "signature")
ENTRY_FIELDS = (
    "index",
    "time",
    "org",
    "run",
    "round",
    "stage",
    "peer",
    "kind",
    "seq",
    "bytes",
    "sha256",
    "privacy_class",
    "prev_hash",
    "entry_hash",
)
HEAD_FIELDS = ("org", "index", "head_hash", "run", "round", "time", "signature")
HEADER_FIELDS = ("type", "version", "org", "public_key", "created")
HEADER_OPTIONAL = ("recovered",)
"""``recovered``: the time a node rebuilt by ``fedweave recover`` began this log anew (its
earlier log was lost with its disk); heads of the earlier log that peers hold, signed
before it, are then reported as entries lost in the wipe rather than a rewrite."""


class AuditError(Exception):
    """Root of the audit package's errors."""


class ReportError(AuditError):
    """Facts that cannot go into a report (missing, inconsistent or invalid)."""


class LogFormatError(AuditError):
    """A log file or record that cannot be read; ``line`` is 1-based (0: not a line)."""

    def __init__(self, line: int, detail: str) -> None:
        super().__init__(f"line {line}: {detail}" if line else detail)
        self.line = line
        self.detail = detail


def canonical(obj: Any) -> bytes:
    """Sorted-key, compact, UTF-8 JSON: the one byte form of a record."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def format_time(t: float) -> str:
    """``t`` (seconds since the epoch) as ISO 8601 UTC with microseconds and ``Z``."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def genesis_hash(header: Mapping[str, Any]) -> str:
    """The ``prev_hash`` of entry 0: SHA-256 of the domain tag and the canonical header."""
    return hashlib.sha256(LOG_DOMAIN + canonical(dict(header))).hexdigest()


def entry_hash(prev_hash: str, body: Mapping[str, Any]) -> str:
    """``SHA-256(prev_hash || canonical body)``, hex; the body leaves out both hashes."""
    fields = {k: v for k, v in body.items() if k not in ("prev_hash", "entry_hash", "type")}
    return hashlib.sha256(bytes.fromhex(prev_hash) + canonical(fields)).hexdigest()


@dataclass(frozen=True)
class EgressEntry:
    """One outbound message as the log records it (see the module docstring).

    index: position in the chain (0-based). time: ISO 8601 UTC. peer: the recipient.
    seq: the envelope's sequence number. bytes: wire bytes, signature included.
    sha256: SHA-256 of the envelope payload, hex. privacy_class: a
    :class:`~org_node.audit.classes.PrivacyClass` value.
    """

    index: int
    time: str
    org: str
    run: str
    round: int
    stage: str
    peer: str
    kind: str
    seq: int
    bytes: int
    sha256: str
    privacy_class: str
    prev_hash: str
    entry_hash: str

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in ENTRY_FIELDS}

    def to_record(self) -> dict[str, Any]:
        """The file record (``type`` = ``entry``)."""
        return {"type": "entry", **self.to_dict()}

    @classmethod
    def from_record(cls, record: Mapping[str, Any], line: int = 0) -> EgressEntry:
        """Parse a file record; :class:`LogFormatError` on a missing, extra or mistyped field."""
        _exact_keys(record, ("type", *ENTRY_FIELDS), "entry", line)
        for name in ("index", "round", "seq", "bytes"):
            _int_field(record, name, line)
        for name in ENTRY_FIELDS:
            if name not in ("index", "round", "seq", "bytes") and not isinstance(record[name], str):
                raise LogFormatError(line, f"entry field {name!r} must be a string")
        for name in ("sha256", "prev_hash", "entry_hash"):
            _hex_field(record, name, line)
        return cls(**{k: record[k] for k in ENTRY_FIELDS})

    def computed_hash(self) -> str:
        """The hash this entry's contents and ``prev_hash`` give."""
        return entry_hash(self.prev_hash, self.to_dict())


class _Signed:
    """A record the org signs: the domain tag and the canonical JSON of every field of
    ``FIELDS`` but the signature (Ed25519, RFC 8032)."""

    DOMAIN: ClassVar[bytes]
    FIELDS: ClassVar[tuple[str, ...]]
    signature: str

    def signing_bytes(self) -> bytes:
        body = {k: getattr(self, k) for k in self.FIELDS if k != "signature"}
        return self.DOMAIN + canonical(body)

    def verify(self, public_key: bytes) -> bool:
        """Whether the signature is the org's (under ``public_key``)."""
        try:
            signature = bytes.fromhex(self.signature)
        except ValueError:
            return False
        return verify_signature(public_key, self.signing_bytes(), signature)


@dataclass(frozen=True)
class LogRepair(_Signed):
    """A torn last record cut from the log when the log was opened again: a write cut
    short (a full disk, a power loss) left ``cut_bytes`` bytes (SHA-256 ``cut_sha256``)
    after line ``after_line``, the last whole record. The org signs it, so that
    verification shows every repair and who made it."""

    DOMAIN: ClassVar[bytes] = REPAIR_DOMAIN
    FIELDS: ClassVar[tuple[str, ...]] = REPAIR_FIELDS
    after_line: int
    cut_bytes: int
    cut_sha256: str
    time: str
    signature: str = ""

    def to_record(self) -> dict[str, Any]:
        return {"type": "repair", **{k: getattr(self, k) for k in REPAIR_FIELDS}}

    @classmethod
    def from_record(cls, record: Mapping[str, Any], line: int = 0) -> LogRepair:
        _exact_keys(record, ("type", *REPAIR_FIELDS), "repair", line)
        _int_field(record, "after_line", line, low=1)
        _int_field(record, "cut_bytes", line, low=1)
        for name in ("cut_sha256", "time", "signature"):
            if not isinstance(record[name], str):
                raise LogFormatError(line, f"repair field {name!r} must be a string")
        _hex_field(record, "cut_sha256", line)
        _hex_field(record, "signature", line, 128)
        return cls(**{k: record[k] for k in REPAIR_FIELDS})


@dataclass(frozen=True)
class SignedHead(_Signed):
    """A signed chain head: ``org``'s log holds entries ``0..index`` ending in ``head_hash``.

    ``index`` is -1 for an empty log, whose head is the genesis hash.
    """

    DOMAIN: ClassVar[bytes] = HEAD_DOMAIN
    FIELDS: ClassVar[tuple[str, ...]] = HEAD_FIELDS
    org: str
    index: int
    head_hash: str
    run: str
    round: int
    time: str
    signature: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in HEAD_FIELDS}

    def to_bytes(self) -> bytes:
        """Canonical JSON, the gossip payload of kind ``audit.head``."""
        return canonical(self.to_dict())

    @classmethod
    def from_dict(cls, record: Mapping[str, Any], line: int = 0) -> SignedHead:
        """Parse; :class:`LogFormatError` on a missing, extra or mistyped field."""
        _exact_keys(record, HEAD_FIELDS, "head", line)
        _int_field(record, "index", line, low=-1)
        _int_field(record, "round", line)
        for name in ("org", "head_hash", "run", "time", "signature"):
            if not isinstance(record[name], str):
                raise LogFormatError(line, f"head field {name!r} must be a string")
        _hex_field(record, "head_hash", line)
        _hex_field(record, "signature", line, 128)
        return cls(**{k: record[k] for k in HEAD_FIELDS})

    @classmethod
    def from_bytes(cls, data: bytes) -> SignedHead:
        """Inverse of :meth:`to_bytes`; refuses anything but its canonical form."""
        try:
            obj = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise LogFormatError(0, f"not a signed head: {exc}") from None
        if not isinstance(obj, dict):
            raise LogFormatError(0, "not a signed head: not an object")
        head = cls.from_dict(obj)
        if head.to_bytes() != data:
            raise LogFormatError(0, "signed head is not in canonical form")
        return head


def _exact_keys(record: Mapping[str, Any], keys: Iterable[str], what: str, line: int) -> None:
    want = set(keys)
    have = set(record)
    if have != want:
        missing = sorted(want - have)
        extra = sorted(have - want)
        detail = "; ".join(
            part
            for part in (
                f"missing {', '.join(missing)}" if missing else "",
                f"unexpected {', '.join(extra)}" if extra else "",
            )
            if part
        )
        raise LogFormatError(line, f"{what} record: {detail}")


def _int_field(record: Mapping[str, Any], name: str, line: int, low: int = 0) -> None:
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise LogFormatError(line, f"field {name!r} must be an integer >= {low}")


_HEX = frozenset("0123456789abcdef")


def _hex_field(record: Mapping[str, Any], name: str, line: int, size: int = 64) -> None:
    """Lowercase hex of ``size`` digits: one spelling per value, so no byte can change."""
    value = record[name]
    if not isinstance(value, str) or len(value) != size or not set(value) <= _HEX:
        raise LogFormatError(line, f"field {name!r} must be {size} lowercase hex digits")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


@dataclass
class LogRecords:
    """A log file as read: its header and its records with their 1-based line numbers."""

    header: dict[str, Any]
    records: list[tuple[int, str, Any]] = field(default_factory=list)
    """``(line, type, value)``: value is an :class:`EgressEntry` or a :class:`SignedHead`."""

    @property
    def org(self) -> str:
        return str(self.header["org"])

    @property
    def public_key(self) -> bytes:
        return bytes.fromhex(self.header["public_key"])

    def entries(self) -> list[EgressEntry]:
        return [v for _, t, v in self.records if t == "entry"]

    def heads(self) -> list[SignedHead]:
        return [v for _, t, v in self.records if t == "head"]

    def peer_heads(self) -> list[SignedHead]:
        """Heads of other orgs that this org holds."""
        return [v for _, t, v in self.records if t == "peer_head"]

    def repairs(self) -> list[LogRepair]:
        """The torn records cut from the log, oldest first."""
        return [v for _, t, v in self.records if t == "repair"]


def torn_tail(data: bytes) -> int:
    """How many bytes at the end of a log follow its last whole record (a record is
    whole once its newline is written): what a write cut short left behind."""
    return len(data) - (data.rfind(b"\n") + 1)


def parse_line(raw: bytes, line: int) -> dict[str, Any]:
    """One canonical JSON object; any byte that differs from the canonical form is refused."""
    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as exc:
        raise LogFormatError(line, f"not a JSON record ({exc})") from None
    if not isinstance(obj, dict):
        raise LogFormatError(line, "not a JSON object")
    if canonical(obj) != raw:
        raise LogFormatError(line, "record is not in canonical form (bytes were changed)")
    return obj


def check_header(obj: Mapping[str, Any], line: int = 1) -> dict[str, Any]:
    """Validate a log header record."""
    if obj.get("type") != "header":
        raise LogFormatError(line, "the first record must be the log header")
    keys = (*HEADER_FIELDS, *(k for k in HEADER_OPTIONAL if k in obj))
    _exact_keys(obj, keys, "header", line)
    if "recovered" in obj and not isinstance(obj["recovered"], str):
        raise LogFormatError(line, "header recovered must be a string")
    if obj["version"] != LOG_VERSION:
        raise LogFormatError(line, f"unknown log version {obj['version']!r}")
    if not isinstance(obj["org"], str) or not obj["org"]:
        raise LogFormatError(line, "header org must be a non-empty string")
    _hex_field(obj, "public_key", line)
    if not isinstance(obj["created"], str):
        raise LogFormatError(line, "header created must be a string")
    return dict(obj)


def read_log(source: Path | str | bytes) -> LogRecords:
    """Read a log file (or its bytes); :class:`LogFormatError` names the first bad line.

    Only the form is checked here (canonical JSON, known record types, typed fields);
    the chain and the signatures are checked by :mod:`org_node.audit.verify`.
    """
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    if not data:
        raise LogFormatError(0, "the log is empty (no header)")
    lines = data.split(b"\n")
    if lines[-1] != b"":
        raise LogFormatError(len(lines), "the last record is truncated (no final newline)")
    lines.pop()
    header = check_header(parse_line(lines[0], 1))
    out = LogRecords(header)
    for number, raw in enumerate(lines[1:], start=2):
        obj = parse_line(raw, number)
        kind = obj.get("type")
        if kind == "entry":
            out.records.append((number, "entry", EgressEntry.from_record(obj, number)))
        elif kind in ("head", "peer_head"):
            _exact_keys(obj, ("type", "head"), str(kind), number)
            if not isinstance(obj["head"], dict):
                raise LogFormatError(number, f"{kind} record must hold a head object")
            out.records.append((number, str(kind), SignedHead.from_dict(obj["head"], number)))
        elif kind == "repair":
            out.records.append((number, "repair", LogRepair.from_record(obj, number)))
        else:
            raise LogFormatError(number, f"unknown record type {kind!r}")
    return out
