"""The benchmark convention: table and JSON rows."""

from __future__ import annotations

import json
from pathlib import Path

from bench.common import Report, run_main


def test_rows_ratio_and_target(tmp_path: Path) -> None:
    def body(r: Report) -> None:
        r.add("a", 3.0, "s", 2.0, target="<= 1.5")
        r.add("b", 4.0, "B/param", target="<= 4.0")
        r.add("c", 1.0, "s", 4.0, target=">= 0.5")

    out = tmp_path / "r.json"
    report = run_main("demo", body, ["--quick", "--json", str(out)])
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert set(rows["a"]) >= {"name", "value", "unit", "baseline", "ratio"}
    assert rows["a"]["ratio"] == 1.5 and rows["a"]["ok"] is True
    assert rows["b"]["ratio"] is None and rows["b"]["ok"] is True
    assert rows["c"]["ok"] is False
    assert data["quick"] is True
    assert "ratio" in report.table()


def test_an_absolute_target_is_checked_on_the_value(tmp_path: Path) -> None:
    def body(r: Report) -> None:
        r.add("abs", 0.2, "s", 10.0, target="<= 0.3", target_is_absolute=True)
        r.add("abs_miss", 0.5, "s", 10.0, target="<= 0.3", target_is_absolute=True)

    report = run_main("demo", body, ["--json", str(tmp_path / "r.json")])
    rows = {r.name: r for r in report.rows}
    assert rows["abs"].ratio == 0.02 and rows["abs"].ok is True
    assert rows["abs_miss"].ok is False  # its ratio 0.05 would have passed


def test_round_overhead_is_what_remains_after_compute_and_the_secure_sum() -> None:
    from bench.round_overhead import overheads

    metrics = {
        "org1": {
            1: {"round_s": 9.0, "local_compute_s": 1.0, "secure_sum_s": 1.0},
            2: {"round_s": 2.0, "local_compute_s": 1.25, "secure_sum_s": 0.5},
        },
        "org2": {
            2: {"round_s": 1.0},
            3: {"round_s": 3.0, "local_compute_s": 2.0, "secure_sum_s": 0.75},
        },
    }
    found = overheads(metrics)
    assert found == {"overhead": [0.25, 0.25], "compute": [1.25, 2.0], "sum": [0.5, 0.75]}
