"""``/v1/audit/runs/{id}/report`` (generate, JSON, HTML), the round and class filters of
``/v1/audit/events``, the node-side facts, and the offline ``fedweave audit report``."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from coordinator_free.identity import OrgIdentity
from coordinator_free.wire import Envelope
from sqlmodel import Session
from typer.testing import CliRunner

from api.routers.audit import report_dir
from org_node.audit.facts import (
    ROUNDS_FILE,
    UnknownRunId,
    node_report,
    node_run_facts,
    observed_rounds,
    org_run_facts,
    read_rounds,
    record_round,
)
from org_node.audit.log import EgressLog
from org_node.audit.report import build_report
from org_node.audit.verify import verify_report
from org_node.db.models import Role, RunConsent, RunMetric
from org_node.engine import ATTEMPTS, STATE_FILE, EngineConfig, EngineState, RoundReport, run_key
from org_node.policy import RunSpec
from org_node.services import NodeIdentityInfo, StaticNode
from tests.api.conftest import FEDERATION, ORG, Api, identity, propose_run
from tests.run_flow import apropose_once, await_states

PEERS = ("org-b", "org-c")
DP_CONFIG = EngineConfig(weighting="uniform", l2_clip=10.0, noise_multiplier=1.5)


def _send(log: EgressLog, peer: str, kind: str, payload: bytes, run: str, rnd: int) -> None:
    env = Envelope("fed", run, rnd, "st", kind, log.org, peer, 1, 1.0e9, payload)
    env = env.with_signature(log.identity.sign(env.signing_bytes()))
    log.record(env, env.to_wire())


def _round_report(key: str, rnd: int, survivors: tuple[str, ...]) -> RoundReport:
    dropped = tuple(o for o in (ORG, *PEERS) if o not in survivors)
    return RoundReport(
        run_key=key,
        round=rnd,
        model_hash=hashlib.sha256(f"model {rnd}".encode()).hexdigest(),
        survivors=survivors,
        dropped=dropped,
        attempts=1,
        local_steps=4,
        examples=100,
        metrics={"loss": 1.0 / rnd, "accuracy": 0.5 + 0.1 * rnd},
        epsilon_spent=1.0 * rnd,
        bytes_sent=1000,
    )


class Run:
    """A run proposed and accepted at the API, with two reported rounds at the node; the
    node holds org-c's signed consent, and org-b's never reached it."""

    def __init__(self, api: Api, data_dir: Path, *, heads: bool = True) -> None:
        row = propose_run(api)
        self.id: str = row["id"]
        with Session(api.engine) as session:
            lost = session.get(RunConsent, (row["run_key"], "org-b"))
            assert lost is not None
            session.delete(lost)
            session.commit()
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "fedweave.toml").write_text(f'[node]\nfederation = "{FEDERATION}"\n')
        r = api.client.post(f"/v1/runs/{self.id}/accept", json={"reason": "ok"}, headers=api.h())
        assert r.status_code == 200, r.text
        self.key = run_key(
            row["name"], api.client.get(f"/v1/runs/{self.id}", headers=api.h()).json()["spec"]
        )
        self.log = EgressLog(identity(ORG), data_dir / "audit" / "egress.jsonl")
        run_dir = data_dir / "runs" / self.key
        for rnd, survivors in ((1, (ORG, *PEERS)), (2, (ORG, "org-b"))):
            for peer in PEERS[: 3 - rnd]:
                wire_round = (rnd - 1) * ATTEMPTS  # the protocol round of attempt 1
                _send(self.log, peer, "round.ready", b"k" * 40, self.key, wire_round)
                _send(self.log, peer, "agg.chunk", b"m" * 100, self.key, wire_round)
            if heads:
                self.log.sign_head(self.key, rnd)
            record_round(run_dir, _round_report(self.key, rnd, survivors), (ORG, *PEERS))
        with Session(api.engine) as session:
            for rnd in (1, 2):
                session.add(RunMetric(run_id=self.id, round=rnd, name="epsilon_spent", value=rnd))
            session.commit()
        model = {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)}
        state = EngineState(self.key, 2, model, {}, None, plan={})
        (run_dir / STATE_FILE).write_bytes(state.to_bytes())


def _reporting_node(api: Api, data_dir: Path, log: EgressLog | None) -> StaticNode:
    me = identity(ORG)
    info = NodeIdentityInfo(ORG, "Org A", me.fingerprint, "https://127.0.0.1:9001", "9")
    return StaticNode(
        info,
        reports=lambda run_id: node_report(
            api.engine, data_dir, run_id, identity=me, config=DP_CONFIG, log=log
        ),
    )


@pytest.fixture
def run(api: Api, tmp_path: Path) -> Run:
    data_dir = tmp_path / "node"
    r = Run(api, data_dir)
    api.app.state.node = _reporting_node(api, data_dir, r.log)
    return r


def test_auditor_generates_and_reads_the_report(api: Api, run: Run) -> None:
    r = api.client.post(f"/v1/audit/runs/{run.id}/report", headers=api.h(Role.AUDITOR))
    assert r.status_code == 201, r.text
    report: dict[str, Any] = r.json()
    assert report["run"]["id"] == run.key
    assert [x["round"] for x in report["rounds"]] == [1, 2]
    assert report["rounds"][1]["dropped"] == ["org-c"]
    consent = {p["org"]: p["consent"] for p in report["participants"]}
    assert consent[ORG] is not None and consent[ORG]["decision"] == "accepted"
    assert consent[ORG]["reason"] == "ok" and consent["org-b"] is None
    assert consent["org-c"]["decision"] == "accepted"
    assert consent["org-c"]["signed"]["federation"] == FEDERATION
    keys = {org: identity(org).public_key for org in (ORG, *PEERS)}
    checked = verify_report(report, trusted_keys=keys)
    assert checked.ok and "1 signed consent(s) of other participants valid" in checked.summary
    dp = report["differential_privacy"]
    assert dp is not None and len(dp["rounds"]) == 2 and dp["epsilon_budget"] == 4.0
    # each round charged for its survivors' noise, on the mechanism the spec carries
    assert [x["survivors"] for x in dp["rounds"]] == [3, 2]
    assert dp["agreed"]["mechanism"] == report["run"]["spec"]["dp"]
    first, second = dp["rounds"]
    assert second["noise_over_sensitivity"] < first["noise_over_sensitivity"]
    assert second["epsilon"] > first["epsilon"]
    assert report["secure_aggregation"]["n"] == 3
    assert verify_report(report, trusted_keys={ORG: identity(ORG).public_key}).ok
    got = api.client.get(f"/v1/audit/runs/{run.id}/report", headers=api.h(Role.AUDITOR))
    assert got.status_code == 200
    assert got.json() == report
    html = api.client.get(f"/v1/audit/runs/{run.id}/report.html", headers=api.h(Role.ADMIN))
    assert html.status_code == 200
    assert html.headers["content-type"].startswith("text/html")
    text = html.text
    assert run.key in text
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)
    assert "<link" not in text and "@import" not in text and "<script src" not in text
    assert "https://" not in text


def test_report_files_are_stored(api: Api, run: Run) -> None:
    from api.settings import Settings

    settings: Settings = api.app.state.settings
    assert api.client.post(f"/v1/audit/runs/{run.id}/report", headers=api.h()).status_code == 201
    # named by the federation run key, the name every org and the report itself use
    assert (report_dir(settings) / f"{run.key}.json").is_file()
    assert (report_dir(settings) / f"{run.key}.html").is_file()


def test_operator_may_not_read_reports(api: Api, run: Run) -> None:
    for method, path in (
        ("POST", f"/v1/audit/runs/{run.id}/report"),
        ("GET", f"/v1/audit/runs/{run.id}/report"),
        ("GET", f"/v1/audit/runs/{run.id}/report.html"),
    ):
        r = api.client.request(method, path, headers=api.h(Role.OPERATOR))
        assert r.status_code == 403, (method, path)


def test_unknown_run_is_404(api: Api, run: Run) -> None:
    for method, suffix in (("POST", "report"), ("GET", "report"), ("GET", "report.html")):
        r = api.client.request(method, f"/v1/audit/runs/nosuchrun/{suffix}", headers=api.h())
        assert r.status_code == 404, r.text
        assert r.json()["detail"] == "run not found"


def test_report_not_generated_yet_is_404(api: Api, run: Run) -> None:
    r = api.client.get(f"/v1/audit/runs/{run.id}/report", headers=api.h())
    assert r.status_code == 404
    assert "POST" in r.json()["detail"]


def test_no_signed_head_yet_is_409(api: Api, tmp_path: Path) -> None:
    data_dir = tmp_path / "nohead"
    r = Run(api, data_dir, heads=False)
    api.app.state.node = _reporting_node(api, data_dir, r.log)
    got = api.client.post(f"/v1/audit/runs/{r.id}/report", headers=api.h())
    assert got.status_code == 409
    assert "signed head" in got.json()["detail"]


def test_run_without_traffic_is_409(api: Api, tmp_path: Path) -> None:
    row = propose_run(api)
    api.app.state.node = _reporting_node(api, tmp_path / "empty", None)
    got = api.client.post(f"/v1/audit/runs/{row['id']}/report", headers=api.h())
    assert got.status_code == 409
    assert "no egress" in got.json()["detail"]


def test_node_without_reports_is_409(api: Api) -> None:
    row = propose_run(api)
    info = NodeIdentityInfo(ORG, "Org A", "ff", "https://127.0.0.1:9001", "9")
    api.app.state.node = StaticNode(info)
    got = api.client.post(f"/v1/audit/runs/{row['id']}/report", headers=api.h())
    assert got.status_code == 409
    assert "egress log" in got.json()["detail"]


def test_events_filter_by_round_and_class(api: Api) -> None:
    from org_node.db.repo import append_audit_event

    with Session(api.engine) as session:
        for rnd, cls in ((1, "masked_vector_chunk"), (2, "masked_vector_chunk"), (2, "metadata")):
            append_audit_event(
                session, stage="round", kind="agg.chunk", run="r", round=rnd, privacy_class=cls
            )
        session.commit()
    h = api.h(Role.AUDITOR)
    by_round = api.client.get("/v1/audit/events", params={"round": 2}, headers=h).json()
    assert by_round["count"] == 2 and {e["round"] for e in by_round["data"]} == {2}
    both = api.client.get(
        "/v1/audit/events", params={"round": 2, "privacy_class": "metadata"}, headers=h
    ).json()
    assert both["count"] == 1 and both["data"][0]["privacy_class"] == "metadata"
    assert api.client.get("/v1/audit/events", params={"round": -1}, headers=h).status_code == 422


def test_round_log_keeps_one_line_per_round(tmp_path: Path) -> None:
    report = _round_report("k", 1, (ORG, "org-b"))
    record_round(tmp_path, report, (ORG, *PEERS))
    record_round(tmp_path, report, (ORG, *PEERS))
    record_round(tmp_path, _round_report("k", 2, (ORG,)), (ORG, *PEERS))
    rounds = read_rounds(tmp_path)
    assert [r.round for r in rounds] == [1, 2]
    assert rounds[0].recovered == ("org-c",) and rounds[0].agreeing_peers == (ORG, "org-b")
    assert len((tmp_path / ROUNDS_FILE).read_text().splitlines()) == 2


def test_facts_of_unknown_run(api: Api, tmp_path: Path) -> None:
    with pytest.raises(UnknownRunId):
        node_run_facts(api.engine, tmp_path, "nope", org_id=ORG, config=EngineConfig())


def test_offline_cli_report(tmp_path: Path) -> None:
    from org_node.cli import app
    from org_node.config import NodePaths
    from org_node.db.engine import default_database_url, make_engine, migrate
    from org_node.db.models import Run as RunRow
    from org_node.initialize import initialize

    data_dir = tmp_path / "n"
    initialize(data_dir, ORG, peer_port=18971, admin_port=18970)
    paths = NodePaths(data_dir)
    engine = make_engine(default_database_url(paths.root))
    migrate(engine)
    spec = {
        "trainer": "breast_cancer",
        "rounds": 1,
        "participants": [ORG, "org-b"],
        "backend": "masked",
        "threshold": 2,
        "epsilon": None,
    }
    with Session(engine) as session:
        session.add(RunRow(id="run1", name="offline", spec=spec, proposed_by="admin"))
        session.commit()
    engine.dispose()
    key = run_key("offline", spec)
    log = EgressLog(OrgIdentity.load(paths.identity_dir), paths.egress_log)
    _send(log, "org-b", "agg.chunk", b"m" * 64, key, 1)
    log.sign_head(key, 1)
    log.close()
    out = tmp_path / "out"
    runner = CliRunner()
    r = runner.invoke(
        app, ["audit", "report", "run1", "--data-dir", str(data_dir), "--out", str(out)]
    )
    assert r.exit_code == 0, r.output
    written = json.loads((out / f"{key}.audit.json").read_text())
    assert written["run"]["id"] == key and written["differential_privacy"] is None
    assert (out / f"{key}.audit.html").is_file()
    bad = runner.invoke(
        app, ["audit", "report", "nope", "--data-dir", str(data_dir), "--out", str(out)]
    )
    assert bad.exit_code == 1
    assert "unknown run" in bad.output


def test_running_nodes_report_their_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three in-process nodes run two masked rounds; org-a's admin API then builds the
    report from what its node recorded: both rounds with their model hashes, signed."""
    import asyncio

    import httpx
    from coordinator_free.memory import InMemoryNetwork

    from api.app import create_app
    from api.settings import Settings
    from org_node.db.engine import default_database_url, make_engine
    from org_node.db.repo import create_token
    from tests.org_node.test_node_inprocess import ORGS, make_federation, start_nodes

    dirs = make_federation(tmp_path)
    tokens = {}
    for org in ORGS:
        engine = make_engine(default_database_url(dirs[org]))
        with Session(engine) as s:
            _, tokens[org] = create_token(
                s, "auditor", Role.AUDITOR if org == "org-a" else Role.ADMIN
            )
            _, admin = create_token(s, "admin", Role.ADMIN)
            s.commit()
        engine.dispose()
        tokens[org + "/admin"] = admin
    spec = {
        "trainer": "breast_cancer",
        "rounds": 2,
        "participants": list(ORGS),
        "threshold": 2,
        "backend": "masked",
    }

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        nodes = await start_nodes(dirs, InMemoryNetwork())
        clients = {
            org: httpx.AsyncClient(
                transport=httpx.ASGITransport(
                    app=create_app(Settings(data_dir=dirs[org]), node, engine=node.db)
                ),
                base_url="http://admin",
                headers={"Authorization": f"Bearer {tokens[org + '/admin']}"},
            )
            for org, node in nodes.items()
        }
        try:
            ids = await apropose_once(clients, "audited", spec)
            rows = await await_states(clients, "audited", {"completed", "failed"})
            assert {r["state"] for r in rows.values()} == {"completed"}
            auditor = {"Authorization": f"Bearer {tokens['org-a']}"}
            a = clients["org-a"]
            made = await a.post(f"/v1/audit/runs/{ids['org-a']}/report", headers=auditor)
            html = await a.get(f"/v1/audit/runs/{ids['org-a']}/report.html", headers=auditor)
            return made, html
        finally:
            for c in clients.values():
                await c.aclose()
            for node in nodes.values():
                await node.stop()

    made, html = asyncio.run(scenario())
    assert made.status_code == 201, made.text
    report = made.json()
    assert [r["round"] for r in report["rounds"]] == [1, 2]
    assert all(len(r["model_hash"]) == 64 for r in report["rounds"])
    assert report["traffic"]["total"]["messages"] > 0
    owners = {s["owner"] for s in report["shards_held"]}
    assert owners and owners <= {"org-b", "org-c"}
    keys = {org: identity_of(dirs[org]) for org in ORGS}
    assert verify_report(report, trusted_keys={"org-a": keys["org-a"]}).ok
    assert html.status_code == 200 and "<svg" in html.text
    # the other participants' consents, as org-a received them, each with its signature
    consents = {p["org"]: p["consent"] for p in report["participants"]}
    assert "signed" not in consents["org-a"]  # its own: the report's signature covers it
    for org in ("org-b", "org-c"):
        assert consents[org]["decision"] == "accepted"
        assert consents[org]["signed"]["federation"] == "fed-test"
    checked = verify_report(report, trusted_keys=keys)
    assert checked.ok, checked.summary
    assert "2 signed consent(s) of other participants valid" in checked.summary
    unpinned = verify_report(report, trusted_keys={"org-a": keys["org-a"]})
    assert "consents of org-b, org-c not checked (no pinned key)" in unpinned.summary
    # org-a cannot make a participant's decline look like consent, even signing anew
    forged = _resigned(report, dirs["org-a"], lambda d: _flip(d, "org-c"))
    result = verify_report(forged, trusted_keys=keys)
    assert not result.ok
    assert result.location == "participants[2].consent"
    assert "not a valid signature of 'org-c'" in result.summary


