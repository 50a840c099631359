"""``bench.overlay_tls``: how the figures of the org processes are put together."""

from __future__ import annotations

from typing import Any

from bench.overlay_tls import _summary


def _process(offset: float, ends: dict[str, float], bytes_sent: float) -> dict[str, Any]:
    """One process's figures: every run starts at ``offset``; ``ends`` by run name."""
    figures: dict[str, Any] = {}
    for name, end in ends.items():
        figures[f"{name}_start"] = offset
        figures[f"{name}_end"] = end
        figures[f"{name}_bytes"] = bytes_sent
        figures[f"{name}_rss"] = end * 100
    figures["ring_stage_reduce"] = ends["ring2"] - offset
    return figures


def test_a_run_lasts_from_the_first_start_to_the_last_end_and_the_warm_up_is_left_out() -> None:
    # run 0 of each kind is the warm-up: far slower, and not in the median
    runs = {"plain0": 50.0, "ring0": 90.0, "plain1": 1.0, "ring1": 1.5}
    runs |= {"plain2": 2.0, "ring2": 2.5, "plain3": 3.0, "ring3": 3.5, "star": 4.0}
    fast = _process(0.0, runs, 10.0)
    slow = _process(0.5, {k: v + 0.25 for k, v in runs.items()}, 30.0)
    out = _summary({"org-0": fast, "org-1": slow}, repeats=3)
    # from org-0's start (0.0) until org-1's end (+0.25)
    assert out["plain_s"] == 2.25 and out["ring_s"] == 2.75
    assert (out["plain_min_s"], out["plain_max_s"]) == (1.25, 3.25)
    assert (out["ring_min_s"], out["ring_max_s"]) == (1.75, 3.75)
    assert out["star_s"] == 4.25
    assert out["plain_busiest"] == out["ring_busiest"] == out["star_busiest"] == 30.0
    # the most any node's resident set rose in a timed run, never the warm-up's
    assert out["ring_rss"] == 3.75 * 100
    # a stage: the slowest node's
    assert out["ring_stage_reduce"] == 2.5
    assert "ring_prepared" not in out  # figures of a node that prepared no masks


def test_the_prepared_masks_are_the_least_share_and_the_longest_wait() -> None:
    runs = {"plain0": 5.0, "ring0": 9.0, "plain1": 1.0, "ring1": 1.5, "star": 4.0}
    per = {}
    for org, share, wait in (("org-0", 1.0, 0.01), ("org-1", 0.5, 0.02)):
        per[org] = _process(0.0, runs | {"ring2": 2.0}, 1.0)
        per[org] |= {"ring_prepared": share, "ring_prepare_s": wait}
    out = _summary(per, repeats=1)
    assert out["ring_prepared"] == 0.5 and out["ring_prepare_s"] == 0.02
