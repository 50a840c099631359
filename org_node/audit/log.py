"""The egress log: every outbound message, recorded before it is sent, hash-chained and signed.

``docs/SECURITY.md``, "Privacy audit". :class:`EgressLog` is the endpoint's egress hook
(:data:`coordinator_free.endpoint.EgressHook`): for each signed envelope it classifies
the kind (:func:`org_node.audit.classes.classify`; unknown and forbidden kinds are
refused, so the message is not sent), and appends one :class:`EgressEntry` — UTC time,
run, round, stage, peer, kind, envelope sequence number, the **wire** byte count (what
the transport counts), the SHA-256 of the payload and the privacy class.

Chain. The log file starts with a header naming the org and its Ed25519 public key;
``genesis = SHA-256("fedweave/audit-log/v1\\0" || canonical header)``. Entry ``i`` has
``entry_hash = SHA-256(prev_hash || canonical entry bytes)`` where ``prev_hash`` is the
previous entry's hash (the genesis for entry 0) and the canonical bytes are the
sorted-key compact JSON of every field but the two hashes. Any changed, removed,
duplicated or reordered entry breaks the chain at that entry.

Signed heads. :meth:`EgressLog.sign_head` signs ``(org, index, head_hash, run, round,
time)`` with the org's identity key (Ed25519, RFC 8032) under the domain tag
``"fedweave/audit-head/v1\\0"``; the node does so every round and gossips the head
(kind ``audit.head``) so that each org also holds the signed heads of the others
(:meth:`EgressLog.hold_peer_head`). A head held by a peer pins this org's log up to its
index: a log rewritten or cut short afterwards no longer matches it.

File mirror. JSON lines, one canonical record per line (``header``, ``entry``,
``head``, ``peer_head``), opened ``O_APPEND`` and fsynced after every
``fsync_every`` appends (1: each one), at every signed head, on :meth:`EgressLog.flush`
and on close. Verification (:mod:`org_node.audit.verify`) works from the file alone.
A database store (:class:`DatabaseStore`) keeps a copy of each entry in the node's
``audit_event`` table for the API's audit routes.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from coordinator_free.identity import OrgIdentity, verify_signature
from coordinator_free.wire import Envelope

from org_node.audit.classes import (
    FORBIDDEN_CLASSES,
    ClassificationError,
    ForbiddenClass,
    PrivacyClass,
    classify,
)

__all__ = [
    "ENTRY_FIELDS",
    "HEAD_DOMAIN",
    "HEAD_FIELDS",
    "LOG_DOMAIN",
    "LOG_VERSION",
    "AuditError",
    "DatabaseStore",
    "EgressEntry",
    "EgressLog",
    "EgressStore",
    "LogFormatError",
    "LogRecords",
    "Refusal",
    "SignedHead",
    "canonical",
    "entry_hash",
    "format_time",
    "genesis_hash",
    "read_log",
]

LOG_VERSION = 1
LOG_DOMAIN = b"fedweave/audit-log/v1\x00"
HEAD_DOMAIN = b"fedweave/audit-head/v1\x00"
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


class AuditError(Exception):
    """Root of the audit package's errors."""


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


@dataclass(frozen=True)
class SignedHead:
    """A signed chain head: ``org``'s log holds entries ``0..index`` ending in ``head_hash``.

    ``index`` is -1 for an empty log, whose head is the genesis hash.
    """

    org: str
    index: int
    head_hash: str
    run: str
    round: int
    time: str
    signature: str = ""

    def signing_bytes(self) -> bytes:
        """Domain tag and the canonical JSON of every field but the signature."""
        body = {k: getattr(self, k) for k in HEAD_FIELDS if k != "signature"}
        return HEAD_DOMAIN + canonical(body)

    def verify(self, public_key: bytes) -> bool:
        """Whether the signature is ``org``'s (Ed25519 under ``public_key``)."""
        try:
            signature = bytes.fromhex(self.signature)
        except ValueError:
            return False
        return verify_signature(public_key, self.signing_bytes(), signature)

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


