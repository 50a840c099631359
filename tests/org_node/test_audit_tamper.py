"""Tampering with a log or a report is detected and pinpointed.

Each field of each record is changed in turn, every single byte of a log file is
flipped, and entries are removed, duplicated and reordered; every leaf of a report is
changed in turn and a spread of its bytes flipped. Verification must fail every time,
naming the entry (or section) where the damage is.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from coordinator_free.identity import OrgIdentity
from coordinator_free.wire import Envelope

from org_node.audit.log import ENTRY_FIELDS, HEAD_FIELDS, EgressLog, canonical
from org_node.audit.report import (
    ConsentRecord,
    RoundFacts,
    RunFacts,
    SecAggFacts,
    build_report,
    report_to_bytes,
)
from org_node.audit.verify import verify_log, verify_path, verify_report
from org_node.policy import Policy, RunSpec

KINDS = ["round.ready", "round.share", "agg.chunk", "agg.chunk.reply", "swim.ping", "round.model"]


def identity(org: str) -> OrgIdentity:
    return OrgIdentity.generate(org, hashlib.sha256(org.encode()).digest())


KEYS = {o: identity(o).public_key for o in ("a", "b", "c")}


def _clock() -> Any:
    t = [1_800_000_000.0]

    def clock() -> float:
        t[0] += 0.25
        return t[0]

    return clock


def make_log(path: Path, rounds: int = 2) -> EgressLog:
    """Nine entries of run r over two rounds, two signed heads, one held peer head."""
    a = identity("a")
    log = EgressLog(a, path, clock=_clock())
    seq = 0
    for rnd in range(1, rounds + 1):
        for i, kind in enumerate(KINDS[: 3 if rnd == 1 else 6]):
            seq += 1
            env = Envelope(
                federation="fed",
                run="r",
                round=rnd,
                stage="st",
                kind=kind,
                sender="a",
                recipient="bc"[i % 2],
                seq=seq,
                sent_at=1_800_000_000.0,
                payload=bytes([i]) * (10 + i),
            )
            env = env.with_signature(a.sign(env.signing_bytes()))
            log.record(env, env.to_wire())
        log.sign_head("r", rnd)
        if rnd == 1:
            b_log = EgressLog(identity("b"))
            log.hold_peer_head(b_log.sign_head("r", 1), KEYS["b"])
    log.close()
    return log


def facts() -> RunFacts:
    return RunFacts(
        run="r",
        spec=RunSpec(trainer="breast_cancer", rounds=2, participants=("a", "b", "c"), threshold=2),
        policies={"default": Policy()},
        consents=(ConsentRecord("a", "accepted", "2026-01-01T00:00:00Z", "admin"),),
        secure_aggregation=SecAggFacts("masked", 3, 2, 32, 1.0),
        rounds=(
            RoundFacts(1, ("a", "b", "c"), ("a", "b", "c"), model_hash="ab" * 32, loss=0.9),
            RoundFacts(2, ("a", "b", "c"), ("a", "b"), ("c",), ("c",), "cd" * 32, loss=0.5),
        ),
        anomalies=("clock skew of 2 s seen from c",),
    )


@pytest.fixture()
def log_path(tmp_path: Path) -> Path:
    make_log(tmp_path / "a.log")
    return tmp_path / "a.log"


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")[:-1]


def _write(path: Path, lines: list[bytes]) -> None:
    path.write_bytes(b"\n".join(lines) + b"\n")


def _changed(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 1.5 + 1.0
    if isinstance(value, str):
        if len(value) in (64, 128) and all(c in "0123456789abcdef" for c in value):
            return ("0" if value[0] != "0" else "1") + value[1:]
        return value + "x"
    if value is None:
        return 0
    raise TypeError(type(value))


def test_the_untouched_log_verifies(log_path: Path) -> None:
    result = verify_log(log_path, trusted_keys=KEYS)
    assert result.ok and result.entries == 9 and result.heads == 2, result.summary


@pytest.mark.parametrize("field", [f for f in ENTRY_FIELDS if f != "index"])
def test_changing_any_field_of_any_entry_names_that_entry(log_path: Path, field: str) -> None:
    lines = _lines(log_path)
    entry_lines = [i for i, line in enumerate(lines) if b'"type":"entry"' in line]
    for pos in entry_lines:
        record = json.loads(lines[pos])
        record[field] = _changed(record[field])
        tampered = list(lines)
        tampered[pos] = canonical(record)
        _write(log_path, tampered)
        result = verify_log(log_path, trusted_keys=KEYS)
        assert not result.ok, (field, pos)
        index = json.loads(lines[pos])["index"]
        # a changed entry_hash is only seen by the next link (or the head after it)
        assert f"entry {index} " in result.summary or (
            field == "entry_hash"
            and (f"entry {index + 1} " in result.summary or "head" in result.summary)
        ), result.summary


def test_changing_an_entry_index_is_named_as_out_of_order(log_path: Path) -> None:
    lines = _lines(log_path)
    record = json.loads(lines[3])
    record["index"] += 1
    _write(log_path, [*lines[:3], canonical(record), *lines[4:]])
    result = verify_log(log_path)
    assert not result.ok and "line 4" in result.summary and "missing" in result.summary


@pytest.mark.parametrize("field", HEAD_FIELDS)
def test_changing_any_field_of_a_signed_head_is_detected(log_path: Path, field: str) -> None:
    lines = _lines(log_path)
    for pos in [i for i, line in enumerate(lines) if line.startswith(b'{"head"')]:
        record = json.loads(lines[pos])
        record["head"][field] = _changed(record["head"][field])
        _write(log_path, [*lines[:pos], canonical(record), *lines[pos + 1 :]])
        result = verify_log(log_path, trusted_keys=KEYS)
        assert not result.ok, (field, pos)
        assert f"line {pos + 1}" in result.summary, result.summary


@pytest.mark.parametrize("field", ["org", "public_key", "created", "version"])
def test_changing_the_header_breaks_the_chain_at_entry_0(log_path: Path, field: str) -> None:
    lines = _lines(log_path)
    header = json.loads(lines[0])
    header[field] = _changed(header[field])
    _write(log_path, [canonical(header), *lines[1:]])
    result = verify_log(log_path)
    assert not result.ok
    assert "entry 0" in result.summary or "line 1" in result.summary, result.summary


def test_every_single_byte_flip_of_the_log_is_detected(tmp_path: Path) -> None:
    """Letters flip case (the subtle change: hex digits of either case parse), others bit 0.

    The one-round log has every record type: header, entries, a head, a held peer head.
    """
    log_path = tmp_path / "small.log"
    make_log(log_path, rounds=1)
    data = log_path.read_bytes()
    for pos in range(len(data)):
        mask = 0x20 if chr(data[pos]).isalpha() else 0x01
        flipped = bytearray(data)
        flipped[pos] ^= mask
        log_path.write_bytes(bytes(flipped))
        assert not verify_log(log_path, trusted_keys=KEYS).ok, (pos, mask)


def _entry_positions(lines: list[bytes]) -> list[int]:
    return [i for i, line in enumerate(lines) if b'"type":"entry"' in line]


def test_a_removed_entry_is_named(log_path: Path) -> None:
    lines = _lines(log_path)
    for pos in _entry_positions(lines):
        index = json.loads(lines[pos])["index"]
        _write(log_path, lines[:pos] + lines[pos + 1 :])
        result = verify_log(log_path)
        assert not result.ok
        next_is_head = pos + 1 < len(lines) and lines[pos + 1].startswith(b'{"head"')
        if next_is_head:  # the last entry before a head: the head no longer follows it
            assert "head" in result.summary, result.summary
        else:
            assert f"entry {index} missing" in result.summary, result.summary


def test_a_duplicated_entry_is_named(log_path: Path) -> None:
    lines = _lines(log_path)
    for pos in _entry_positions(lines):
        index = json.loads(lines[pos])["index"]
        _write(log_path, [*lines[: pos + 1], lines[pos], *lines[pos + 1 :]])
        result = verify_log(log_path)
        assert not result.ok
        assert f"entry {index} (line {pos + 2}): repeats" in result.summary, result.summary


def test_reordered_entries_are_named(log_path: Path) -> None:
    lines = _lines(log_path)
    positions = _entry_positions(lines)
    for pos in positions:
        if pos + 1 not in positions:
            continue
        swapped = list(lines)
        swapped[pos], swapped[pos + 1] = swapped[pos + 1], swapped[pos]
        _write(log_path, swapped)
        result = verify_log(log_path)
        assert not result.ok
        later = json.loads(lines[pos + 1])["index"]
        assert f"entry {later} (line {pos + 1})" in result.summary, result.summary


def test_a_truncated_last_line_is_named(log_path: Path) -> None:
    data = log_path.read_bytes()
    log_path.write_bytes(data[:-10])
    result = verify_log(log_path)
    assert not result.ok and "truncated" in result.summary


# -- reports -------------------------------------------------------------------------------


@pytest.fixture()
def report(tmp_path: Path) -> dict[str, Any]:
    return build_report(make_log(tmp_path / "r.log"), facts())


def _leaves(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _leaves(value, (*path, i))
    else:
        yield path


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        doc = doc[key]
    doc[path[-1]] = value


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def test_the_untouched_report_verifies(report: dict[str, Any]) -> None:
    result = verify_report(report, trusted_keys=KEYS)
    assert result.ok, result.summary
    assert result.entries == 9 and result.heads == 2


def test_changing_any_value_of_a_report_is_detected_and_placed(report: dict[str, Any]) -> None:
    leaves = list(_leaves(report))
    assert len(leaves) > 150
    for path in leaves:
        doc = copy.deepcopy(report)
        _set(doc, path, _changed(_get(doc, path)))
        result = verify_report(doc, trusted_keys=KEYS)
        assert not result.ok, path
        top = path[0]
        if top == "log" and path[1] == "records":
            assert f"log.records[{path[2]}]" in result.summary or "entry" in result.summary
        elif top in ("schema", "org", "generated_at", "signature"):
            assert result.location, path
        else:
            assert top in result.summary or "report." in result.summary, (path, result.summary)


@pytest.mark.parametrize("action", ["remove", "duplicate", "swap"])
def test_removed_duplicated_or_reordered_report_entries_are_named(
    report: dict[str, Any], action: str
) -> None:
    records = report["log"]["records"]
    entries = [i for i, r in enumerate(records) if r["type"] == "entry"]
    for pos in entries:
        doc = copy.deepcopy(report)
        recs = doc["log"]["records"]
        if action == "remove":
            del recs[pos]
        elif action == "duplicate":
            recs.insert(pos, copy.deepcopy(recs[pos]))
        else:
            if pos + 1 not in entries:
                continue
            recs[pos], recs[pos + 1] = recs[pos + 1], recs[pos]
        result = verify_report(doc)
        assert not result.ok, (action, pos)
        assert "log.records[" in result.summary or "traffic" in result.summary, result.summary


def test_cutting_the_report_segment_short_is_detected(report: dict[str, Any]) -> None:
    doc = copy.deepcopy(report)
    del doc["log"]["records"][-1]  # the closing signed head
    result = verify_report(doc)
    assert not result.ok and "no signed head" in result.summary


def test_byte_flips_in_a_report_file_are_detected(report: dict[str, Any], tmp_path: Path) -> None:
    data = report_to_bytes(report)
    path = tmp_path / "report.json"
    path.write_bytes(data)
    assert verify_path(path, trusted_keys=KEYS).ok
    stride = max(1, len(data) // 300)
    for pos in range(0, len(data), stride):
        flipped = bytearray(data)
        flipped[pos] ^= 0x01
        path.write_bytes(bytes(flipped))
        result = verify_path(path, trusted_keys=KEYS)
        assert not result.ok, pos
