"""The report of a run: its sections, the schema, ε accounting, and the offline HTML page."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from coordinator_free.identity import OrgIdentity
from coordinator_free.wire import Envelope

from org_node.audit.dp_section import skellam_dp_facts
from org_node.audit.html import bar_chart_svg, line_chart_svg, render_html
from org_node.audit.log import EgressLog
from org_node.audit.report import (
    PROTOCOL_ATTEMPTS,
    REPORT_SCHEMA_ID,
    SCHEMA_PATH,
    SECTIONS,
    ConsentRecord,
    DpFacts,
    ReportError,
    RoundFacts,
    RunFacts,
    SchemaError,
    SecAggFacts,
    ShardHeld,
    UnknownRun,
    build_report,
    round_facts_from_engine,
    run_round_of,
    save_report,
    validate_report,
)
from org_node.audit.verify import verify_report
from org_node.policy import Policy, RunSpec
from org_node.privacy import GaussianRound, RdpAccountant

ORGS = ("a", "b", "c")


def identity(org: str) -> OrgIdentity:
    return OrgIdentity.generate(org, hashlib.sha256(org.encode()).digest())


def send(log: EgressLog, peer: str, kind: str, payload: bytes, run: str, rnd: int) -> int:
    env = Envelope("fed", run, rnd, "st", kind, log.org, peer, 1, 1.0e9, payload)
    env = env.with_signature(log.identity.sign(env.signing_bytes()))
    wire = env.to_wire()
    log.record(env, wire)
    return len(wire)


def populated_log(tmp: Path) -> tuple[EgressLog, dict[str, int]]:
    """Run r: two rounds to b and c, with membership traffic and another run interleaved;
    the log records the protocol round ((run round - 1) * PROTOCOL_ATTEMPTS + attempt)."""
    log = EgressLog(identity("a"), tmp / "a.log")
    sent: dict[str, int] = {"b": 0, "c": 0}
    send(log, "b", "round.ready", b"early", "other-run", 1)
    log.sign_head("other-run", 1)
    for rnd in (1, 2):
        for peer in ("b", "c"):
            wire_round = (rnd - 1) * PROTOCOL_ATTEMPTS
            sent[peer] += send(log, peer, "round.ready", b"k" * 40, "r", wire_round)
            sent[peer] += send(log, peer, "agg.chunk", b"m" * (100 * rnd), "r", wire_round)
        sent["b"] += send(log, "b", "swim.ping", b"p", "", 0)
        log.sign_head("r", rnd)
    return log, sent


def facts(**changes: Any) -> RunFacts:
    spec = RunSpec(trainer="breast_cancer", rounds=2, participants=ORGS, threshold=2, epsilon=8.0)
    values: dict[str, Any] = {
        "run": "r",
        "spec": spec,
        "policies": {
            "default": Policy(min_participants=2),
            "strict": Policy(min_threshold=3, max_epsilon=4.0, allowed_peers=("a", "b")),
        },
        "consents": (
            ConsentRecord("a", "accepted", "2026-01-01T00:00:00Z", "ops@a"),
            ConsentRecord("b", "accepted", "2026-01-01T01:00:00Z", "ops@b", "<b>ok</b>"),
        ),
        "secure_aggregation": SecAggFacts("masked", 3, 2, 32, 1.0),
        "dp": DpFacts((GaussianRound(1.1), GaussianRound(1.1)), delta=1e-5, l2_clip=1.0),
        "rounds": (
            RoundFacts(1, ORGS, ORGS, model_hash="ab" * 32, agreeing_peers=("b", "c"), loss=1.2),
            RoundFacts(
                2,
                ORGS,
                ("a", "b"),
                ("c",),
                ("c",),
                "cd" * 32,
                ("b",),
                ("c",),
                loss=0.7,
                accuracy=0.81,
            ),
        ),
        "shards_held": (ShardHeld("b", 2, 1, 4096, "ef" * 32),),
        "anomalies": ('<script>alert("x")</script>',),
    }
    values.update(changes)
    return RunFacts(**values)


@pytest.fixture()
def built(tmp_path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    log, sent = populated_log(tmp_path)
    return build_report(log, facts()), sent


def test_the_report_holds_every_section_and_validates(
    built: tuple[dict[str, Any], dict[str, int]],
) -> None:
    report, _ = built
    assert report["schema"] == REPORT_SCHEMA_ID and report["org"] == "a"
    assert set(SECTIONS) <= set(report)
    validate_report(report)
    assert json.loads(SCHEMA_PATH.read_text())["$id"] == REPORT_SCHEMA_ID
    assert [p["org"] for p in report["participants"]] == list(ORGS)
    assert report["participants"][2]["consent"] is None
    assert report["secure_aggregation"] == {
        "backend": "masked",
        "n": 3,
        "t": 2,
        "ring_bits": 32,
        "l2_clip": 1.0,
    }
    assert report["shards_held"][0]["owner"] == "b"


def test_traffic_is_the_run_segment_per_peer_class_and_round(
    built: tuple[dict[str, Any], dict[str, int]],
) -> None:
    report, sent = built
    traffic = report["traffic"]
    # the segment starts at the run's first message: the other run's entry 0 is out
    assert traffic["window"] == {"first_index": 1, "last_index": 10}
    assert {p["peer"]: p["bytes"] for p in traffic["per_peer"]} == sent
    assert traffic["total"]["messages"] == 10
    rounds = {(r["round"], r["class"]): r["messages"] for r in traffic["per_round"]}
    assert rounds[(1, "masked_vector_chunk")] == 2 and rounds[(2, "encrypted_share")] == 2
    assert rounds[(None, "membership")] == 2  # the run-less pings in the window
    assert traffic["forbidden_messages"] == 0


def test_policies_list_each_violation(built: tuple[dict[str, Any], dict[str, int]]) -> None:
    report, _ = built
    rows = {p["name"]: p for p in report["run"]["policies"]}
    assert rows["default"]["violations"] == []
    assert {v["requirement"] for v in rows["strict"]["violations"]} == {
        "min_threshold",
        "max_epsilon",
        "allowed_peers",
    }
    assert report["run"]["violations_total"] == 3
    kinds = [a["kind"] for a in report["anomalies"]]
    assert kinds.count("policy_violation") == 3
    assert "model_hash_mismatch" in kinds and "reported" in kinds


def test_dp_section_composes_epsilon_with_the_rdp_accountant(
    built: tuple[dict[str, Any], dict[str, int]],
) -> None:
    report, _ = built
    dp = report["differential_privacy"]
    acct = RdpAccountant()
    acct.charge(GaussianRound(1.1))
    one = acct.epsilon(1e-5)
    acct.charge(GaussianRound(1.1))
    assert dp["rounds"][0]["epsilon"] == pytest.approx(one)
    assert dp["rounds"][1]["epsilon"] == pytest.approx(one)
    assert dp["rounds"][1]["epsilon_cumulative"] == pytest.approx(acct.epsilon(1e-5))
    assert dp["epsilon_total"] == dp["rounds"][-1]["epsilon_cumulative"]
    assert one < dp["epsilon_total"] < 2 * one  # RDP composes better than linearly
    assert dp["mechanism"] == "gaussian" and dp["noise_multipliers"] == [1.1]


def test_rounds_show_dropouts_recoveries_and_model_agreement(
    built: tuple[dict[str, Any], dict[str, int]],
) -> None:
    report, _ = built
    first, second = report["rounds"]
    assert first["model_hash_agreed"] and not second["model_hash_agreed"]
    assert second["dropped"] == ["c"] and second["recovered"] == ["c"]
    assert second["disagreeing_peers"] == ["c"]


def test_an_unknown_run_is_refused_as_not_found(tmp_path: Path) -> None:
    log, _ = populated_log(tmp_path)
    with pytest.raises(UnknownRun) as info:
        build_report(log, facts(run="nope"))
    assert isinstance(info.value, LookupError) and info.value.run == "nope"


def test_a_run_not_yet_under_a_signed_head_is_refused(tmp_path: Path) -> None:
    log, _ = populated_log(tmp_path)
    send(log, "b", "round.ready", b"k", "r", 3)
    with pytest.raises(ReportError, match="no signed head"):
        build_report(log, facts())
    log.sign_head("r", 3)
    assert build_report(log, facts())["traffic"]["total"]["messages"] == 11


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"consents": (ConsentRecord("z", "accepted", "t", "x"),)}, "outside the run"),
    ],
)
def test_inconsistent_facts_are_refused(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    log, _ = populated_log(tmp_path)
    with pytest.raises(ReportError, match=message):
        build_report(log, facts(**changes))


@pytest.mark.parametrize(
    "build",
    [
        lambda: ConsentRecord("a", "maybe", "t", "x"),
        lambda: SecAggFacts("plain", 3, 2, 32, None),
        lambda: SecAggFacts("masked", 3, 4, 32, None),
        lambda: SecAggFacts("masked", 3, 2, 4, None),
        lambda: DpFacts((), delta=0.0, l2_clip=1.0),
        lambda: RoundFacts(1, ORGS, ORGS, loss=float("nan")),
        lambda: RoundFacts(1, ORGS, ORGS, recovered=("a",)),
    ],
)
def test_fact_dataclasses_refuse_invalid_values(build: Any) -> None:
    with pytest.raises(ReportError):
        build()


def test_schema_names_the_offending_field(built: tuple[dict[str, Any], dict[str, int]]) -> None:
    report, _ = built
    for path, value, where in [
        (("secure_aggregation", "backend"), "plain", "report.secure_aggregation.backend"),
        (("rounds", 0, "round"), -1, "report.rounds[0].round"),
        (("traffic", "per_peer", 0, "bytes"), "12", "report.traffic.per_peer[0].bytes"),
        (("generated_at",), "yesterday", "report.generated_at"),
    ]:
        doc = copy.deepcopy(report)
        node: Any = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(SchemaError) as info:
            validate_report(doc)
        assert info.value.path == where
    doc = copy.deepcopy(report)
    doc["extra"] = 1
    with pytest.raises(SchemaError, match="unexpected extra"):
        validate_report(doc)
    with pytest.raises(SchemaError, match="expected object"):
        validate_report([])


# -- HTML ----------------------------------------------------------------------------------


class _Resources(HTMLParser):
    """Collects every attribute that could make a browser fetch something."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.tags: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        for name, value in attrs:
            if name in ("src", "href", "xlink:href", "data", "srcset", "action") and value:
                self.urls.append(value)


