"""``python -m bench.ring_first``: the ring first against the ring that waits
for the token, in simulated rounds that must each sum exactly."""

from __future__ import annotations

import pytest

from bench import ring_first as bench_ring_first
from bench.common import Report


def test_a_run_of_either_mode_gives_its_steady_round_and_agreement_seconds() -> None:
    # 33 members: the shares ride with the readies and U1 goes by the token
    for beside in (True, False):
        got = bench_ring_first.figures(33, 256, 0.0, beside, rounds=2)
        assert set(got) == {"round_s", "agree_u1_s"}
        assert got["round_s"] > 0


def test_a_round_that_is_not_exact_is_an_error_not_a_figure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from coordinator_free.sim import RoundOutcome

    monkeypatch.setattr(RoundOutcome, "problems", lambda self: ["a wrong sum"])
    with pytest.raises(RuntimeError, match="did not complete exactly"):
        bench_ring_first.figures(33, 256, 0.0, True, rounds=1)


def test_the_rows_are_named_as_documented_and_measured_against_the_waiting_ring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, float, bool]] = []

    def fake(n: int, length: int, latency: float, beside: bool, rounds: int) -> dict[str, float]:
        calls.append((n, latency, beside))
        return {"round_s": 1.0 if beside else 2.0, "agree_u1_s": 0.0 if beside else 0.5}

    monkeypatch.setattr(bench_ring_first, "figures", fake)
    report = Report("ring_first", quick=True)
    bench_ring_first.body(report)
    names = [row.name for row in report.rows]
    assert names == [
        "round_s[sim,n=40,latency=20ms]",
        "agree_u1_s[sim,n=40,latency=20ms]",
        "round_s[sim,n=40,latency=0]",
        "agree_u1_s[sim,n=40,latency=0]",
    ]
    assert report.rows[0].ratio == 0.5 and "network model" in report.rows[0].note
    assert sorted(calls) == sorted(
        [(40, 0.02, True), (40, 0.02, False), (40, 0.0, True), (40, 0.0, False)]
    )
