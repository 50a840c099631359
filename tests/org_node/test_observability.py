"""Structured logs (JSON lines, correlation ids every org computes alike), the stage
metrics' Prometheus text, and the observability hub's round timeline."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re

import pytest
from coordinator_free.rounds import MASKS_PREPARED, OBSERVATION_KINDS, RoundObservation
from hypothesis import given
from hypothesis import strategies as st

from org_node.observability import (
    ContextAdapter,
    JsonFormatter,
    Observability,
    StageMetrics,
    configure_json_logging,
    correlation_id,
)
from org_node.observability.metrics import Histogram, escape_label

# -- correlation ids --------------------------------------------------------------------

VECTORS = [
    # (federation, run_key, round, stage, id): fixed, so every release computes the same
    ("hospitals", "run-key-1", 8, "share", "9937ffda06c46cb7461074030207c7f0"),
    ("hospitals", "run-key-1", 8, "", "937f84a0b0fe211d276e3a114d76cbb1"),
]


@pytest.mark.parametrize(("fed", "run", "rnd", "stage", "expected"), VECTORS)
def test_correlation_id_vectors(fed: str, run: str, rnd: int, stage: str, expected: str) -> None:
    assert correlation_id(fed, run, rnd, stage) == expected
    raw = b"\x00".join([b"fedweave-correlation/v1", fed.encode(), run.encode(), b"%d" % rnd])
    assert hashlib.sha256(raw + b"\x00" + stage.encode()).hexdigest()[:32] == expected


names = st.text(st.characters(exclude_characters="\x00", exclude_categories=["Cs"]), max_size=12)


@given(names, names, st.integers(0, 2**40), names, names, names, st.integers(0, 2**40), names)
def test_correlation_ids_differ_for_different_stages(
    f1: str, r1: str, n1: int, s1: str, f2: str, r2: str, n2: int, s2: str
) -> None:
    a, b = correlation_id(f1, r1, n1, s1), correlation_id(f2, r2, n2, s2)
    assert re.fullmatch(r"[0-9a-f]{32}", a)
    assert (a == b) == ((f1, r1, n1, s1) == (f2, r2, n2, s2))


def test_correlation_id_rejects_ambiguous_input() -> None:
    with pytest.raises(ValueError, match="NUL"):
        correlation_id("fed\x00x", "run", 1, "ready")
    with pytest.raises(ValueError, match="valid text"):
        correlation_id("fed", "run\ud800", 1, "ready")
    with pytest.raises(TypeError, match="round must be an int"):
        correlation_id("fed", "run", "1", "ready")  # type: ignore[arg-type]


# -- JSON lines -------------------------------------------------------------------------


def capture(static: dict[str, object] | None = None) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    logger = logging.getLogger(f"test.obs.{id(stream)}")
    logger.propagate = False
    configure_json_logging(logger, stream=stream, level=logging.DEBUG, static=static)
    return logger, stream


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_the_structured_fields_and_derive_the_correlation_id() -> None:
    logger, stream = capture({"org": "org-a", "federation": "hospitals"})
    logger.info("stage done", extra={"run": "run-key-1", "round": 8, "stage": "share"})
    logger.warning("plain line")
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed", extra={"peer": 'org-"b"\n<x>'})
    first, second, third = lines(stream)
    assert first["message"] == "stage done" and first["level"] == "info"
    assert (first["org"], first["run"], first["round"], first["stage"]) == (
        "org-a",
        "run-key-1",
        8,
        "share",
    )
    assert first["correlation_id"] == VECTORS[0][4]
    assert "correlation_id" not in second and second["org"] == "org-a"
    assert third["peer"] == 'org-"b"\n<x>'  # escaped by JSON, one line
    assert "ValueError: boom" in str(third["exc"])
    assert len(stream.getvalue().splitlines()) == 3


def test_context_adapter_adds_fields_and_per_call_fields_win() -> None:
    logger, stream = capture()
    log = ContextAdapter(logger, {"org": "org-a", "run": "r", "round": 2})
    log.info("one")
    log.info("two", extra={"round": 3, "stage": "unmask"})
    one, two = lines(stream)
    assert (one["org"], one["round"]) == ("org-a", 2)
    assert (two["round"], two["stage"]) == (3, "unmask")
    assert two["correlation_id"] == correlation_id("", "r", 3, "unmask")


def test_json_formatter_rejects_unknown_static_fields() -> None:
    with pytest.raises(ValueError, match="unknown static log fields"):
        JsonFormatter({"password": "x"})


def test_every_org_logs_the_same_correlation_id_for_the_same_stage() -> None:
    ids = {}
    for org in ("org-a", "org-b", "org-c"):
        logger, stream = capture()
        hub = Observability(org, "hospitals", logger=logger)
        hub.observe(RoundObservation("stage", "run-key-1", 8, "share", seconds=0.2, bytes=10))
        hub.observe(RoundObservation("completed", "run-key-1", 8, "done", seconds=1.0))
        stage, done = lines(stream)
        assert stage["org"] == org and stage["event"] == "stage" and stage["bytes"] == 10
        ids[org] = stage["correlation_id"]
        assert done["correlation_id"] == correlation_id("hospitals", "run-key-1", 8, "done")
    assert set(ids.values()) == {VECTORS[0][4]}


# -- metrics ----------------------------------------------------------------------------


def test_stage_metrics_text_format() -> None:
    m = StageMetrics(buckets=(0.1, 1.0))
    for o in (
        RoundObservation("stage", "r", 1, "ready", seconds=0.05, bytes=100),
        RoundObservation("stage", "r", 2, "ready", seconds=0.5, bytes=50),
        RoundObservation("stage", "r", 2, "share", seconds=3.0, bytes=7),
        RoundObservation("refused", "r", 2, "share", 'org-"x"\n', detail="replay"),
        RoundObservation("stale", "r", 2, "unmask", "org-b"),
        RoundObservation("failed", "r", 2, "unmask", detail="too few"),
        RoundObservation("arrival", "r", 2, "ready", "org-b", bytes=64),
        RoundObservation("completed", "r", 3, "done", seconds=0.5, detail=MASKS_PREPARED),
        RoundObservation("completed", "r", 4, "done", seconds=0.5),
    ):
        m.observe(o)
    text = m.render()
    assert text.endswith("\n")
    assert (
        'fedweave_stage_duration_seconds_bucket{stage="ready",le="0.10000000000000001"} 1' in text
    )
    assert 'fedweave_stage_duration_seconds_bucket{stage="ready",le="1"} 2' in text
    assert 'fedweave_stage_duration_seconds_bucket{stage="ready",le="+Inf"} 2' in text
    assert 'fedweave_stage_duration_seconds_bucket{stage="share",le="1"} 0' in text
    assert 'fedweave_stage_duration_seconds_sum{stage="ready"} 0.55000000000000004' in text
    assert 'fedweave_stage_bytes_sent_total{stage="ready"} 150' in text
    assert 'fedweave_refusals_total{stage="share",peer="org-\\"x\\"\\n"} 1' in text
    assert 'fedweave_stale_messages_total{stage="unmask"} 1' in text
    assert 'fedweave_rounds_total{outcome="failed"} 1' in text
    assert 'fedweave_rounds_total{outcome="completed"} 2' in text
    assert "fedweave_rounds_masks_prepared_total 1" in text
    assert 'fedweave_peer_bytes_received_total{peer="org-b"} 64' in text
    assert m.peer_bytes_received() == {"org-b": 64}
    for line in text.splitlines():
        assert line.startswith("#") or re.fullmatch(r"[a-z_]+(\{.*\})? \S+", line), line
    types = re.findall(r"# TYPE (\S+) (\S+)", text)
    assert len(types) == len({n for n, _ in types})  # each family declared once


def test_histogram_and_label_escaping() -> None:
    assert escape_label('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    with pytest.raises(ValueError, match="increasing"):
        Histogram((1.0, 0.5))
    h = Histogram((1.0,))
    h.observe(("x",), 2.0)
    assert h.count(("x",)) == 1 and h.count(("y",)) == 0


# -- the hub ----------------------------------------------------------------------------


def test_hub_timeline_labels_attempts_and_keeps_the_newest_rounds() -> None:
    hub = Observability("org-a", "fed", rounds_kept=2, attempts_per_round=8, clock=lambda: 5.0)
    for rnd in (0, 8, 9):
        hub.observe(RoundObservation("round", "r", rnd, "ready"))
        hub.observe(RoundObservation("arrival", "r", rnd, "ready", "org-b", 0.1, 10))
    hub.observe(RoundObservation("failed", "r", 8, "reduce", detail="ring broke"))
    hub.observe(RoundObservation("unreachable", "r", 9, "share", "org-c", detail="timeout"))
    hub.observe(RoundObservation("completed", "r", 9, "done", seconds=1.5, bytes=99))
    old, new = hub.timeline()
    assert (old["round"], old["label"], old["state"]) == (8, "2", "failed")
    assert old["failure"] == "reduce: ring broke" and old["started_at"] == 5.0
    assert (new["round"], new["label"], new["state"]) == (9, "2 (attempt 2)", "completed")
    assert new["peers"]["org-c"]["share"] == {"status": "unreachable", "detail": "timeout"}
    assert new["peers"]["org-b"]["ready"] == {"status": "ok", "at": 0.1, "bytes": 10}
    assert Observability("o").label(9) == "9"
    with pytest.raises(ValueError, match="attempts_per_round"):
        Observability("o", attempts_per_round=0)


def test_the_observation_kinds_the_hub_understands_are_the_engines() -> None:
    handled = {
        "round", "stage", "arrival", "missing", "unreachable", "refused", "stale", "mismatch",
        "suspect", "left", "retry", "link", "dropped", "completed", "failed",
    }  # fmt: skip
    assert handled == OBSERVATION_KINDS


def test_hub_ignores_roundless_observations_and_names_the_newest_culprit() -> None:
    hub = Observability("org-a")
    hub.observe(RoundObservation("arrival", "r", -1, "ready", "org-b"))  # no round: ignored
    assert hub.timeline() == [] and hub.culprit() is None
    hub.observe(RoundObservation("missing", "r", 1, "share", "org-b"))
    hub.observe(RoundObservation("missing", "r", 2, "share", "org-c"))
    scores = hub.peer_scores()
    assert scores == {"org-b": 3.0, "org-c": 3.0}
    culprit = hub.culprit()
    assert culprit is not None and (culprit.org, culprit.round) == ("org-c", 2)
