"""The egress log: every outbound message, recorded before it is sent, hash-chained and signed.

``docs/SECURITY.md``, "Privacy audit". :class:`EgressLog` is the endpoint's egress hook
(:data:`coordinator_free.endpoint.EgressHook`): for each signed envelope it classifies
the kind (:func:`org_node.audit.classes.classify`; unknown and forbidden kinds are
refused, so the message is not sent), and appends one :class:`EgressEntry` — UTC time,
run, round, stage, peer, kind, envelope sequence number, the **wire** byte count (what
the transport counts), the SHA-256 of the payload and the privacy class.

Chain. The log file starts with a header naming the org and its Ed25519 public key;
each entry's hash covers the previous entry's hash and its own contents, so any
changed, removed, duplicated or reordered entry breaks the chain at that entry. The
records, their canonical bytes and hashes are :mod:`org_node.audit.records`; the check
of the links and signatures is :mod:`org_node.audit.chain`, which also verifies an
existing file before the log continues it.

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
The names of :mod:`org_node.audit.records` are importable from here too.
A database store (:class:`DatabaseStore`) keeps a copy of each entry in the node's
``audit_event`` table for the API's audit routes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from coordinator_free.identity import OrgIdentity
from coordinator_free.wire import Envelope

from org_node.audit.chain import verify_records
from org_node.audit.classes import (
    FORBIDDEN_CLASSES,
    ClassificationError,
    ForbiddenClass,
    PrivacyClass,
    classify,
)
from org_node.audit.records import (
    ENTRY_FIELDS,
    HEAD_DOMAIN,
    HEAD_FIELDS,
    LOG_DOMAIN,
    LOG_VERSION,
    AuditError,
    EgressEntry,
    LogFormatError,
    LogRecords,
    LogRepair,
    SignedHead,
    canonical,
    entry_hash,
    format_time,
    genesis_hash,
    read_log,
    torn_tail,
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


@dataclass(frozen=True)
class Refusal:
    """A message the hook refused to let out (not in the chain: it was never sent)."""

    time: str
    run: str
    round: int
    peer: str
    kind: str
    reason: str


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
    recovered: a log created anew by a node rebuilt after a wipe says so in its header
    (``recovered``), so that verification tells the lost log from a rewritten one.
    store: an optional second copy of each entry. clock: seconds since the epoch.
    """

    def __init__(
        self,
        identity: OrgIdentity,
        path: Path | str | None = None,
        *,
        fsync_every: int = 1,
        commit_within_s: float | None = None,
        store: EgressStore | None = None,
        clock: Callable[[], float] = time.time,
        recovered: bool = False,
    ) -> None:
        if isinstance(fsync_every, bool) or not isinstance(fsync_every, int) or fsync_every < 1:
            raise ValueError(f"fsync_every must be an integer >= 1, got {fsync_every!r}")
        if commit_within_s is not None and not 0 < commit_within_s <= 1:
            raise ValueError(f"commit_within_s must be in (0, 1], got {commit_within_s!r}")
        self.identity = identity
        self.path = Path(path) if path is not None else None
        self.fsync_every = fsync_every
        self.store = store
        self.clock = clock
        self.entries: list[EgressEntry] = []
        self.heads: list[SignedHead] = []
        self.peer_heads: list[SignedHead] = []
        self.repairs: list[LogRepair] = []
        self.refusals: list[Refusal] = []
        self.failure: str | None = None
        """Why the last write failed (a full disk); None once one succeeds again."""
        self._size = 0
        self._lock = threading.Lock()
        self._unsynced = 0
        self._fd: int | None = None
        self.commit_within_s = commit_within_s
        self._dirty = threading.Event()
        self._closing = False
        self._committer: threading.Thread | None = None
        self.header: dict[str, Any] = {
            "type": "header",
            "version": LOG_VERSION,
            "org": identity.org_id,
            "public_key": identity.public_key.hex(),
            "created": format_time(clock()),
        }
        if recovered:  # a new log of a node rebuilt after a wipe (an existing one is kept)
            self.header["recovered"] = self.header["created"]
        if self.path is not None:
            self._open(self.path)
            if commit_within_s is not None:
                self._committer = threading.Thread(
                    target=self._commit_loop, name="egress-log-commit", daemon=True
                )
                self._committer.start()
        self.genesis = genesis_hash(self.header)

    @property
    def org(self) -> str:
        return self.identity.org_id

    @property
    def head_hash(self) -> str:
        """The hash of the last entry (the genesis hash while empty)."""
        return self.entries[-1].entry_hash if self.entries else self.genesis

    def _open(self, path: Path) -> None:
        data = path.read_bytes() if path.exists() else b""
        repair = self._torn(path, data)
        if repair is not None:
            data = data[: len(data) - repair.cut_bytes]
        if data:
            records = read_log(data)
            result = verify_records(records)
            if not result.ok:
                raise AuditError(f"{path.name}: the existing log does not verify: {result.summary}")
            if records.org != self.org or records.public_key != self.identity.public_key:
                raise AuditError(f"{path.name} belongs to {records.org!r} or to another key")
            self.header = records.header
            self.entries = records.entries()
            self.heads = records.heads()
            self.peer_heads = records.peer_heads()
            self.repairs = records.repairs()
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            self._size = len(data)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._size = 0
            self._write(self.header, sync=True)
        if repair is not None:
            self._write(repair.to_record(), sync=True)
            self.repairs.append(repair)

    def _torn(self, path: Path, data: bytes) -> LogRepair | None:
        """The signed repair of a torn last record (a write cut short by a full disk or
        a power loss), after cutting the file back to its last whole record; None when
        the log ends with a whole record."""
        cut = torn_tail(data)
        if not cut:
            return None
        kept = len(data) - cut
        os.truncate(path, kept)
        repair = LogRepair(
            after_line=max(1, data[:kept].count(b"\n")),
            cut_bytes=cut,
            cut_sha256=hashlib.sha256(data[kept:]).hexdigest(),
            time=format_time(self.clock()),
        )
        return replace(repair, signature=self.identity.sign(repair.signing_bytes()).hex())

    def _write(self, record: Mapping[str, Any], *, sync: bool) -> None:
        """Append one record; a write that fails (a full disk) is cut back off the file,
        so no torn record is ever followed by another, and :attr:`failure` says why
        until a write succeeds again."""
        if self._fd is None:
            return
        data = canonical(dict(record)) + b"\n"
        written = 0
        try:
            while written < len(data):
                written += os.write(self._fd, data[written:])
            self._unsynced += 1
            if sync or (self._committer is None and self._unsynced >= self.fsync_every):
                os.fsync(self._fd)
                self._unsynced = 0
            elif self._committer is not None:
                self._dirty.set()
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            self.failure = f"the egress log cannot be written: {exc.strerror or exc}"
            raise AuditError(self.failure) from exc
        self._size += len(data)
        self.failure = None

    def _cut_back(self, size: int) -> None:
        """Remove what was written after ``size`` bytes (a record the database refused)."""
        if self._fd is not None:
            os.ftruncate(self._fd, size)
            self._size = size

    def flush(self) -> None:
        """fsync every record written so far."""
        with self._lock:
            if self._fd is not None and self._unsynced:
                os.fsync(self._fd)
                self._unsynced = 0

    def _commit_loop(self) -> None:
        """Group commit: at most ``commit_within_s`` after a record is written, one fsync
        makes it and every record written meanwhile durable, on this thread (the writer,
        the node's event loop, never waits for the disk)."""
        while True:
            self._dirty.wait()
            time.sleep(self.commit_within_s or 0)
            self._dirty.clear()
            with self._lock:
                fd, pending = self._fd, self._unsynced
                self._unsynced = 0
            if fd is not None and pending:
                try:
                    os.fsync(fd)
                except OSError as exc:
                    self.failure = f"the egress log cannot be committed: {exc.strerror or exc}"
            if self._closing:  # checked after each pass: close() set it, then woke us
                return

    def close(self) -> None:
        """Flush and close the mirror; the in-memory log stays readable."""
        if self._committer is not None:
            self._closing = True
            self._dirty.set()
            self._committer.join()
            self._committer = None
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
            # both or neither: if the file (a full disk) or the database copy cannot take
            # the entry, the message is not sent and no record of it is left
            size = self._size
            self._write(entry.to_record(), sync=False)
            if self.store is not None:
                try:
                    self.store.append_entry(entry)
                except BaseException:
                    self._cut_back(size)
                    raise
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
