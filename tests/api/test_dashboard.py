"""The dashboard: the page and its assets load without a token and hold no data; the
snapshot needs a token and carries peers, the run, its metrics, the round timeline with
the culprit, checkpoints and the audit chain's status; the stage metrics reach
``/metrics`` and the culprit reaches ``/v1/node``."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from coordinator_free.rounds import RoundObservation
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlmodel import Session

from api.app import create_app
from api.dashboard import CSP, STATIC_FILES
from api.settings import Settings
from org_node.db.engine import make_engine
from org_node.db.models import Role, Run, RunMetric
from org_node.db.repo import append_audit_event, create_token
from org_node.observability import Observability
from tests.api.conftest import ORG, RUN_SPEC, Api, FakeNode, peer_consents, propose_run

STATIC = Path(__file__).resolve().parents[2] / "api" / "static"


def feed(obs: Observability, round: int = 1, culprit: str | None = "org-b") -> None:
    """A completed round of ``run-key`` in which ``culprit`` never sent its share."""
    for o in (
        RoundObservation("round", "run-key", round, "ready"),
        RoundObservation("arrival", "run-key", round, "ready", "org-b", 0.01, 120),
        RoundObservation("stage", "run-key", round, "ready", seconds=0.05, bytes=300),
        RoundObservation("stage", "run-key", round, "share", seconds=2.0, bytes=900),
        RoundObservation("retry", "run-key", round, "reduce", detail="ring attempt 2"),
        RoundObservation("completed", "run-key", round, "done", seconds=2.5, bytes=1200),
    ):
        obs.observe(o)
    if culprit is not None:
        obs.observe(RoundObservation("missing", "run-key", round, "share", culprit))
        obs.observe(RoundObservation("dropped", "run-key", round, "unmask", culprit))


def test_page_and_assets_load_without_a_token_and_carry_no_data(api: Api) -> None:
    page = api.client.get("/dashboard")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CSP
    assert "script-src 'self'" in CSP and "unsafe-inline" not in CSP
    assert 'id="login-form"' in page.text and 'type="password"' in page.text
    assert ORG not in page.text  # no data before a token works
    assert not re.search(r"https?://", page.text)  # nothing from a CDN
    for name, media in STATIC_FILES.items():
        r = api.client.get(f"/dashboard/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"] == media
        assert r.content == (STATIC / name).read_bytes()
    for bad in ("dashboard.html", "..%2Fapp.py", "missing.js", "%2e%2e%2fsecurity.py"):
        assert api.client.get(f"/dashboard/static/{bad}").status_code == 404, bad


def test_the_script_never_renders_data_as_html() -> None:
    script = (STATIC / "dashboard.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink
    assert "textContent" in script
    assert "new EventSource" not in script  # the token must travel in a header
    assert '"Bearer " + token()' in script


@pytest.mark.parametrize("header", [None, "Bearer wrong-token", "Basic abc", "Bearer "])
def test_snapshot_needs_a_valid_token(api: Api, header: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    r = api.client.get("/v1/dashboard", headers=headers)
    assert r.status_code == 401
    assert ORG not in r.text


def test_snapshot_lists_node_peers_checkpoints_and_audit(api: Api) -> None:
    with Session(api.engine) as session:
        append_audit_event(session, stage="control", kind="run.start", privacy_class="internal")
        session.commit()
    r = api.client.get("/v1/dashboard", headers=api.h(Role.AUDITOR))
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    assert body["node"]["org_id"] == ORG and body["node"]["ready"] is True
    assert body["federation"] == {"name": "fed", "version": 0, "members": 3}
    peer = next(p for p in body["peers"] if p["org_id"] == "org-b")
    assert peer["org_id"] == "org-b" and peer["display_name"] == "ORG-B"
    assert peer["status"] == "alive" and peer["latency_ms"] == pytest.approx(4.0)
    assert body["run"] is None and body["metrics"] == [] and body["timeline"] == []
    assert body["culprit"] is None
    (ck,) = body["checkpoints"]
    assert (ck["checkpoint_id"], ck["data_shards"], ck["parity_shards"]) == ("ck-1", 3, 2)
    assert ck["shards"] == [] and ck["restorable"] is None  # the fake has no replicator
    audit = body["audit"]
    assert audit["ok"] is True and audit["events"] >= 1 and audit["checked"] == audit["events"]


def test_a_tampered_audit_entry_shows_the_chain_broken(api: Api) -> None:
    with Session(api.engine) as session:
        for kind in ("run.start", "run.pause", "run.resume"):
            append_audit_event(session, stage="control", kind=kind, privacy_class="internal")
        session.commit()
    with api.engine.begin() as conn:
        conn.execute(text("UPDATE audit_event SET kind = 'run.abort' WHERE kind = 'run.pause'"))
    audit = api.client.get("/v1/dashboard", headers=api.h()).json()["audit"]
    assert audit["ok"] is False and audit["tail_ok"] is False
    assert isinstance(audit["first_bad_entry"], int)


def test_snapshot_carries_the_run_metrics_timeline_and_culprit(api: Api) -> None:
    run = propose_run(api)
    with Session(api.engine) as session:
        for rnd, loss, eps in ((1, 0.9, 0.5), (2, 0.6, 1.0)):
            session.add(RunMetric(run_id=run["id"], round=rnd, name="loss", value=loss))
            session.add(RunMetric(run_id=run["id"], round=rnd, name="epsilon_spent", value=eps))
        session.commit()
    feed(api.app.state.observability)
    body = api.client.get("/v1/dashboard", headers=api.h(Role.OPERATOR)).json()
    assert body["run"]["id"] == run["id"] and body["run"]["rounds"] == 3
    assert body["run"]["epsilon"] == 4.0
    assert {(m["round"], m["name"], m["value"]) for m in body["metrics"]} >= {
        (1, "loss", 0.9),
        (2, "epsilon_spent", 1.0),
    }
    (line,) = body["timeline"]
    assert line["round"] == 1 and line["state"] == "completed" and line["seconds"] == 2.5
    assert [s["stage"] for s in line["stages"]] == ["ready", "share"]
    assert line["peers"]["org-b"]["ready"] == {"status": "ok", "at": 0.01, "bytes": 120}
    assert line["peers"]["org-b"]["share"]["status"] == "missing"
    assert line["dropped"] == ["org-b"]
    assert line["culprit"]["org"] == "org-b"
    assert body["culprit"]["org"] == "org-b" and body["culprit"]["round"] == 1
    peer = body["peers"][0]
    assert peer["bytes_received"] == 120 and peer["score"] == pytest.approx(5.0)


def test_node_route_reports_the_culprit_for_fedweave_status(api: Api) -> None:
    assert api.client.get("/v1/node", headers=api.h()).json()["culprit"] is None
    feed(api.app.state.observability, round=3)
    culprit = api.client.get("/v1/node", headers=api.h(Role.AUDITOR)).json()["culprit"]
    assert culprit["org"] == "org-b" and culprit["round"] == 3 and culprit["run"] == "run-key"
    assert "no share message from org-b in time" in culprit["evidence"]


def test_metrics_route_carries_the_stage_metrics(api: Api) -> None:
    feed(api.app.state.observability)
    body = api.client.get("/metrics", headers=api.h(Role.AUDITOR)).text
    assert "# TYPE fedweave_stage_duration_seconds histogram" in body
    assert 'fedweave_stage_duration_seconds_count{stage="share"} 1' in body
    assert 'fedweave_stage_bytes_sent_total{stage="ready"} 300' in body
    assert 'fedweave_stage_retries_total{stage="reduce"} 1' in body
    assert 'fedweave_dropouts_total{peer="org-b"} 1' in body
    assert 'fedweave_peer_timeouts_total{stage="share",peer="org-b"} 1' in body
    assert 'fedweave_rounds_total{outcome="completed"} 1' in body
    assert "fedweave_runs" in body  # the route's own families are still there


class _Rounds:
    def __init__(self) -> None:
        self.observers: list[Any] = []

        class _Endpoint:
            federation = "fed-x"

        self.endpoint = _Endpoint()

    def add_observer(self, fn: Any) -> None:
        self.observers.append(fn)


def test_create_app_attaches_to_the_nodes_round_engine(tmp_path: Path) -> None:
    node = FakeNode()
    node.rounds = _Rounds()  # type: ignore[attr-defined]
    settings = Settings(data_dir=tmp_path / "node")
    engine = make_engine(settings.resolved_database_url)
    app = create_app(settings, node, engine=engine)
    obs = app.state.observability
    assert node.rounds.observers == [obs.observe]  # type: ignore[attr-defined]
    assert obs.federation == "fed-x" and obs.org_id == ORG
    with Session(engine) as session:
        _, token = create_token(session, "t", Role.AUDITOR)
        session.commit()
    with TestClient(app) as client:
        assert client.get("/v1/dashboard", headers={"Authorization": f"Bearer {token}"}).is_success
    assert len(node.rounds.observers) == 1  # type: ignore[attr-defined]  # attached once
    engine.dispose()


def _set_run(api: Api, run_id: str, **values: Any) -> None:
    """Set columns of a run's row directly (as the node's engine would)."""
    with Session(api.engine) as session:
        row = session.get(Run, run_id)
        assert row is not None
        for name, value in values.items():
            setattr(row, name, value)
        session.add(row)
        session.commit()


def _snapshot_run(api: Api) -> dict[str, Any]:
    r = api.client.get("/v1/dashboard", headers=api.h(Role.AUDITOR))
    assert r.status_code == 200, r.text
    run: dict[str, Any] = r.json()["run"]
    return run


def test_a_failed_run_shows_its_reason_and_no_round_running_after_the_last(api: Api) -> None:
    run = propose_run(api, rounds=5)
    reason = "round 3 failed 3 times: org-c sent no share in time"
    _set_run(api, run["id"], state="failed", state_reason=reason, current_round=2)
    obs = api.app.state.observability
    feed(obs, round=2, culprit=None)  # the node saw rounds 2 and 3 begin; 3 never ended
    obs.observe(RoundObservation("round", run["run_key"], 2, "ready"))
    obs.observe(RoundObservation("completed", run["run_key"], 2, "done", seconds=1.0))
    obs.observe(RoundObservation("round", run["run_key"], 3, "ready"))
    body = api.client.get("/v1/dashboard", headers=api.h(Role.AUDITOR)).json()
    shown = body["run"]
    assert (shown["name"], shown["run_key"], shown["id"]) == ("r1", run["run_key"], run["id"])
    assert shown["state"] == "failed" and shown["state_reason"] == reason
    assert shown["ended"] is True and shown["tone"] == "bad"
    assert shown["headline"] == f"failed in round 3 of 5: {reason}"
    assert shown["href"] == f"/v1/runs/{run['run_key']}"
    assert [r["state"] for r in shown["round_states"]] == [
        "completed",
        "completed",
        "failed",
        "not_run",
        "not_run",
    ]
    mine = {line["round"]: line for line in body["timeline"] if line["run"] == run["run_key"]}
    assert mine[2]["state"] == "completed"
    assert mine[3]["state"] == "interrupted" and reason in mine[3]["note"]
    assert all(line["state"] != "running" for line in mine.values())
    other = next(line for line in body["timeline"] if line["run"] == "run-key")
    assert other["state"] == "completed"  # a run this node has no row of: as observed
    # the link leads to the run's record, which carries the same reason
    record = api.client.get(shown["href"], headers=api.h(Role.AUDITOR)).json()
    assert record["state"] == "failed" and record["state_reason"] == reason


def test_a_running_run_shows_rounds_to_come_and_what_a_resume_waits_for(api: Api) -> None:
    run = propose_run(api)
    wait = "waiting for org-c to come back (2 of 3 participants alive)"
    _set_run(api, run["id"], state="running", current_round=1, state_reason=wait)
    shown = _snapshot_run(api)
    assert shown["ended"] is False and shown["tone"] == "wait"
    assert shown["waiting"]["what"] == "resume" and shown["waiting"]["detail"] == wait
    assert shown["headline"] == f"running, waiting to resume: {wait}"
    assert [r["state"] for r in shown["round_states"]] == ["completed", "running", "upcoming"]


def test_finding_1_the_dashboard_shows_a_round_waiting_for_a_quorum(api: Api) -> None:
    from org_node.services import RunActivity

    run = propose_run(api)
    _set_run(api, run["id"], state="running", current_round=1)
    api.node.activity = RunActivity(
        2, "quorum", 1_800_000_000.0, attempt=3, failures=2, threshold=3, next_attempt=None
    )
    shown = _snapshot_run(api)
    assert shown["tone"] == "wait"
    assert shown["waiting"]["stage"] == "quorum"
    assert shown["headline"] == (
        "running, round 2: waiting for a quorum of 3 (2 attempts failed), attempt 3 under way"
    )


def test_a_proposed_run_shows_whom_it_waits_for_and_the_deadline(api: Api) -> None:
    run = propose_run(api, peers_accept=False)
    shown = _snapshot_run(api)
    assert (shown["name"], shown["run_key"]) == ("r1", run["run_key"])
    assert shown["state"] == "proposed" and shown["ended"] is False
    assert shown["waiting"]["what"] == "consent" and shown["tone"] == "wait"
    assert shown["waiting"]["orgs"] == [ORG, "org-b", "org-c"]  # this org too, as yet
    assert shown["participants"] == [ORG, "org-b", "org-c"] and shown["consents"] == []
    r = api.client.post(f"/v1/runs/{run['run_key']}/accept", headers=api.h())
    assert r.status_code == 200, r.text
    shown = _snapshot_run(api)
    assert shown["state"] == "accepted"
    assert shown["waiting"]["what"] == "consent"
    assert shown["waiting"]["orgs"] == ["org-b", "org-c"]
    assert shown["waiting"]["until"] is not None and shown["consent_by"] is not None
    assert shown["headline"].startswith("accepted: waiting for the consent of org-b, org-c")
    assert "(deadline " in shown["headline"]
    assert [(c["org_id"], c["decision"]) for c in shown["consents"]] == [(ORG, "accept")]
    assert all(r["state"] == "upcoming" for r in shown["round_states"])
    peer_consents(api, run["run_key"], "org-b", decision="decline")
    _set_run(api, run["id"], state="cancelled", state_reason="org-b declined: org-b says no")
    shown = _snapshot_run(api)
    assert shown["state"] == "cancelled" and shown["tone"] == "bad"
    assert shown["headline"] == "cancelled: org-b declined: org-b says no"
    assert {c["org_id"]: c["decision"] for c in shown["consents"]}["org-b"] == "decline"
    assert all(r["state"] == "not_run" for r in shown["round_states"])


def test_a_newly_proposed_run_replaces_an_ended_one(api: Api) -> None:
    old = propose_run(api)
    _set_run(api, old["id"], state="completed", current_round=3)
    assert _snapshot_run(api)["id"] == old["id"]
    r = api.client.post("/v1/runs", json={"name": "r2", "spec": RUN_SPEC}, headers=api.h())
    assert r.status_code == 201, r.text
    new = r.json()
    # even when the ended row looks newer (a clock step, a late update), the pending
    # run is the one followed
    later = datetime.now(UTC) + timedelta(hours=1)
    _set_run(api, old["id"], created_at=later, updated_at=later)
    shown = _snapshot_run(api)
    assert (shown["id"], shown["name"], shown["run_key"]) == (new["id"], "r2", new["run_key"])
    assert shown["state"] == "proposed" and shown["waiting"]["what"] == "consent"
    # and a running run comes before either
    _set_run(api, old["id"], state="running", current_round=1)
    assert _snapshot_run(api)["id"] == old["id"]


def test_finding_9_the_dashboard_follows_the_run_whose_engine_runs_here(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A previous run whose row was left running (or paused) and looks newer does not
    keep the dashboard from the run the node's engine runs now."""
    old = propose_run(api)
    r = api.client.post("/v1/runs", json={"name": "r2", "spec": RUN_SPEC}, headers=api.h())
    assert r.status_code == 201, r.text
    new = r.json()
    later = datetime.now(UTC) + timedelta(hours=1)
    _set_run(api, old["id"], state="paused", current_round=150, updated_at=later)
    _set_run(api, new["id"], state="running", current_round=2)
    assert _snapshot_run(api)["id"] == old["id"]  # no engine runs here: the newest active
    monkeypatch.setattr(api.node, "active_run_id", lambda: new["id"], raising=False)
    shown = _snapshot_run(api)
    assert (shown["id"], shown["state"]) == (new["id"], "running")