def _flip(doc: dict[str, Any], org: str) -> None:
    for part in doc["participants"]:
        if part["org"] == org:
            part["consent"]["decision"] = "declined"
            part["consent"]["reason"] = "no ethics approval"


def _resigned(report: dict[str, Any], data_dir: Path, change: Any) -> dict[str, Any]:
    """``report`` changed by ``change`` and signed again by its own org, as a dishonest
    org could: only the signatures of the others can catch it."""
    import copy

    from org_node.audit.report import report_signing_bytes, section_digests
    from org_node.config import NodePaths

    doc = copy.deepcopy(report)
    change(doc)
    me = OrgIdentity.load(NodePaths(data_dir).identity_dir)
    digests = section_digests(doc)
    doc["signature"]["sections"] = digests
    doc["signature"]["value"] = me.sign(report_signing_bytes(doc, digests)).hex()
    return doc


def identity_of(data_dir: Path) -> bytes:
    from org_node.config import NodePaths

    return OrgIdentity.load(NodePaths(data_dir).identity_dir).public_key


def test_report_holds_this_orgs_consent_the_hashes_and_run_rounds(api: Api, run: Run) -> None:
    r = api.client.post(f"/v1/audit/runs/{run.id}/report", headers=api.h(Role.AUDITOR))
    assert r.status_code == 201, r.text
    report: dict[str, Any] = r.json()
    by_org = {p["org"]: p for p in report["participants"]}
    mine = by_org[ORG]["consent"]
    assert mine["decided_by_role"] == "admin" and mine["decided_by"]
    assert by_org["org-b"]["consent"] is None
    assert "round 1" in by_org["org-b"]["consent_note"]
    assert by_org["org-b"]["consent_note"].startswith("not recorded here")
    for row in report["rounds"]:
        assert row["model_hash"] == hashlib.sha256(f"model {row['round']}".encode()).hexdigest()
        assert row["model_hash_agreed"] is True
        assert row["survivors"] == sorted(row["survivors"])
    per_round = {x["round"] for x in report["traffic"]["per_round"]}
    assert per_round == {1, 2}
    assert verify_report(report, trusted_keys={ORG: identity(ORG).public_key}).ok