@dataclass(frozen=True)
class Refusal:
    """A message the hook refused to let out (not in the chain: it was never sent)."""

    time: str
    run: str
    round: int
    peer: str
    kind: str
    reason: str


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
    _exact_keys(obj, HEADER_FIELDS, "header", line)
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
        else:
            raise LogFormatError(number, f"unknown record type {kind!r}")
    return out


class EgressStore(Protocol):
    """Where the log keeps a second copy of each entry (e.g. the node's database)."""

    def append_entry(self, entry: EgressEntry) -> None: ...


class DatabaseStore:
    """Copies each entry into the node's ``audit_event`` table (:mod:`org_node.db`).

    The table keeps its own chain over all of the node's audit events (admin actions
    too, :func:`org_node.db.repo.append_audit_event`); the egress chain and its signed
    heads live in the file mirror. Each entry is committed in its own transaction.
    """

    LIMITS = (("run", 32), ("stage", 64), ("peer", 100), ("kind", 64))
    """Column widths of ``audit_event``; a longer value is refused before any write."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def append_entry(self, entry: EgressEntry) -> None:
        """Insert and commit one row; raises (and the message is not sent) on failure."""
        from sqlmodel import Session

        from org_node.db.repo import append_audit_event

        for name, limit in self.LIMITS:
            if len(getattr(entry, name)) > limit:
                raise AuditError(f"{name} {getattr(entry, name)!r} is longer than {limit}")
        with Session(self.engine) as session:
            append_audit_event(
                session,
                stage=entry.stage or "-",
                kind=entry.kind,
                privacy_class=entry.privacy_class,
                run=entry.run or None,
                round=entry.round,
                peer=entry.peer,
                bytes=entry.bytes,
                sha256=entry.sha256,
                time=datetime.strptime(entry.time, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC),
            )
            session.commit()


class EgressLog:
    """An org's egress log: the endpoint hook, the chain, signed heads, the file mirror.

    path: the JSON-lines mirror (created with mode 0600 if absent; an existing file is
    read, verified and continued). fsync_every: appends between fsyncs (1 = each).
    store: an optional second copy of each entry. clock: seconds since the epoch.
    """

    def __init__(
        self,
        identity: OrgIdentity,
        path: Path | str | None = None,
        *,
        fsync_every: int = 1,
        store: EgressStore | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(fsync_every, bool) or not isinstance(fsync_every, int) or fsync_every < 1:
            raise ValueError(f"fsync_every must be an integer >= 1, got {fsync_every!r}")
        self.identity = identity
        self.path = Path(path) if path is not None else None
        self.fsync_every = fsync_every
        self.store = store
        self.clock = clock
        self.entries: list[EgressEntry] = []
        self.heads: list[SignedHead] = []
        self.peer_heads: list[SignedHead] = []
        self.refusals: list[Refusal] = []
        self._lock = threading.Lock()
        self._unsynced = 0
        self._fd: int | None = None
        self.header: dict[str, Any] = {
            "type": "header",
            "version": LOG_VERSION,
            "org": identity.org_id,
            "public_key": identity.public_key.hex(),
            "created": format_time(clock()),
        }
        if self.path is not None:
            self._open(self.path)
        self.genesis = genesis_hash(self.header)

    @property
    def org(self) -> str:
        return self.identity.org_id

    @property
    def head_hash(self) -> str:
        """The hash of the last entry (the genesis hash while empty)."""
        return self.entries[-1].entry_hash if self.entries else self.genesis

    def _open(self, path: Path) -> None:
        if path.exists() and path.stat().st_size > 0:
            from org_node.audit.verify import verify_records

            records = read_log(path)
            result = verify_records(records)
            if not result.ok:
                raise AuditError(f"{path.name}: the existing log does not verify: {result.summary}")
            if records.org != self.org or records.public_key != self.identity.public_key:
                raise AuditError(f"{path.name} belongs to {records.org!r} or to another key")
            self.header = records.header
            self.entries = records.entries()
            self.heads = records.heads()
            self.peer_heads = records.peer_heads()
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._write(self.header, sync=True)

    def _write(self, record: Mapping[str, Any], *, sync: bool) -> None:
        if self._fd is None:
            return
        data = canonical(dict(record)) + b"\n"
        written = 0
        while written < len(data):
            written += os.write(self._fd, data[written:])
        self._unsynced += 1
        if sync or self._unsynced >= self.fsync_every:
            os.fsync(self._fd)
            self._unsynced = 0

    def flush(self) -> None:
        """fsync every record written so far."""
        with self._lock:
            if self._fd is not None and self._unsynced:
                os.fsync(self._fd)
                self._unsynced = 0

    def close(self) -> None:
        """Flush and close the mirror; the in-memory log stays readable."""
        self.flush()
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> EgressLog:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __call__(self, envelope: Envelope, wire: bytes) -> None:
        """The endpoint hook: :meth:`record`."""
        self.record(envelope, wire)

    def record(self, envelope: Envelope, wire: bytes) -> EgressEntry:
        """Classify and append one outbound message; raise to stop it being sent.

        Raises :class:`~org_node.audit.classes.UnclassifiedKind` or
        :class:`~org_node.audit.classes.ForbiddenClass` (kept in :attr:`refusals`),
        and :class:`AuditError` for an envelope that is not this org's.
        """
        now = format_time(self.clock())
        if envelope.sender != self.org:
            raise AuditError(
                f"envelope from {envelope.sender!r} offered to the log of {self.org!r}"
            )
        try:
            cls = classify(envelope.kind)
            if cls in FORBIDDEN_CLASSES:
                raise ForbiddenClass(envelope.kind, cls)
        except ClassificationError as exc:
            with self._lock:
                self.refusals.append(
                    Refusal(
                        now,
                        envelope.run,
                        envelope.round,
                        envelope.recipient,
                        envelope.kind,
                        str(exc),
                    )
                )
            raise
        with self._lock:
            body: dict[str, Any] = {
                "index": len(self.entries),
                "time": now,
                "org": self.org,
                "run": envelope.run,
                "round": envelope.round,
                "stage": envelope.stage,
                "peer": envelope.recipient,
                "kind": envelope.kind,
                "seq": envelope.seq,
                "bytes": len(wire),
                "sha256": hashlib.sha256(envelope.payload).hexdigest(),
                "privacy_class": PrivacyClass(cls).value,
                "prev_hash": self.head_hash,
            }
            entry = EgressEntry(**body, entry_hash=entry_hash(self.head_hash, body))
            # the database copy first: if it fails, the message is not sent and the
            # chain does not record it either
            if self.store is not None:
                self.store.append_entry(entry)
            self._write(entry.to_record(), sync=False)
            self.entries.append(entry)
            return entry

    def sign_head(self, run: str = "", round: int = 0) -> SignedHead:
        """Sign the current head for ``(run, round)``, write it to the mirror and fsync."""
        with self._lock:
            head = SignedHead(
                org=self.org,
                index=len(self.entries) - 1,
                head_hash=self.head_hash,
                run=run,
                round=round,
                time=format_time(self.clock()),
            )
            head = SignedHead(
                **{**head.to_dict(), "signature": self.identity.sign(head.signing_bytes()).hex()}
            )
            self._write({"type": "head", "head": head.to_dict()}, sync=True)
            self.heads.append(head)
            return head

    def hold_peer_head(self, head: SignedHead, public_key: bytes) -> None:
        """Keep another org's signed head (after checking its signature)."""
        if head.org == self.org:
            raise AuditError("a peer head must be another org's")
        if not head.verify(public_key):
            raise AuditError(f"the head of {head.org!r} at index {head.index} is not signed by it")
        with self._lock:
            self._write({"type": "peer_head", "head": head.to_dict()}, sync=True)
            self.peer_heads.append(head)
