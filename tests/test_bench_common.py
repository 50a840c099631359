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