def test_html_is_self_contained_and_escapes_everything(
    built: tuple[dict[str, Any], dict[str, int]], tmp_path: Path
) -> None:
    report, _ = built
    page = render_html(report, verification="OK: report of a")
    path = tmp_path / "report.html"
    path.write_text(page, encoding="utf-8")
    text = path.read_text(encoding="utf-8")
    assert "http://" not in text and "https://" not in text and "//cdn" not in text
    parser = _Resources()
    parser.feed(text)
    assert all(u.startswith("url(#") or u.startswith("#") for u in parser.urls), parser.urls
    assert not {"script", "link", "img", "iframe", "object"} & parser.tags
    assert '<script>alert("x")</script>' not in text
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in text
    assert "&lt;b&gt;ok&lt;/b&gt;" in text
    assert text.count("<svg") == 3  # ε, bytes by class, loss/accuracy
    assert "@media print" in text
    for label in ("ε over rounds", "Bytes sent per round by privacy class", "Loss and accuracy"):
        assert label in text
    assert re.search(r"<text[^>]*>round</text>", text)  # axis label


def test_html_without_dp_or_metrics_still_renders(tmp_path: Path) -> None:
    log, _ = populated_log(tmp_path)
    report = build_report(
        log,
        facts(dp=None, rounds=(RoundFacts(1, ORGS, ORGS),), policies={}, anomalies=()),
    )
    page = render_html(report)
    assert "adds no differential-privacy noise" in page
    assert page.count("<svg") == 1


