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

Items 2 to 5 are the chain check of :mod:`org_node.audit.chain` (whose
:class:`VerifyResult` and :func:`verify_records` are importable from here too).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from coordinator_free.identity import verify_signature

from org_node.audit.chain import (
    Broken,
    Chain,
    VerifyResult,
    check_peer_heads,
    log_key,
    lost_in_wipe,
    verify_records,
)
from org_node.audit.dp_section import recomputed_dp_section
from org_node.audit.records import (
    EgressEntry,
    LogFormatError,
    SignedHead,
    check_header,
    genesis_hash,
    read_log,
)
from org_node.audit.report import (
    REPORT_SCHEMA_ID,
    SECTIONS,
    ReportError,
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


def _report_key(
    doc: Any, org: str, trusted_keys: Mapping[str, bytes] | None
) -> tuple[dict[str, Any], bytes, bool]:
    """Check the report against its schema and its log header against the report's org;
    ``(header, key, pinned)``."""
    try:
        validate_report(doc)
    except SchemaError as exc:
        raise Broken(exc.path, str(exc).split(": ", 1)[1]) from None
    try:
        header = check_header(doc["log"]["header"], 0)
    except LogFormatError as exc:
        raise Broken("log.header", exc.detail) from None
    if header["org"] != org:
        raise Broken("log.header", f"the log is of {header['org']!r}, the report of {org!r}")
    key, pinned = log_key(header, trusted_keys)
    return header, key, pinned


def _parse_records(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, Any]]:
    """The log segment's records as ``(where, "entry" | "head", value)``."""
    parsed: list[tuple[str, str, Any]] = []
    for i, rec in enumerate(rows):
        where = f"log.records[{i}]"
        try:
            if rec.get("type") == "entry":
                parsed.append((where, "entry", EgressEntry.from_record(rec)))
            elif rec.get("type") == "head" and set(rec) == {"type", "head"}:
                parsed.append((where, "head", SignedHead.from_dict(rec["head"])))
            else:
                raise Broken(where, "not an entry or a head record")
        except LogFormatError as exc:
            raise Broken(where, exc.detail) from None
    return parsed


def _check_segment(
    doc: Any, org: str, header: Mapping[str, Any], key: bytes, parsed: list[tuple[str, str, Any]]
) -> Chain:
    """Chain the segment's records from the start of the traffic window to a signed head
    at its end; the checked chain."""
    first = next((v for _, t, v in parsed if t == "entry"), None)
    if first is None:
        raise Broken("log.records", "the report carries no log entry")
    window = doc["traffic"]["window"]
    if first.index > window["first_index"]:
        raise Broken(
            "log.records[0]",
            f"entries {window['first_index']}..{first.index - 1} are missing from the "
            "start of the segment",
            first.index,
        )
    start_prev = genesis_hash(header) if first.index == 0 else first.prev_hash
    chain = Chain(org, key, start_prev, first.index, header.get("recovered"))
    for where, kind, value in parsed:
        if kind == "entry":
            chain.entry(value, where)
        else:
            chain.head(value, where)
    if parsed[-1][1] != "head":
        raise Broken(
            "log.records",
            f"the segment ends at entry {chain.next - 1} with no signed head covering it "
            "(entries removed from the end)",
        )
    return chain


def _check_signature(doc: Any, org: str, key: bytes) -> None:
    """Each section's digest as signed, and the org's signature over the report."""
    digests = section_digests(doc)
    claimed = doc["signature"]["sections"]
    for name in SECTIONS:
        if claimed.get(name) != digests[name]:
            raise Broken(name, "the section was changed after the report was signed")
    if set(claimed) != set(SECTIONS):
        raise Broken("signature.sections", "names sections the report does not have")
    signature = bytes.fromhex(doc["signature"]["value"])
    if not verify_signature(key, report_signing_bytes(doc, digests), signature):
        raise Broken("signature", f"not a valid signature of {org!r} over the report")


def verify_report(
    doc: Any,
    *,
    trusted_keys: Mapping[str, bytes] | None = None,
    peer_heads: Iterable[SignedHead] = (),
) -> VerifyResult:
    """Verify a report document (see the module docstring)."""
    org = doc.get("org", "") if isinstance(doc, dict) else ""
    try:
        header, key, pinned = _report_key(doc, org, trusted_keys)
        parsed = _parse_records(doc["log"]["records"])
        chain = _check_segment(doc, org, header, key, parsed)
        _check_signature(doc, org, key)
        consents = _check_consents(doc, trusted_keys)
        entries = [v for _, t, v in parsed if t == "entry"]
        actual = traffic_of(entries, doc["run"]["id"])
        if doc["traffic"] != actual:
            raise Broken("traffic", _first_difference("traffic", doc["traffic"], actual))
        _check_dp(doc)
        checked = check_peer_heads(chain, peer_heads)
    except Broken as exc:
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
        + (
            f", agrees with {checked - len(chain.lost)} head(s) held by peers"
            if checked > len(chain.lost)
            else ""
        )
        + lost_in_wipe(chain)
        + consents
        + ("" if pinned else " (key from the report, not pinned)")
    )
    return VerifyResult(True, summary, "report", org, chain.entries, chain.heads, checked)


def _check_dp(doc: Mapping[str, Any]) -> None:
    """The DP section must be what its agreed mechanism, the rounds' survivors and the
    spec's budget give (each figure to 1e-9 relative)."""
    try:
        actual = recomputed_dp_section(doc)
    except (ReportError, ValueError, KeyError, TypeError) as exc:
        raise Broken("differential_privacy", f"cannot be recomputed: {exc}") from None
    if actual is None:
        return
    claimed = doc["differential_privacy"]
    if not _close(claimed, actual):
        raise Broken(
            "differential_privacy",
            "does not follow from the agreed mechanism and the rounds' survivors: "
            + _first_difference("differential_privacy", claimed, actual),
        )


def _close(a: Any, b: Any) -> bool:
    """Equal, numbers to 1e-9 relative (ε is recomputed, possibly on another machine)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    both_numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (a, b))
    if both_numbers:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return bool(a == b)


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
            raise Broken(
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
    peer_heads: Iterable[SignedHead] = (),
) -> VerifyResult:
    """Verify a log (JSON lines) or a report (one JSON object) at ``path``.

    ``peer_logs``: peers' log files, whose held heads of this org are cross-checked, as
    are ``peer_heads`` (heads the peers hold, fetched from them).
    """
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        return VerifyResult(False, f"FAIL: cannot read {p.name}: {exc.strerror}")
    try:
        held = [*peer_heads_from_logs(peer_logs), *peer_heads]
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
