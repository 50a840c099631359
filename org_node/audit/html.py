"""A self-contained HTML page of a privacy audit report, with inline SVG charts.

The page references nothing outside itself (no script, stylesheet, font or image is
fetched: it renders offline and in an archive), escapes every string taken from the
report (:func:`html.escape`), needs no JavaScript, and carries print CSS so that the
tables and charts stay readable on paper (black-on-white, line styles and hatched
fills that do not depend on colour, no page break inside a table row or chart).

Charts: ε over rounds (per round and cumulative, with the budget when there is one),
bytes sent per round by privacy class (stacked bars), loss and accuracy per round.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["bar_chart_svg", "line_chart_svg", "render_html"]

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:2em;
color:#111;background:#fff;line-height:1.4}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.2em;border-bottom:1px solid #999;
margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0;font-size:.9em}
th,td{border:1px solid #999;padding:.25em .5em;text-align:left;vertical-align:top}
th{background:#eee}td.num{text-align:right;font-variant-numeric:tabular-nums}
code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.85em;word-break:break-all}
.ok{color:#064}.bad{color:#a00;font-weight:bold}
figure{margin:1em 0}figcaption{font-size:.9em;color:#333}
svg text{font-family:inherit;font-size:11px;fill:#111}
@media print{body{margin:1cm;font-size:10pt}h2{break-after:avoid}
tr,figure,svg{break-inside:avoid}.ok,.bad{color:#000}th{background:#ddd}}
"""

_STROKES = ("#1f4e79", "#a33", "#385723", "#7030a0", "#c55a11", "#333")
_DASHES = ("", "6 3", "2 2", "8 3 2 3", "1 3", "10 4")
_FILLS = (
    "#1f4e79",
    "#c55a11",
    "#70ad47",
    "#7030a0",
    "#bf9000",
    "#5b9bd5",
    "#a33",
    "#666",
    "#ccc",
    "#000",
)


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _num(value: float) -> str:
    if abs(value) >= 1e6 or (0 < abs(value) < 1e-3):
        return f"{value:.3g}"
    return f"{value:,.4g}" if isinstance(value, float) else f"{value:,}"


def _ticks(top: float, count: int = 4) -> list[float]:
    if top <= 0:
        return [0.0]
    return [top * i / count for i in range(count + 1)]


_W, _H, _L, _R, _T, _B = 560, 260, 64, 150, 16, 44


def _frame(title: str, x_label: str, y_label: str, y_max: float) -> list[str]:
    pw, ph = _W - _L - _R, _H - _T - _B
    out = [
        f'<svg role="img" width="{_W}" height="{_H}" '
        f'viewBox="0 0 {_W} {_H}"><title>{_e(title)}</title>',
        f'<rect x="{_L}" y="{_T}" width="{pw}" height="{ph}" fill="none" stroke="#111"/>',
    ]
    for tick in _ticks(y_max):
        y = _T + ph - (tick / y_max * ph if y_max > 0 else 0)
        out.append(f'<line x1="{_L - 4}" y1="{y:.1f}" x2="{_L + pw}" y2="{y:.1f}" stroke="#ccc"/>')
        out.append(f'<text x="{_L - 6}" y="{y + 4:.1f}" text-anchor="end">{_e(_num(tick))}</text>')
    out.append(
        f'<text x="{_L + pw / 2:.1f}" y="{_H - 6}" text-anchor="middle">{_e(x_label)}</text>'
    )
    out.append(
        f'<text x="14" y="{_T + ph / 2:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 14 {_T + ph / 2:.1f})">{_e(y_label)}</text>'
    )
    return out


def _legend(labels: Sequence[str], swatch: Any) -> list[str]:
    out = []
    for i, label in enumerate(labels):
        y = _T + 8 + 16 * i
        out.append(swatch(i, _W - _R + 12, y))
        out.append(f'<text x="{_W - _R + 40}" y="{y + 4}">{_e(label)}</text>')
    return out