def test_chart_helpers_handle_empty_data_and_scale_to_the_maximum() -> None:
    assert "no data" in line_chart_svg("t", "x", "y", {})
    assert "no data" in bar_chart_svg("t", "x", "y", [], {})
    svg = bar_chart_svg("t", "round", "bytes", ["1", "2"], {"a": [10.0, 0.0], "b": [5.0, 20.0]})
    bars = re.findall(r'<rect x="[^"]+" y="[^"]+" width="([^"]+)" height="([^"]+)" fill="url', svg)
    heights = [float(h) for w, h in bars if w != "24"]  # the legend swatches are 24 wide
    assert len(heights) == 3  # a zero value draws no bar
    assert max(heights) == pytest.approx(heights[0] * 2, rel=0.01)


def test_save_report_writes_the_verifiable_json_and_the_page(
    built: tuple[dict[str, Any], dict[str, int]], tmp_path: Path
) -> None:
    from org_node.audit.verify import verify_path

    report, _ = built
    json_path, html_path = save_report(report, tmp_path / "out")
    assert json_path.name == "r.audit.json" and html_path.name == "r.audit.html"
    assert verify_path(json_path).ok
    assert html_path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    bad = copy.deepcopy(report)
    bad["run"]["id"] = "../escape"
    with pytest.raises(ReportError, match="file name"):
        save_report(bad, tmp_path)


