"""``python -m bench.envelope``: one envelope's real send-and-check path against its
signature alone."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from coordinator_free.rounds.ahead import Ahead
from coordinator_free.transport import MessageGuard

from bench import envelope as bench_envelope


def test_the_timed_round_trip_is_the_real_path_and_checks_what_came_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent, signature = bench_envelope.round_trip(b"x" * 100)
    sent()  # the receiver's guard takes it: signed, fresh, for this recipient
    sent()  # a second one too: a new sequence number, so no replay
    signature()
    # a payload the receiver does not get back as sent is an error, not a figure
    monkeypatch.setattr(MessageGuard, "check", lambda self, data: SimpleNamespace(payload=b"y"))
    with pytest.raises(RuntimeError, match="did not come through"):
        sent()


@pytest.mark.parametrize("parse_all", [False, True])
def test_the_timed_ready_record_is_read_as_a_holder_reads_it(
    parse_all: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    parse, verification = bench_envelope.ready_record(6, parse_all=parse_all)
    parse()  # the holder's blob, the advertisement and the signed bytes come through
    verification()
    # a parse that loses the holder's blob is an error, not a figure
    monkeypatch.setattr(
        Ahead, "from_bytes", classmethod(lambda cls, data, only=None: Ahead(data[:32]))
    )
    with pytest.raises(RuntimeError, match="blob did not come through"):
        parse()


def test_quick_mode_writes_one_row_per_payload_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench_envelope, "SIZES", (("100B", 100), ("4KB", 4096)))
    out = tmp_path / "envelope.json"
    bench_envelope.main(["--quick", "--json", str(out)])
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {
        "envelope_vs_signature[payload=100B]",
        "envelope_vs_signature[payload=4KB]",
        "ready_record_parse_vs_verification[blobs=24, parse=own]",
        "ready_record_parse_vs_verification[blobs=24, parse=all]",
        "ready_record_tag_vs_verification[blobs=24, members=256]",
    }
    assert all(r["value"] > 0 and r["baseline"] > 0 and r["ratio"] > 0 for r in rows.values())


def test_the_timed_tag_check_checks_a_real_tag_and_its_baseline_a_real_signature() -> None:
    tag, verification = bench_envelope.record_tag(blobs=4, members=8)
    tag()  # raises when the receiver's tag does not check
    verification()