def line_chart_svg(
    title: str,
    x_label: str,
    y_label: str,
    series: Mapping[str, Sequence[tuple[float, float]]],
) -> str:
    """An inline SVG line chart; each series gets its own colour *and* dash pattern."""
    points = [p for s in series.values() for p in s]
    if not points:
        return f"<p>{_e(title)}: no data.</p>"
    x_min = min(x for x, _ in points)
    x_max = max(x for x, _ in points)
    y_max = max(max(y for _, y in points), 0.0) * 1.1 or 1.0
    pw, ph = _W - _L - _R, _H - _T - _B
    span = (x_max - x_min) or 1.0

    def sx(x: float) -> float:
        return _L + (x - x_min) / span * pw

    def sy(y: float) -> float:
        return _T + ph - max(y, 0.0) / y_max * ph

    out = _frame(title, x_label, y_label, y_max)
    for x in sorted({x for x, _ in points}):
        out.append(
            f'<text x="{sx(x):.1f}" y="{_T + ph + 14}" text-anchor="middle">{_e(_num(x))}</text>'
        )
    for i, (_, pts) in enumerate(series.items()):
        stroke, dash = _STROKES[i % len(_STROKES)], _DASHES[i % len(_DASHES)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(
            f'<polyline points="{path}" fill="none" stroke="{stroke}" stroke-width="2"{dash_attr}/>'
        )
        for x, y in pts:
            out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{stroke}"/>')

    def swatch(i: int, x: float, y: float) -> str:
        dash = _DASHES[i % len(_DASHES)]
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        return (
            f'<line x1="{x}" y1="{y}" x2="{x + 24}" y2="{y}" stroke="{_STROKES[i % len(_STROKES)]}" '
            f'stroke-width="2"{dash_attr}/>'
        )

    out.extend(_legend(list(series), swatch))
    out.append("</svg>")
    return "".join(out)


def bar_chart_svg(
    title: str,
    x_label: str,
    y_label: str,
    categories: Sequence[str],
    stacks: Mapping[str, Sequence[float]],
) -> str:
    """An inline SVG stacked bar chart: one bar per category, one stack per series."""
    if not categories or not stacks:
        return f"<p>{_e(title)}: no data.</p>"
    totals = [sum(s[i] for s in stacks.values()) for i in range(len(categories))]
    y_max = max(totals) * 1.1 or 1.0
    pw, ph = _W - _L - _R, _H - _T - _B
    slot = pw / len(categories)
    width = max(slot * 0.7, 1.0)
    patterns = [
        f'<pattern id="h{i}" width="6" height="6" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate({(i * 45) % 180})"><rect width="6" height="6" '
        f'fill="{_FILLS[i % len(_FILLS)]}"/><line x1="0" y1="0" x2="0" y2="6" '
        f'stroke="#fff" stroke-width="{1 + i % 3}"/></pattern>'
        for i in range(len(stacks))
    ]
    out = _frame(title, x_label, y_label, y_max)
    out.insert(1, "<defs>" + "".join(patterns) + "</defs>")
    for c, name in enumerate(categories):
        x = _L + c * slot + (slot - width) / 2
        base = 0.0
        for i, values in enumerate(stacks.values()):
            v = values[c]
            if v <= 0:
                continue
            h = v / y_max * ph
            y = _T + ph - (base / y_max * ph) - h
            out.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" height="{h:.1f}" '
                f'fill="url(#h{i})" stroke="#111" stroke-width="0.5"/>'
            )
            base += v
        out.append(
            f'<text x="{x + width / 2:.1f}" y="{_T + ph + 14}" text-anchor="middle">{_e(name)}</text>'
        )

    def swatch(i: int, x: float, y: float) -> str:
        return f'<rect x="{x}" y="{y - 6}" width="24" height="12" fill="url(#h{i})" stroke="#111"/>'

    out.extend(_legend(list(stacks), swatch))
    out.append("</svg>")
    return "".join(out)