def test_round_facts_from_the_run_engine_report() -> None:
    engine = pytest.importorskip("org_node.engine")
    rr = engine.RoundReport(
        run_key="k",
        round=3,
        model_hash="ab" * 32,
        survivors=("a", "b"),
        dropped=("c",),
        attempts=1,
        local_steps=10,
        examples=100,
        metrics={"loss": 0.5, "accuracy": 0.9},
        epsilon_spent=None,
        bytes_sent=10,
    )
    facts_ = round_facts_from_engine(rr, ORGS)
    assert facts_.round == 3 and facts_.recovered == ("c",) and facts_.loss == 0.5
    assert facts_.participants == ORGS and facts_.accuracy == 0.9


def test_protocol_rounds_map_back_to_run_rounds_and_attempts() -> None:
    engine = pytest.importorskip("org_node.engine")
    assert PROTOCOL_ATTEMPTS == engine.ATTEMPTS
    a = PROTOCOL_ATTEMPTS
    assert [run_round_of(p) for p in (0, a, 2 * a)] == [(1, 1), (2, 1), (3, 1)]
    assert run_round_of(a + 1) == (2, 2) and run_round_of(a - 1) == (1, a)
    with pytest.raises(ReportError, match="negative"):
        run_round_of(-1)


def test_traffic_per_round_names_run_rounds_with_retries_apart(tmp_path: Path) -> None:
    log, _ = populated_log(tmp_path)
    send(log, "b", "agg.chunk", b"r" * 10, "r", PROTOCOL_ATTEMPTS + 1)  # round 2, attempt 2
    log.sign_head("r", 2)
    report = build_report(log, facts())
    rows = report["traffic"]["per_round"]
    assert {r["round"] for r in rows} == {None, 1, 2}  # never the wire's 0, 8, 9
    retried = [r for r in rows if "attempt" in r]
    assert [(r["round"], r["attempt"], r["messages"]) for r in retried] == [(2, 2, 1)]
    assert all(r.get("attempt", 1) >= 1 for r in rows)
    validate_report(report)
    page = render_html(report)
    assert ">2/2<" in page and ">8<" not in page.split("Bytes sent per round")[1].split("</svg>")[0]
    assert verify_report(report, trusted_keys={"a": identity("a").public_key}).ok


def test_survivors_are_sorted_whatever_the_ring_order(tmp_path: Path) -> None:
    log, _ = populated_log(tmp_path)
    ring = (RoundFacts(1, ORGS, ("c", "a", "b"), agreeing_peers=("c", "a", "b")),)
    report = build_report(log, facts(rounds=ring))
    row = report["rounds"][0]
    assert row["survivors"] == ["a", "b", "c"] and row["agreeing_peers"] == ["a", "b", "c"]
    assert row["participants"] == list(ORGS)


def test_a_round_without_a_model_hash_is_not_reported_as_agreed(tmp_path: Path) -> None:
    log, _ = populated_log(tmp_path)
    rounds = (
        RoundFacts(1, ORGS, ORGS),
        RoundFacts(2, ORGS, ORGS, model_hash="cd" * 32, agreeing_peers=ORGS),
    )
    report = build_report(log, facts(rounds=rounds))
    assert [r["model_hash_agreed"] for r in report["rounds"]] == [None, True]
    assert report["rounds"][1]["model_hash"] == "cd" * 32  # in full in the JSON
    validate_report(report)
    page = render_html(report)
    assert "not recorded" in page and "cdcdcdcdcdcdcdcd…" in page and "cd" * 32 not in page


