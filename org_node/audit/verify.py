"""Verification of an egress log or a privacy audit report (``fedweave audit verify``).

``docs/SECURITY.md``, "Privacy audit", item 3. For a log file (or the log segment a
report carries) the checks are, entry by entry in file order:

1. the record is canonical JSON of a known type with exactly its fields (any changed
   byte that keeps valid JSON still changes the canonical form or a hash);
2. the index is the next one (a removed, duplicated or reordered entry is named), the
   ``prev_hash`` links to the previous entry, and ``entry_hash`` matches the contents;
3. the recorded privacy class is the one the kind maps to, and it is not forbidden
   (raw data, labels, unmasked update): a forbidden message in the log is reported as
   sent;
4. each signed head covers exactly the entries before it, matches the chain, and
   carries a valid Ed25519 signature of the org (the key from the header, which must
   equal the pinned key when one is given);
5. heads of this org held by its peers (``peer_heads``) are signed by it and match the
   chain at their index: a log rewritten or cut short after the head was gossiped
   disagrees with the peers' record.

A report is also checked against its schema; its log segment must end under a signed
head; each section's digest is compared (a change is named by its section) and the
org's signature checked; and its traffic figures are recomputed from its log records.
Heads of other orgs held in a log are checked when the orgs' keys are given. The first failure is reported with the
entry (index and line, or record position) and the reason.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator_free.identity import verify_signature

from org_node.audit.classes import FORBIDDEN_CLASSES, PrivacyClass, UnclassifiedKind, classify
from org_node.audit.log import (
    EgressEntry,
    LogFormatError,
    LogRecords,
    SignedHead,
    check_header,
    genesis_hash,
    read_log,
)
from org_node.audit.report import (
    REPORT_SCHEMA_ID,
    SECTIONS,
    SchemaError,
    report_signing_bytes,
    report_to_bytes,
    section_digests,
    traffic_of,
    validate_report,
)

__all__ = [
    "VerifyResult",
    "main",
    "peer_heads_from_logs",
    "verify_log",
    "verify_path",
    "verify_records",
    "verify_report",
]


@dataclass(frozen=True)
class VerifyResult:
    """The outcome: ``summary`` is the one line the CLI prints."""

    ok: bool
    summary: str
    what: str = "log"
    org: str = ""
    entries: int = 0
    heads: int = 0
    peer_heads: int = 0
    index: int | None = None
    location: str = ""

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1


class _Broken(Exception):
    def __init__(self, location: str, detail: str, index: int | None = None) -> None:
        super().__init__(f"{location}: {detail}")
        self.location = location
        self.detail = detail
        self.index = index


_FORBIDDEN = {c.value for c in FORBIDDEN_CLASSES}


class _Chain:
    """Walks entries and heads in order, raising :class:`_Broken` at the first fault."""

    def __init__(self, org: str, key: bytes, prev: str, next_index: int) -> None:
        self.org = org
        self.key = key
        self.prev = prev
        self.next = next_index
        self.hashes: dict[int, str] = {next_index - 1: prev}
        self.entries = 0
        self.heads = 0

    def entry(self, e: EgressEntry, where: str) -> None:
        at = f"entry {e.index} ({where})"
        if e.index != self.next:
            if e.index < self.next:
                raise _Broken(
                    at,
                    f"repeats or is out of order: entry {self.next} was expected here",
                    e.index,
                )
            missing = (
                f"entry {self.next}"
                if e.index == self.next + 1
                else f"entries {self.next}..{e.index - 1}"
            )
            raise _Broken(at, f"{missing} missing before it (removed or reordered)", e.index)
        if e.prev_hash != self.prev:
            raise _Broken(at, "prev_hash does not link to the previous entry", e.index)
        if e.computed_hash() != e.entry_hash:
            raise _Broken(at, "contents do not match entry_hash (a field was changed)", e.index)
        if e.org != self.org:
            raise _Broken(at, f"org {e.org!r} is not the log's org {self.org!r}", e.index)
        try:
            PrivacyClass(e.privacy_class)
            expected = classify(e.kind)
        except ValueError:
            raise _Broken(at, f"unknown privacy class {e.privacy_class!r}", e.index) from None
        except UnclassifiedKind:
            raise _Broken(at, f"kind {e.kind!r} has no privacy class", e.index) from None
        if expected.value != e.privacy_class:
            raise _Broken(
                at, f"kind {e.kind!r} is {expected.value}, recorded as {e.privacy_class}", e.index
            )
        if e.privacy_class in _FORBIDDEN:
            raise _Broken(
                at,
                f"a message of forbidden class {e.privacy_class} ({e.kind!r}) was sent to {e.peer!r}",
                e.index,
            )
        self.prev = e.entry_hash
        self.hashes[e.index] = e.entry_hash
        self.next += 1
        self.entries += 1

    def head(self, h: SignedHead, where: str) -> None:
        at = f"signed head of index {h.index} ({where})"
        if h.org != self.org:
            raise _Broken(at, f"is of org {h.org!r}, not {self.org!r}")
        if h.index != self.next - 1:
            raise _Broken(
                at, f"does not follow entry {h.index}: the chain is at entry {self.next - 1}"
            )
        if h.head_hash != self.prev:
            raise _Broken(at, "head_hash does not match the chain")
        if not h.verify(self.key):
            raise _Broken(at, "the signature is not valid")
        self.heads += 1

    def check_peer_head(self, h: SignedHead) -> None:
        at = f"head of index {h.index} held by a peer"
        if not h.verify(self.key):
            raise _Broken(at, "the signature is not valid")
        last = self.next - 1
        if h.index > last:
            raise _Broken(
                at,
                f"the log ends at entry {last}: entries {last + 1}..{h.index} were removed",
                h.index,
            )
        known = self.hashes.get(h.index)
        if known is None:
            return
        if known != h.head_hash:
            raise _Broken(
                f"entry {h.index}",
                "differs from the signed head the peers hold (the log was rewritten)",
                h.index,
            )


def _key(header: Mapping[str, Any], trusted_keys: Mapping[str, bytes] | None) -> tuple[bytes, bool]:
    key = bytes.fromhex(header["public_key"])
    pinned = trusted_keys.get(header["org"]) if trusted_keys else None
    if pinned is not None and pinned != key:
        raise _Broken("log header", f"the key is not the pinned key of {header['org']!r}")
    return key, pinned is not None


def _check_peer_heads(chain: _Chain, peer_heads: Iterable[SignedHead]) -> int:
    checked = 0
    for h in peer_heads:
        if h.org == chain.org:
            chain.check_peer_head(h)
            checked += 1
    return checked


def verify_records(
    records: LogRecords,
    *,
    trusted_keys: Mapping[str, bytes] | None = None,
    peer_heads: Iterable[SignedHead] = (),
) -> VerifyResult:
    """Verify a log read by :func:`~org_node.audit.log.read_log` (see the module docstring)."""
    org = records.org
    try:
        key, pinned = _key(records.header, trusted_keys)
        chain = _Chain(org, key, genesis_hash(records.header), 0)
        held = 0
        for line, kind, value in records.records:
            where = f"line {line}"
            if kind == "entry":
                chain.entry(value, where)
            elif kind == "head":
                chain.head(value, where)
            else:
                if trusted_keys is not None:
                    other = trusted_keys.get(value.org)
                    if other is None:
                        raise _Broken(where, f"holds a head of {value.org!r}, not a known org")
                    if not value.verify(other):
                        raise _Broken(where, f"the held head of {value.org!r} is not signed by it")
                held += 1
        checked = _check_peer_heads(chain, peer_heads)
    except _Broken as exc:
        return VerifyResult(
            False, f"FAIL: log of {org}: {exc}", "log", org, index=exc.index, location=exc.location
        )
    tail = chain.prev[:16]
    summary = (
        f"OK: log of {org}: {chain.entries} entries, {chain.heads} signed heads, "
        f"head {tail}, no forbidden class"
        + (f", agrees with {checked} head(s) held by peers" if checked else "")
        + (f", holds {held} peer head(s)" if held else "")
        + ("" if pinned else " (key from the log header, not pinned)")
    )
    return VerifyResult(True, summary, "log", org, chain.entries, chain.heads, checked)


def verify_log(
    path: Path | str,
    *,
    trusted_keys: Mapping[str, bytes] | None = None,
    peer_heads: Iterable[SignedHead] = (),
) -> VerifyResult:
    """Verify a log file; a malformed line is reported by its number."""
    try:
        records = read_log(Path(path))
    except LogFormatError as exc:
        return VerifyResult(False, f"FAIL: log: {exc}", "log", location=f"line {exc.line}")
    return verify_records(records, trusted_keys=trusted_keys, peer_heads=peer_heads)


def _first_difference(name: str, claimed: Any, actual: Any) -> str:
    if isinstance(claimed, dict) and isinstance(actual, dict):
        for key in sorted(set(claimed) | set(actual)):
            if claimed.get(key) != actual.get(key):
                return _first_difference(f"{name}.{key}", claimed.get(key), actual.get(key))
    if isinstance(claimed, list) and isinstance(actual, list):
        for i, (a, b) in enumerate(zip(claimed, actual, strict=False)):
            if a != b:
                return _first_difference(f"{name}[{i}]", a, b)
        if len(claimed) != len(actual):
            return f"{name} has {len(claimed)} rows, the log gives {len(actual)}"
    return f"{name} says {json.dumps(claimed)}, the log gives {json.dumps(actual)}"


def verify_report(
    doc: Any,
    *,
    trusted_keys: Mapping[str, bytes] | None = None,
    peer_heads: Iterable[SignedHead] = (),
) -> VerifyResult:
    """Verify a report document (see the module docstring)."""
    org = doc.get("org", "") if isinstance(doc, dict) else ""
    try:
        try:
            validate_report(doc)
        except SchemaError as exc:
            raise _Broken(exc.path, str(exc).split(": ", 1)[1]) from None
        try:
            header = check_header(doc["log"]["header"], 0)
        except LogFormatError as exc:
            raise _Broken("log.header", exc.detail) from None
        if header["org"] != org:
            raise _Broken("log.header", f"the log is of {header['org']!r}, the report of {org!r}")
        key, pinned = _key(header, trusted_keys)
        rows: Sequence[Mapping[str, Any]] = doc["log"]["records"]
        parsed: list[tuple[str, str, Any]] = []
        for i, rec in enumerate(rows):
            where = f"log.records[{i}]"
            try:
                if rec.get("type") == "entry":
                    parsed.append((where, "entry", EgressEntry.from_record(rec)))
                elif rec.get("type") == "head" and set(rec) == {"type", "head"}:
                    parsed.append((where, "head", SignedHead.from_dict(rec["head"])))
                else:
                    raise _Broken(where, "not an entry or a head record")
            except LogFormatError as exc:
                raise _Broken(where, exc.detail) from None
        first = next((v for _, t, v in parsed if t == "entry"), None)
        if first is None:
            raise _Broken("log.records", "the report carries no log entry")
        window = doc["traffic"]["window"]
        if first.index > window["first_index"]:
            raise _Broken(
                "log.records[0]",
                f"entries {window['first_index']}..{first.index - 1} are missing from the "
                "start of the segment",
                first.index,
            )
        start_prev = genesis_hash(header) if first.index == 0 else first.prev_hash
        chain = _Chain(org, key, start_prev, first.index)
        for where, kind, value in parsed:
            if kind == "entry":
                chain.entry(value, where)
            else:
                chain.head(value, where)
        if parsed[-1][1] != "head":
            raise _Broken(
                "log.records",
                f"the segment ends at entry {chain.next - 1} with no signed head covering it "
                "(entries removed from the end)",
            )
        digests = section_digests(doc)
        claimed = doc["signature"]["sections"]
        for name in SECTIONS:
            if claimed.get(name) != digests[name]:
                raise _Broken(name, "the section was changed after the report was signed")
        if set(claimed) != set(SECTIONS):
            raise _Broken("signature.sections", "names sections the report does not have")
        signature = bytes.fromhex(doc["signature"]["value"])
        if not verify_signature(key, report_signing_bytes(doc, digests), signature):
            raise _Broken("signature", f"not a valid signature of {org!r} over the report")
        consents = _check_consents(doc, trusted_keys)
        entries = [v for _, t, v in parsed if t == "entry"]
        actual = traffic_of(entries, doc["run"]["id"])
        if doc["traffic"] != actual:
            raise _Broken("traffic", _first_difference("traffic", doc["traffic"], actual))
        checked = _check_peer_heads(chain, peer_heads)
    except _Broken as exc:
        return VerifyResult(
            False,
            f"FAIL: report of {org}: {exc}",
            "report",
            org,
            index=exc.index,
            location=exc.location,
        )
    summary = (
        f"OK: report of {org} for run {doc['run']['id']!r}: {chain.entries} entries "
        f"({chain.heads} signed heads), {doc['traffic']['total']['bytes']} bytes sent, "
        "no forbidden class, signature valid"
        + (f", agrees with {checked} head(s) held by peers" if checked else "")
        + consents
        + ("" if pinned else " (key from the report, not pinned)")
    )
    return VerifyResult(True, summary, "report", org, chain.entries, chain.heads, checked)


def _check_consents(doc: Mapping[str, Any], trusted_keys: Mapping[str, bytes] | None) -> str:
    """Check every signed consent of another participant the report carries against that
    participant's pinned key; what the summary says of them ("" when there are none)."""
    from org_node.proposals import Consent, consent_signing_bytes

    checked, unpinned = 0, []
    for i, part in enumerate(doc["participants"]):
        signed = (part.get("consent") or {}).get("signed")
        if signed is None:
            continue
        org, c = part["org"], part["consent"]
        key = (trusted_keys or {}).get(org)
        if key is None:
            unpinned.append(org)
            continue
        record = Consent(
            doc["run"]["id"],
            org,
            "accept" if c["decision"] == "accepted" else "decline",
            c["reason"],
            signed["at_ms"],
        )
        message = consent_signing_bytes(signed["federation"], record)
        if not verify_signature(key, message, bytes.fromhex(signed["signature"])):
            raise _Broken(
                f"participants[{i}].consent",
                f"not a valid signature of {org!r} over its consent to the run",
            )
        checked += 1
    out = f", {checked} signed consent(s) of other participants valid" if checked else ""
    if unpinned:
        out += f", consents of {', '.join(unpinned)} not checked (no pinned key)"
    return out