def test_org_run_facts_reads_the_consent_by_run_key_and_the_round_log(
    api: Api, run: Run, tmp_path: Path
) -> None:
    spec = RunSpec.from_dict(api.client.get(f"/v1/runs/{run.id}", headers=api.h()).json()["spec"])
    observed = observed_rounds(spec.participants, {1: ("org-c", ORG, "org-b")}, {1: {"loss": 9.0}})
    facts = org_run_facts(
        tmp_path / "node", run.key, spec, org_id=ORG, observed=observed, db=api.engine
    )
    assert [c.org for c in facts.consents] == [ORG, "org-c"]
    assert facts.consents[0].decision == "accepted" and facts.consents[0].reason == "ok"
    assert facts.consents[1].signature and facts.consents[1].federation == FEDERATION
    assert facts.consents[0].decided_by_role == "admin"
    # the node's round log wins: its model hash and its own loss
    assert [r.round for r in facts.rounds] == [1, 2]
    assert facts.rounds[0].model_hash == hashlib.sha256(b"model 1").hexdigest()
    assert facts.rounds[0].loss == 1.0 and facts.rounds[1].dropped == ("org-c",)
    other = org_run_facts(tmp_path / "node", "0" * 32, spec, org_id=ORG, db=api.engine)
    assert other.consents == () and other.rounds == ()
    report = build_report(run.log, facts)
    assert report["participants"][0]["consent"]["decision"] == "accepted"
