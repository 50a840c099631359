"""``python -m bench.overlay --only SECTION``: the parts of the benchmark run alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import overlay


def test_only_membership_runs_the_membership_rows_alone(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    overlay.main(["--quick", "--only", "membership", "--json", str(out)])
    names = [row["name"] for row in json.loads(out.read_text())["rows"]]
    assert names == [
        "detect_seconds[n=16]",
        "detect_periods[n=16]",
        "disseminate_periods[n=16]",
        "msgs_per_node_per_period[n=16]",
    ]


def test_the_largest_round_alone_is_refused_in_quick_mode_and_an_unknown_part_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit, match="runs in full mode only"):
        overlay.main(["--quick", "--only", "largest"])
    with pytest.raises(SystemExit) as unknown:
        overlay.main(["--only", "everything"])
    assert unknown.value.code == 2
    assert "invalid choice: 'everything'" in capsys.readouterr().err
