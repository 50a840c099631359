"""The benchmark convention shared by every ``bench/`` module.

A benchmark builds a :class:`Report` of :class:`Row` objects, each a measured value
next to a baseline measured in the same run, and calls :func:`run_main`, which parses
``--quick`` and ``--json PATH``, prints a table and writes
``{"rows": [{"name", "value", "unit", "baseline", "ratio"}], ...}``. Without ``--json``
the JSON goes to ``bench/results/NAME.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Report",
    "Row",
    "available_memory",
    "best_of",
    "can_measure_memory",
    "peak_rss_since_reset",
    "run_main",
    "timed",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Row:
    """One measured figure.

    name: what is measured, e.g. ``mask_vs_prg[n=10,params=1M]``.
    value: the measured figure (for a ratio row, the ratio itself).
    unit: the unit of ``value`` and ``baseline`` (``s``, ``B/param``, ``x``, ...).
    baseline: the same figure for the baseline, measured in the same run (None if the
        row is an absolute report with no baseline).
    ratio: value / baseline when both exist, else None.
    target: the figure to reach, as text (``<= 1.5``), or None.
    ok: whether ``ratio`` (or ``value``) meets ``target``; None when there is no target.
    note: free text (parameters, caveats).
    """

    name: str
    value: float
    unit: str
    baseline: float | None = None
    ratio: float | None = None
    target: str | None = None
    ok: bool | None = None
    note: str = ""


def _meets(x: float, target: str) -> bool:
    op, _, num = target.strip().partition(" ")
    bound = float(num)
    return {"<=": x <= bound, "<": x < bound, ">=": x >= bound, ">": x > bound}[op]


@dataclass
class Report:
    """Rows of one benchmark run plus the machine it ran on."""

    bench: str
    quick: bool
    rows: list[Row] = field(default_factory=list)

    def add(
        self,
        name: str,
        value: float,
        unit: str,
        baseline: float | None = None,
        *,
        target: str | None = None,
        note: str = "",
        ratio: float | None = None,
        target_is_absolute: bool = False,
    ) -> Row:
        """Add a row; the ratio is value / baseline unless given, checked against target
        (the value itself with ``target_is_absolute``, or when there is no ratio)."""
        if ratio is None and baseline not in (None, 0):
            assert baseline is not None
            ratio = value / baseline
        checked = value if target_is_absolute or ratio is None else ratio
        ok = _meets(checked, target) if target else None
        row = Row(name, value, unit, baseline, ratio, target, ok, note)
        self.rows.append(row)
        return row

    def to_json(self) -> dict[str, Any]:
        return {
            "bench": self.bench,
            "quick": self.quick,
            "machine": {
                "python": platform.python_version(),
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
            },
            "rows": [asdict(r) for r in self.rows],
        }

    def table(self) -> str:
        head = ("name", "value", "unit", "baseline", "ratio", "target", "ok")
        body = [
            (
                r.name,
                _fmt(r.value),
                r.unit,
                _fmt(r.baseline),
                _fmt(r.ratio),
                r.target or "",
                "" if r.ok is None else ("yes" if r.ok else "NO"),
            )
            for r in self.rows
        ]
        widths = [max(len(str(c)) for c in col) for col in zip(head, *body, strict=True)]
        lines = [
            "  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True))
            for line in [head, *body]
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _fmt(x: float | None) -> str:
    if x is None:
        return ""
    if x == 0 or 1e-3 <= abs(x) < 1e6:
        return f"{x:.4g}"
    return f"{x:.3e}"


def timed(fn: Callable[[], object]) -> float:
    """Wall-clock seconds of one call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def best_of(fn: Callable[[], object], repeats: int = 3, *, stat: str = "min") -> float:
    """Seconds for ``fn``: the minimum (default) or median of ``repeats`` runs."""
    times = [timed(fn) for _ in range(max(1, repeats))]
    return min(times) if stat == "min" else statistics.median(times)


def run_main(
    bench: str,
    body: Callable[[Report], None],
    argv: Sequence[str] | None = None,
    *,
    description: str = "",
) -> Report:
    """Parse the convention's flags, run ``body``, print the table, write the JSON."""
    parser = argparse.ArgumentParser(prog=f"python -m bench.{bench}", description=description)
    parser.add_argument(
        "--quick", action="store_true", help="small sizes; under a minute on 2 cores"
    )
    parser.add_argument("--json", type=Path, default=None, help="where to write the rows as JSON")
    args = parser.parse_args(argv)
    report = Report(bench=bench, quick=args.quick)
    body(report)
    print(report.table())
    out = args.json or RESULTS_DIR / f"{bench}{'.quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    print(f"\nwrote {out}", file=sys.stderr)
    return report


# -- memory (Linux: /proc) ---------------------------------------------------------------


def _rss() -> tuple[int, int]:
    """This process's resident bytes now and at their peak (``VmRSS``, ``VmHWM``)."""
    now = peak = 0
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(("VmRSS:", "VmHWM:")):
                value = int(line.split()[1]) * 1024
                if line.startswith("VmRSS:"):
                    now = value
                else:
                    peak = value
    return now, peak


def peak_rss_since_reset() -> Callable[[], int]:
    """Reset this process's peak resident set (``/proc/self/clear_refs``, value 5) and
    return a reader of how far it rose above the resident set at the reset, in bytes."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
        refs.write("5")
    before, _ = _rss()
    return lambda: max(0, _rss()[1] - before)


def can_measure_memory() -> bool:
    """Whether this platform lets :func:`peak_rss_since_reset` work (Linux)."""
    try:
        peak_rss_since_reset()
    except OSError:
        return False
    return True


def available_memory() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, bytes (0 where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