def test_participants_without_a_record_here_say_what_this_org_holds(tmp_path: Path) -> None:
    log, _ = populated_log(tmp_path)
    mine = ConsentRecord("a", "accepted", "2026-01-01T00:00:00Z", "ops", decided_by_role="admin")
    report = build_report(log, facts(consents=(mine,)))
    by_org = {p["org"]: p for p in report["participants"]}
    assert by_org["a"]["consent"]["decided_by_role"] == "admin"
    assert "consent_note" not in by_org["a"]
    # b and c took part in round 1: their acceptance is evidenced, not recorded here
    for org in ("b", "c"):
        assert by_org[org]["consent"] is None
        assert by_org[org]["consent_note"].startswith("not recorded here")
        assert "round 1" in by_org[org]["consent_note"]
    validate_report(report)
    page = render_html(report)
    assert "ops (admin)" in page and "aggregated in round 1" in page
    alone = build_report(log, facts(consents=(), rounds=()))
    notes = {p["org"]: p["consent_note"] for p in alone["participants"]}
    assert notes == {
        "a": "no decision recorded in this org's database",
        "b": "not recorded here",
        "c": "not recorded here",
    }


def test_recorded_rounds_win_over_observed_ones() -> None:
    from org_node.audit.facts import merge_rounds, observed_rounds

    observed = observed_rounds(ORGS, {1: ("c", "a", "b"), 2: ("b", "a")}, {1: {"loss": 0.9}})
    assert observed[0].survivors == ORGS and observed[1].dropped == ("c",)
    recorded = (RoundFacts(1, ORGS, ORGS, model_hash="ab" * 32, agreeing_peers=ORGS),)
    merged = merge_rounds(recorded, observed)
    assert [r.round for r in merged] == [1, 2]
    assert merged[0].model_hash == "ab" * 32 and merged[0].loss == 0.9
    assert merged[1] == observed[1]


def test_head_messages_after_the_last_head_do_not_hold_the_report_back(tmp_path: Path) -> None:
    """A head sent (or answered) after the run's last signed head carries no data of the
    run: the report builds; a data message there still refuses it."""
    log, _ = populated_log(tmp_path)
    send(log, "b", "audit.head", b"head", "r", 1)
    send(log, "c", "audit.head.reply", b"ok", "r", 1)
    report = build_report(log, facts())
    assert report["traffic"]["window"]["first_index"] == 1
    send(log, "b", "agg.chunk", b"late", "r", 1)
    with pytest.raises(ReportError, match="covers its last message"):
        build_report(log, facts())


def test_finding_3_a_failed_runs_reason_reaches_the_report(tmp_path: Path) -> None:
    """Issue 21, finding 3: the reason a run failed is in its report (run section and
    HTML page), not only in the event stream."""
    log, _ = populated_log(tmp_path)
    reason = "round 2 failed at ready: 1 participants are ready, fewer than 2"
    report = build_report(log, facts(outcome=("failed", reason)))
    validate_report(report)
    assert report["run"]["state"] == "failed" and report["run"]["state_reason"] == reason
    assert "fewer than 2" in render_html(report)
    assert "state" not in build_report(log, facts())["run"]


AGREED = {
    "mechanism": {
        "noise_multiplier": 2.0,
        "l2_clip": 1.0,
        "delta": 1e-5,
        "frac_bits": 24,
        "noise_for": "participants",
    },
    "participants": 3,
    "threshold": 2,
    "dimension": 10,
}


def test_the_dp_section_shows_each_rounds_survivors_noise_and_epsilon_and_verifies(
    tmp_path: Path,
) -> None:
    """Issue 21: per round, the agreed mechanism, the survivors, the noise they added
    (a multiple of the sensitivity) and ε; ``audit verify`` recomputes the section from
    the agreed mechanism and the rounds' survivors, so a report whose ε does not follow
    from them fails, naming the section."""
    log, _ = populated_log(tmp_path)
    honest = skellam_dp_facts(AGREED, [(1, 3), (2, 2)], 8.0)
    report = build_report(log, facts(dp=honest))
    dp = report["differential_privacy"]
    assert [r["survivors"] for r in dp["rounds"]] == [3, 2]
    assert dp["agreed"]["noise_shares"] == 3 and dp["noise_multipliers"] == [2.0]
    ratio = dp["rounds"][1]["noise_over_sensitivity"] / dp["rounds"][0]["noise_over_sensitivity"]
    assert ratio == pytest.approx(math.sqrt(2 / 3))
    keys = {"a": identity("a").public_key}
    assert verify_report(report, trusted_keys=keys).ok
    # charged as if every round had all three survivors: less ε than was spent
    flattering = skellam_dp_facts(AGREED, [(1, 3), (2, 3)], 8.0)
    lied = build_report(log, facts(dp=flattering))
    result = verify_report(lied, trusted_keys=keys)
    assert not result.ok and "differential_privacy" in result.summary
    assert "survivors" in result.summary, result.summary