def peer_heads_from_logs(paths: Iterable[Path | str]) -> list[SignedHead]:
    """The heads of other orgs held in the given (peers') log files."""
    out: list[SignedHead] = []
    for path in paths:
        out.extend(read_log(Path(path)).peer_heads())
    return out


def verify_path(
    path: Path | str,
    *,
    trusted_keys: Mapping[str, bytes] | None = None,
    peer_logs: Iterable[Path | str] = (),
) -> VerifyResult:
    """Verify a log (JSON lines) or a report (one JSON object) at ``path``.

    ``peer_logs``: peers' log files, whose held heads of this org are cross-checked.
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        return VerifyResult(False, f"FAIL: cannot read {p.name}: {exc.strerror}")
    try:
        held = peer_heads_from_logs(peer_logs)
    except (OSError, LogFormatError) as exc:
        return VerifyResult(False, f"FAIL: a peer log cannot be read: {exc}")
    first_line = data.split(b"\n", 1)[0]
    if b'"type":"header"' in first_line:
        try:
            records = read_log(data)
        except LogFormatError as exc:
            return VerifyResult(False, f"FAIL: log: {exc}", location=f"line {exc.line}")
        return verify_records(records, trusted_keys=trusted_keys, peer_heads=held)
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return VerifyResult(False, f"FAIL: {p.name} is neither a log nor a report: {exc}")
    if not isinstance(doc, dict) or doc.get("schema") != REPORT_SCHEMA_ID:
        return VerifyResult(False, f"FAIL: {p.name} is not a {REPORT_SCHEMA_ID} report")
    result = verify_report(doc, trusted_keys=trusted_keys, peer_heads=held)
    if result.ok and data != report_to_bytes(doc):
        expected = report_to_bytes(doc).split(b"\n")
        got = data.split(b"\n")
        line = next(
            (i + 1 for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
            min(len(got), len(expected)) + 1,
        )
        return VerifyResult(
            False,
            f"FAIL: report of {result.org}: line {line}: bytes changed outside the "
            "signed values (the file is not in its written form)",
            "report",
            result.org,
            location=f"line {line}",
        )
    return result


def main(
    path: Path | str,
    *,
    peer_logs: Iterable[Path | str] = (),
    keys: Mapping[str, bytes] | None = None,
) -> int:
    """``fedweave audit verify PATH``: print the one-line summary, return the exit code."""
    result = verify_path(path, trusted_keys=keys, peer_logs=peer_logs)
    print(result.summary)
    return result.exit_code
