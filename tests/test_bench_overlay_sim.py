"""bench.overlay's simulated rows, each run in a fresh process of its own."""

from __future__ import annotations

import pytest

from bench.overlay_sim import RING_KINDS, in_fresh_process, stages_note


def test_a_row_in_a_fresh_process_answers_with_its_figures_and_signed_messages() -> None:
    figures, signed = in_fresh_process(
        "sim_figures", n=4, params=8192, secure=True, repeats=1, star=False, signed=True
    )
    # a warm row: the first run of each apart, then the timed ones, every round complete
    assert {"first_plain_s", "first_ring_s", "plain_s", "ring_s"} <= figures.keys()
    assert figures["ring_s"] > 0 and figures["plain_s"] > 0
    # four peers of 8192 float32: the ring's busiest node sends 2 (n - 1) / n of 32 KiB
    assert 1.5 * 4 * 8192 <= figures["plain_busiest"] < 2.2 * 4 * 8192
    # the ring's chunks, and the messages beyond them
    assert signed["agg.chunk"] > 0 and "agg.chunk" in RING_KINDS
    assert signed["max_beyond_ring"] > 0
    # where the secure round's time went: every stage a round of four peers runs
    stages = {k.removeprefix("ring_stage_"): v for k, v in figures.items() if "_stage_" in k}
    assert {"ready", "share", "agree-ready", "mask", "reduce", "unmask"} <= stages.keys()
    assert all(v >= 0 for v in stages.values())


def test_the_stages_note_lists_a_round_s_stages_in_the_order_it_runs_them() -> None:
    fig = {"ring_s": 2.0, "ring_stage_unmask": 0.25, "ring_stage_ready": 0.5, "ring_stage_x": 1}
    note = stages_note("sim", fig)
    assert note == (
        "; its stages in s (median over peers and timed rounds): ready 0.500, unmask 0.250, x 1.000"
    )
    assert "slowest node" in stages_note("tls", fig)
    assert stages_note("sim", {"ring_s": 2.0}) == ""


def test_the_signed_messages_of_a_row_come_back_from_its_process() -> None:
    figures, signed = in_fresh_process("count_signed", n=4, params=4096)
    assert figures == {}
    # a warm round: the shares rode with the readies, and the ring settled U1
    assert signed["round.ready"] > 0 and "round.share" not in signed
    assert "round.token" not in signed


def test_a_row_that_fails_in_its_process_raises() -> None:
    with pytest.raises(RuntimeError, match="failed in its process"):
        in_fresh_process("sim_figures", n=4, params=4096, secure=True, no_such_option=1)
    with pytest.raises(ValueError, match="call must be one of"):
        in_fresh_process("os.system", n=4)