def _table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], numeric: Iterable[int] = ()
) -> str:
    nums = set(numeric)
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for i, cell in enumerate(row):
            if i in nums and isinstance(cell, int | float) and not isinstance(cell, bool):
                cells.append(f'<td class="num">{_e(_num(cell))}</td>')
            else:
                cells.append(f"<td>{_e(cell)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    if not body:
        body.append(f'<tr><td colspan="{len(headers)}">none</td></tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _names(values: Sequence[str]) -> str:
    return ", ".join(values) if values else "—"


def _status(ok: bool, yes: str, no: str) -> str:
    return f'<span class="ok">{_e(yes)}</span>' if ok else f'<span class="bad">{_e(no)}</span>'


def _heading(report: Mapping[str, Any], verification: str | None) -> list[str]:
    """The page's head, title and the one-paragraph verdict (verification, forbidden
    classes, policy violations, anomalies)."""
    run = report["run"]
    traffic = report["traffic"]
    parts: list[str] = [
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        f"<title>Privacy audit: {_e(run['id'])} at {_e(report['org'])}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>Privacy audit report — run {_e(run['id'])}</h1>",
        f"<p>Organization <strong>{_e(report['org'])}</strong>, generated "
        f"{_e(report['generated_at'])}, schema <code>{_e(report['schema'])}</code>.</p>",
    ]
    if verification is not None:
        parts.append(
            f"<p>Verification: {_status(verification.startswith('OK'), verification, verification)}</p>"
        )
    forbidden = traffic["forbidden_messages"]
    parts.append(
        "<p>Forbidden classes (raw data, labels, unmasked update) sent: "
        + _status(forbidden == 0, "none", str(forbidden))
        + ". Policy violations: "
        + _status(run["violations_total"] == 0, "none", str(run["violations_total"]))
        + f". Anomalies: {len(report['anomalies'])}.</p>"
    )
    return parts


def _consent_cells(p: Mapping[str, Any]) -> list[Any]:
    """One participant's row: its decision, when, by whom and why (or what this org holds
    of a decision it did not record)."""
    consent = p["consent"]
    if consent is None:
        return [p["org"], p.get("consent_note", "not recorded here"), "", "", ""]
    role = consent.get("decided_by_role")
    return [
        p["org"],
        consent["decision"],
        consent["decided_at"],
        consent["decided_by"] + (f" ({role})" if role else ""),
        consent["reason"],
    ]


def _participants(report: Mapping[str, Any]) -> list[str]:
    return [
        "<h2>Participants and consent</h2>",
        _table(
            ["Org", "Decision", "Decided at", "Decided by", "Reason"],
            (_consent_cells(p) for p in report["participants"]),
        ),
    ]


def _binding_rows(run: Mapping[str, Any]) -> list[list[Any]]:
    """The trainer and the dataset bound to the run at this org."""
    binding = run.get("binding") or {}
    trainer = binding.get("trainer") or {}
    dataset = binding.get("dataset")
    return [
        ["trainer", trainer.get("name", ""), trainer.get("sha256") or "-", ""],
        (
            ["dataset", dataset["name"], dataset.get("content_hash") or "-", dataset.get("rows")]
            if dataset
            else ["dataset", "none (the run needs no data)", "", ""]
        ),
    ]


def _policy_row(p: Mapping[str, Any]) -> list[Any]:
    """A policy, its requirements and the run's violations of it."""
    requirements = "; ".join(f"{k}={v}" for k, v in sorted(p["policy"].items()) if v is not None)
    if not p["violations"]:
        return [p["name"], requirements, "none"]
    broken = "; ".join(f"{v['requirement']}: {v['message']}" for v in p["violations"])
    return [p["name"], requirements, broken]


def _specification(report: Mapping[str, Any]) -> list[str]:
    run = report["run"]
    spec = run["spec"]
    return [
        "<h2>Run specification and policies</h2>",
        _table(
            ["Trainer", "Rounds", "Participants", "Backend", "Threshold", "ε budget"],
            [
                [
                    spec.get("trainer", spec.get("task", "")),
                    spec["rounds"],
                    _names(spec["participants"]),
                    spec["backend"],
                    spec["threshold"],
                    "none" if spec["epsilon"] is None else spec["epsilon"],
                ]
            ],
            numeric=(1, 4),
        ),
        _table(["Bound at this org", "Name", "Hash", "Rows"], _binding_rows(run)),
        _table(["Policy", "Requirements", "Violations"], (_policy_row(p) for p in run["policies"])),
        *_outcome_table(run),
    ]


def _outcome_table(run: Mapping[str, Any]) -> list[str]:
    """The run's state at this org and why (a failed run's reason), when the report says."""
    if "state" not in run:
        return []
    return [_table(["State at this org", "Why"], [[run["state"], run["state_reason"] or "—"]])]


def _secure_aggregation(report: Mapping[str, Any]) -> list[str]:
    sa = report["secure_aggregation"]
    return [
        "<h2>Secure aggregation</h2>",
        _table(
            ["Backend", "n", "t", "Ring bits", "L2 clip"],
            [[sa["backend"], sa["n"], sa["t"], sa["ring_bits"] or "—", sa["l2_clip"] or "—"]],
            numeric=(1, 2, 3, 4),
        ),
    ]


def _epsilon_chart(dp: Mapping[str, Any]) -> str:
    """ε per round and cumulative over rounds, with the budget when there is one."""
    series: dict[str, list[tuple[float, float]]] = {
        "ε of the round": [(r["round"], r["epsilon"]) for r in dp["rounds"]],
        "ε cumulative": [(r["round"], r["epsilon_cumulative"]) for r in dp["rounds"]],
    }
    if dp["epsilon_budget"] is not None and dp["rounds"]:
        series["ε budget"] = [(r["round"], dp["epsilon_budget"]) for r in dp["rounds"]]
    return (
        "<figure>"
        + line_chart_svg("ε over rounds", "round", f"ε at δ={dp['delta']:g}", series)
        + f"<figcaption>ε(δ={_e(dp['delta'])}) per round and composed over rounds "
        "(Rényi DP accountant).</figcaption></figure>"
    )


def _differential_privacy(report: Mapping[str, Any]) -> list[str]:
    dp = report["differential_privacy"]
    if dp is None:
        return [
            "<h2>Differential privacy</h2>",
            "<p>This run adds no differential-privacy noise.</p>",
        ]
    return [
        "<h2>Differential privacy</h2>",
        _table(
            ["Mechanism", "Noise multiplier", "L2 clip", "δ", "ε total", "ε budget"],
            [
                [
                    dp["mechanism"],
                    ", ".join(_num(v) for v in dp["noise_multipliers"]) or "—",
                    dp["l2_clip"],
                    dp["delta"],
                    dp["epsilon_total"],
                    "none" if dp["epsilon_budget"] is None else dp["epsilon_budget"],
                ]
            ],
            numeric=(2, 3, 4, 5),
        ),
        *_agreed_mechanism(dp.get("agreed")),
        _epsilon_chart(dp),
        _table(
            ["Round", "Survivors", "Noise ÷ sensitivity", "ε of the round", "ε cumulative"],
            (
                [
                    r["round"],
                    r.get("survivors", "—"),
                    r.get("noise_over_sensitivity", "—"),
                    r["epsilon"],
                    r["epsilon_cumulative"],
                ]
                for r in dp["rounds"]
            ),
            numeric=(0, 1, 2, 3, 4),
        ),
    ]


def _agreed_mechanism(agreed: Mapping[str, Any] | None) -> list[str]:
    """The mechanism every participant signed in the run spec, and what sizes it."""
    if agreed is None:
        return []
    m = agreed["mechanism"]
    return [
        "<p>Agreed by every participant in the signed run spec: distributed Skellam "
        f"noise, noise multiplier {_e(m['noise_multiplier'])}, L2 clip {_e(m['l2_clip'])}, "
        f"δ {_e(m['delta'])}, {_e(m['frac_bits'])} fraction bits, each org's share sized "
        f"for {_e(agreed['noise_shares'])} orgs ({_e(m['noise_for'])}; "
        f"{_e(agreed['participants'])} participants, threshold {_e(agreed['threshold'])}), "
        f"a vector of {_e(agreed['dimension'])} coordinates. Each round is charged for "
        "the noise its survivors added.</p>"
    ]


def _agreement(r: Mapping[str, Any]) -> str:
    """Whether every peer reported the round's model hash."""
    if r["model_hash_agreed"] is None:
        return "not recorded"
    return "yes" if r["model_hash_agreed"] else "NO: " + _names(r["disagreeing_peers"])


def _round_row(r: Mapping[str, Any]) -> list[Any]:
    return [
        r["round"],
        _names(r["participants"]),
        _names(r["survivors"]),
        _names(r["dropped"]),
        _names(r["recovered"]),
        r["model_hash"][:16] + "…" if r["model_hash"] else "not recorded",
        _agreement(r),
        "—" if r["loss"] is None else r["loss"],
        "—" if r["accuracy"] is None else r["accuracy"],
    ]


_ROUND_COLUMNS = [
    "Round",
    "Participants",
    "Survivors",
    "Dropped",
    "Recovered",
    "Model hash",
    "All peers agreed",
    "Loss",
    "Accuracy",
]


def _rounds(report: Mapping[str, Any]) -> list[str]:
    parts = [
        "<h2>Rounds</h2>",
        _table(_ROUND_COLUMNS, (_round_row(r) for r in report["rounds"]), numeric=(0, 7, 8)),
    ]
    metrics: dict[str, list[tuple[float, float]]] = {}
    for name in ("loss", "accuracy"):
        pts = [(r["round"], r[name]) for r in report["rounds"] if r[name] is not None]
        if pts:
            metrics[name] = pts
    if metrics:
        parts.append(
            "<figure>"
            + line_chart_svg("Loss and accuracy per round", "round", "value", metrics)
            + "<figcaption>Loss and accuracy of the global model after each round.</figcaption></figure>"
        )
    return parts


def _bytes_chart(rows: Sequence[Mapping[str, Any]]) -> str:
    """Bytes sent per run round (and attempt), stacked by privacy class."""
    labels = sorted(
        {(r["round"], r.get("attempt", 1)) for r in rows},
        key=lambda v: (v[0] is None, v[0] or 0, v[1]),
    )
    classes = sorted({r["class"] for r in rows})
    cell: dict[tuple[Any, int, str], int] = {}
    for r in rows:
        key = (r["round"], r.get("attempt", 1), r["class"])
        cell[key] = cell.get(key, 0) + r["bytes"]
    return (
        "<figure>"
        + bar_chart_svg(
            "Bytes sent per round by privacy class",
            "run round (— : outside the run's rounds; /a: attempt a of a retried round)",
            "bytes",
            ["—" if r is None else (str(r) if a == 1 else f"{r}/{a}") for r, a in labels],
            {c: [float(cell.get((r, a, c), 0)) for r, a in labels] for c in classes},
        )
        + "<figcaption>Bytes sent per round, stacked by privacy class.</figcaption></figure>"
    )


def _egress(report: Mapping[str, Any]) -> list[str]:
    traffic = report["traffic"]
    total = traffic["total"]
    return [
        "<h2>What left the organization</h2>",
        f"<p>{_e(_num(total['messages']))} messages, {_e(_num(total['bytes']))} bytes "
        f"(log entries {_e(traffic['window']['first_index'])}–{_e(traffic['window']['last_index'])}; "
        "bytes as sent on the wire).</p>",
        _table(
            ["Peer", "Messages", "Bytes"],
            ([p["peer"], p["messages"], p["bytes"]] for p in traffic["per_peer"]),
            numeric=(1, 2),
        ),
        _table(
            ["Privacy class", "Messages", "Bytes"],
            ([c["class"], c["messages"], c["bytes"]] for c in traffic["per_class"]),
            numeric=(1, 2),
        ),
        _bytes_chart(traffic["per_round"]),
    ]


def _shards_and_anomalies(report: Mapping[str, Any]) -> list[str]:
    return [
        "<h2>Checkpoint shards held for other organizations</h2>",
        _table(
            ["Owner", "Round", "Shard", "Bytes", "SHA-256"],
            (
                [s["owner"], s["round"], s["shard_index"], s["bytes"], s["sha256"]]
                for s in report["shards_held"]
            ),
            numeric=(1, 2, 3),
        ),
        "<h2>Anomalies</h2>",
        _table(["Kind", "Detail"], ([a["kind"], a["detail"]] for a in report["anomalies"])),
    ]


def _signed_log(report: Mapping[str, Any]) -> list[str]:
    heads = [r["head"] for r in report["log"]["records"] if r["type"] == "head"]
    return [
        "<h2>Signed log</h2>",
        _table(
            ["Signed head index", "Run", "Round", "Time", "Head hash"],
            ([h["index"], h["run"], h["round"], h["time"], h["head_hash"]] for h in heads),
            numeric=(0, 2),
        ),
        f"<p>Identity key (Ed25519): <code>{_e(report['log']['header']['public_key'])}</code>. "
        f"Report signature: <code>{_e(report['signature']['value'])}</code>. Check this report "
        "with <code>fedweave audit verify</code> on its JSON form.</p>",
    ]


_SECTIONS = (
    _participants,
    _specification,
    _secure_aggregation,
    _differential_privacy,
    _rounds,
    _egress,
    _shards_and_anomalies,
    _signed_log,
)


def render_html(report: Mapping[str, Any], *, verification: str | None = None) -> str:
    """The report as one self-contained HTML page (``verification``: a summary line)."""
    parts = _heading(report, verification)
    for section in _SECTIONS:
        parts.extend(section(report))
    parts.append("</body></html>\n")
    return "".join(parts)
