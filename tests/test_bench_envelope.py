"""``python -m bench.envelope``: one envelope's real send-and-check path against its
signature alone."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
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
    }
    assert all(r["value"] > 0 and r["baseline"] > 0 and r["ratio"] > 0 for r in rows.values())
