"""The client commands (``fedweave runs``, ``peers``, ``audit events``) against the real
admin API app with a fake node, in process (Starlette's test client as the transport)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import org_node.cli as cli
import org_node.cli_common as cli_common
from org_node.db.models import Role
from tests.api.conftest import RUN_SPEC, Api, make_api, migrated_sqlite, peer_consents

__all__ = ["migrated_sqlite"]

URL = "http://node.test"


@pytest.fixture
def client_api(
    tmp_path: Path, migrated_sqlite: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Api]:
    for api in make_api(tmp_path, template=migrated_sqlite):

        def in_process(base_url: str, token: str, app: Any = api.app) -> TestClient:
            assert base_url == URL
            return TestClient(app, base_url=base_url, headers={"Authorization": f"Bearer {token}"})

        monkeypatch.setattr(cli_common, "http_client", in_process)
        monkeypatch.delenv("FEDWEAVE_URL", raising=False)
        monkeypatch.delenv("FEDWEAVE_TOKEN", raising=False)
        yield api


def invoke(api: Api, *args: str, role: Role = Role.ADMIN) -> Any:
    runner = CliRunner()
    return runner.invoke(cli.app, [*args, "--url", URL, "--token", api.tokens[role]])


def _propose(api: Api, tmp_path: Path, name: str = "r1") -> str:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(RUN_SPEC))
    r = invoke(api, "runs", "propose", "--name", name, "--spec", str(spec))
    assert r.exit_code == 0, r.output
    assert f"proposed run {name} (key " in r.output
    assert f"each org consents with: fedweave runs accept {name}" in r.output
    key = str(r.output.split("(key ")[1].split(")")[0])
    peer_consents(api, key, "org-b", "org-c")  # as if they had arrived from the peers
    return key


def test_propose_list_accept_start_show(client_api: Api, tmp_path: Path) -> None:
    run_id = _propose(client_api, tmp_path)
    r = invoke(client_api, "runs", "list")
    assert r.exit_code == 0, r.output
    assert run_id[:12] in r.output and "proposed" in r.output and "org-b" in r.output
    r = invoke(client_api, "runs", "accept", "r1", "--reason", "ok by the board")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0] == f"run r1 (key {run_id}): accepted"
    assert "waiting for: start at" in r.output  # every consent is in: a start time is agreed
    r = invoke(client_api, "runs", "start", run_id[:10])
    assert r.exit_code == 0, r.output
    assert "running" in r.output
    local = client_api.client.get(f"/v1/runs/{run_id}", headers=client_api.h()).json()["id"]
    hooks = [c for c in client_api.node.calls if c[0] != "announced"]
    assert hooks == [("accepted", local), ("started", local)]
    r = invoke(client_api, "runs", "show", run_id, role=Role.AUDITOR)
    assert r.exit_code == 0, r.output
    assert "state: running" in r.output
    assert "ok by the board" in r.output
    assert "org-b: accept at" in r.output and f"run r1 (key {run_id})" in r.output
    assert "no round metrics yet" in r.output


def test_show_prints_metrics_per_round(client_api: Api, tmp_path: Path) -> None:
    from sqlmodel import Session

    from org_node.db.models import RunMetric

    key = _propose(client_api, tmp_path)
    run_id = client_api.client.get(f"/v1/runs/{key}", headers=client_api.h()).json()["id"]
    with Session(client_api.engine) as session:
        for rnd, loss in ((1, 0.75), (2, 0.5)):
            session.add(RunMetric(run_id=run_id, round=rnd, name="loss", value=loss))
            session.add(RunMetric(run_id=run_id, round=rnd, name="epsilon_spent", value=rnd * 1.5))
        session.commit()
    r = invoke(client_api, "runs", "show", "r1")
    assert r.exit_code == 0, r.output
    lines = [line for line in r.output.splitlines() if "0.75" in line or "0.5 " in line]
    assert len(lines) == 2
    assert "epsilon_spent" in r.output and "loss" in r.output


def test_propose_from_flags(client_api: Api) -> None:
    r = invoke(
        client_api,
        "runs",
        "propose",
        "--name",
        "flags",
        "--trainer",
        "tabular",
        "--rounds",
        "2",
        "--participant",
        "org-a",
        "--participant",
        "org-b",
        "--threshold",
        "2",
        "--data",
        "table",
        "--column",
        "age:float",
        "--column",
        "label:int",
        "--config",
        "target=label",
        "--config",
        "hidden=16",
        "--config",
        "standardize=false",
    )
    assert r.exit_code == 0, r.output
    body = client_api.client.get("/v1/runs", headers=client_api.h()).json()
    spec = body["data"][0]["spec"]
    assert spec["participants"] == ["org-a", "org-b"] and spec["rounds"] == 2
    assert spec["data"]["columns"] == {"age": "float", "label": "int"}
    assert spec["config"] == {"target": "label", "hidden": 16, "standardize": False}


def test_invalid_spec_is_one_line(client_api: Api) -> None:
    r = invoke(client_api, "runs", "propose", "--name", "x", "--trainer", "t", "--rounds", "2")
    assert r.exit_code == 1
    assert "participants" in r.output


def test_wrong_token(client_api: Api) -> None:
    r = CliRunner().invoke(cli.app, ["runs", "list", "--url", URL, "--token", "nope-secret"])
    assert r.exit_code == 1
    assert r.output.strip() == "error: authentication failed: check --token"
    assert "nope-secret" not in r.output


def test_token_from_env_is_never_printed(client_api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDWEAVE_URL", URL)
    monkeypatch.setenv("FEDWEAVE_TOKEN", client_api.tokens[Role.ADMIN])
    r = CliRunner().invoke(cli.app, ["peers"])
    assert r.exit_code == 0, r.output
    assert "org-b" in r.output and "alive" in r.output
    assert client_api.tokens[Role.ADMIN] not in r.output


def test_conflict_names_current_state(client_api: Api, tmp_path: Path) -> None:
    run_id = _propose(client_api, tmp_path)
    assert invoke(client_api, "runs", "abort", run_id).exit_code == 0
    r = invoke(client_api, "runs", "start", run_id)
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "aborted" in lines[0]


def test_auditor_may_not_propose(client_api: Api, tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(RUN_SPEC))
    r = invoke(client_api, "runs", "propose", "--name", "r", "--spec", str(spec), role=Role.AUDITOR)
    assert r.exit_code == 1
    assert r.output.startswith("error: forbidden")


def test_unknown_run(client_api: Api) -> None:
    r = invoke(client_api, "runs", "accept", "nosuchrun")
    assert r.exit_code == 1
    assert r.output.strip() == "error: no run 'nosuchrun' at this node"


def test_audit_events_filtered(client_api: Api, tmp_path: Path) -> None:
    run_id = _propose(client_api, tmp_path)
    invoke(client_api, "runs", "accept", run_id)
    r = invoke(
        client_api, "audit", "events", "--run", run_id, "--kind", "run.accept", role=Role.AUDITOR
    )
    assert r.exit_code == 0, r.output
    assert "(1 of 1)" in r.output and "run.accept" in r.output


def test_no_node_answers() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    r = CliRunner().invoke(cli.app, ["runs", "list", "--url", url, "--token", "t"])
    assert r.exit_code == 1
    assert r.output.strip() == f"error: no node answers at {url}"


def test_url_from_data_dir(tmp_path: Path) -> None:
    from org_node.initialize import initialize

    initialize(tmp_path / "n", "org-a", peer_port=18998, admin_port=18999)
    assert cli.admin_url(None, tmp_path / "n") == "http://127.0.0.1:18999"
    assert cli.admin_url("http://x:1/", tmp_path / "n") == "http://x:1"
    with pytest.raises(cli.ClientError, match="--url"):
        cli.admin_url(None, None)


def test_missing_token() -> None:
    r = CliRunner().invoke(cli.app, ["peers", "--url", URL], env={"FEDWEAVE_TOKEN": ""})
    assert r.exit_code == 1
    assert "no token" in r.output


def test_audit_fetch_writes_json_and_html(client_api: Api, tmp_path: Path) -> None:
    from tests.api.test_audit_reports import Run, _reporting_node

    run = Run(client_api, tmp_path / "node")
    client_api.app.state.node = _reporting_node(client_api, tmp_path / "node", run.log)
    out = tmp_path / "reports"
    r = invoke(client_api, "audit", "fetch", run.id, "--out", str(out), role=Role.AUDITOR)
    assert r.exit_code == 0, r.output
    from org_node.audit.verify import verify_path

    report = json.loads((out / f"{run.key}.audit.json").read_text())
    assert report["run"]["id"] == run.key
    assert "<html" in (out / f"{run.key}.audit.html").read_text().lower()
    assert verify_path(out / f"{run.key}.audit.json").ok
    missing = invoke(client_api, "audit", "fetch", "nosuchrun", "--out", str(out))
    assert missing.exit_code == 1
    assert missing.output.strip() == "error: not found: run not found"


def test_status_culprit_line() -> None:
    from org_node.cli import culprit_line

    assert culprit_line({"culprit": None}) == "none"
    line = culprit_line(
        {
            "culprit": {
                "org": "org3",
                "score": 4.5,
                "round": 2,
                "run": "k",
                "evidence": ["timeout in reduce", "no unmask shares"],
            }
        }
    )
    assert line == "org3 (score 4.50, round 2): timeout in reduce; no unmask shares"


def test_tokens_create_list_revoke(client_api: Api) -> None:
    r = invoke(client_api, "tokens", "create", "--name", "ci-bot", "--role", "operator")
    assert r.exit_code == 0, r.output
    created, secret_line = r.output.strip().splitlines()
    assert created.startswith("created token ") and "(ci-bot, operator, key id " in created
    secret = secret_line.rsplit(" ", 1)[1]
    assert secret_line.startswith("token (shown once") and secret.startswith("fw_")
    token_id = created.split()[2]
    key_id = secret.split("_")[1]
    # the new token works, with its role
    assert invoke_with(secret, "runs", "list").exit_code == 0
    assert invoke_with(secret, "tokens", "list").output.startswith("error: forbidden")

    listed = invoke(client_api, "tokens", "list")
    assert listed.exit_code == 0, listed.output
    assert f"tokens ({len(Role) + 1})" in listed.output
    assert "ci-bot" in listed.output and key_id in listed.output
    assert "fw_" not in listed.output and secret not in listed.output

    r = invoke(client_api, "tokens", "revoke", key_id[:6])
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"revoked token {token_id} (ci-bot, operator) at ")
    assert invoke_with(secret, "runs", "list").output.strip() == (
        "error: authentication failed: check --token"
    )
    again = invoke(client_api, "tokens", "revoke", token_id)
    assert again.exit_code == 1
    assert again.output.strip() == f"error: token {token_id} is already revoked"


def invoke_with(token: str, *args: str) -> Any:
    return CliRunner().invoke(cli.app, [*args, "--url", URL, "--token", token])


def test_tokens_revoke_refusals_are_one_line(client_api: Api) -> None:
    unknown = invoke(client_api, "tokens", "revoke", "999")
    assert unknown.exit_code == 1
    assert unknown.output.strip() == "error: no token '999' at this node (give its id or key id)"
    # a secret given instead of an id is refused without being echoed
    secret = client_api.tokens[Role.OPERATOR]
    r = invoke(client_api, "tokens", "revoke", secret)
    assert r.exit_code == 1 and secret not in r.output and "not its secret" in r.output
    # the last live admin token stays
    admin_id = next(
        line.split()[1]
        for line in invoke(client_api, "tokens", "list").output.splitlines()
        if "admin-token" in line
    )
    last = invoke(client_api, "tokens", "revoke", admin_id)
    assert last.exit_code == 1
    assert last.output.strip() == "error: cannot revoke the last live admin token"
    # an operator may not manage tokens
    r = invoke(client_api, "tokens", "create", "--name", "x", "--role", "admin", role=Role.OPERATOR)
    assert r.exit_code == 1 and r.output.startswith("error: forbidden")
    bad_role = invoke(client_api, "tokens", "create", "--name", "x", "--role", "root")
    assert bad_role.exit_code == 2


def test_status_reads_the_runs_with_the_standard_library(client_api: Api, tmp_path: Path) -> None:
    from org_node.cli import _local_runs

    _propose(client_api, tmp_path)
    run_id = client_api.client.get("/v1/runs", headers=client_api.h()).json()["data"][0]["id"]
    lines = _local_runs(tmp_path / "node" / "fedweave.db")
    assert lines == [f"r1 ({run_id[:8]}): proposed, round 0"]
    assert _local_runs(tmp_path / "none.db") == []
    (tmp_path / "bad.db").write_bytes(b"not a database, at all, no")
    assert _local_runs(tmp_path / "bad.db")[0].startswith("(cannot read the runs from bad.db: ")


def test_runs_show_says_whose_message_a_round_under_way_waits_for(
    client_api: Api, tmp_path: Path
) -> None:
    """A run under way: ``runs show`` names the round, its stage and the orgs whose
    message it waits for, since when; while this org trains, it says that instead."""
    from org_node.services import RunActivity

    run_id = _propose(client_api, tmp_path)
    assert invoke(client_api, "runs", "accept", "r1").exit_code == 0
    assert invoke(client_api, "runs", "start", "r1").exit_code == 0
    client_api.node.activity = RunActivity(
        3, "aggregating", 1_800_000_000.0, stage="share", attempt=2, orgs=("org-c",)
    )
    r = invoke(client_api, "runs", "show", run_id[:8], role=Role.AUDITOR)
    assert r.exit_code == 0, r.output
    assert (
        "waiting for: round 3 (attempt 2): secure sum, share, waiting for org-c, "
        "since 2027-01-15 08:00:00 UTC" in r.output
    )
    client_api.node.activity = RunActivity(3, "training", 1_800_000_000.0)
    r = invoke(client_api, "runs", "show", "r1", role=Role.AUDITOR)
    assert "now: round 3: training on this org's data, since 2027-01-15" in r.output
    r = invoke(client_api, "runs", "list")
    assert "round 3: training on this org's data" in r.output


def test_finding_1_runs_show_says_a_round_waits_for_a_quorum(
    client_api: Api, tmp_path: Path
) -> None:
    """A round without a quorum: ``runs show`` says so, whom it misses, how many
    attempts failed and when the next one starts; the spec's quorum wait is shown, and
    ``runs propose --quorum-wait`` sets it (a wait out of range is refused)."""
    from org_node.services import RunActivity

    run_id = _propose(client_api, tmp_path)
    assert invoke(client_api, "runs", "accept", "r1").exit_code == 0
    assert invoke(client_api, "runs", "start", "r1").exit_code == 0
    client_api.node.activity = RunActivity(
        2,
        "quorum",
        1_800_000_000.0,
        attempt=4,
        orgs=("org-b",),
        failures=3,
        threshold=2,
        next_attempt=1_800_000_090.0,
        deadline=1_800_003_600.0,
    )
    r = invoke(client_api, "runs", "show", run_id[:8], role=Role.AUDITOR)
    assert r.exit_code == 0, r.output
    assert (
        "waiting for: round 2: waiting for a quorum of 2 (3 attempts failed; missing org-b), "
        "attempt 4 at 08:01:30 UTC; the run fails if none by 2027-01-15 09:00:00 UTC, "
        "since 2027-01-15 08:00:00 UTC" in r.output
    )
    assert "quorum wait: a round waits up to 3600 s for a quorum" in r.output
    base = ["runs", "propose", "--trainer", "tabular", "--rounds", "2"]
    base += ["--participant", "org-a", "--participant", "org-b"]
    r = invoke(client_api, *base, "--name", "waits", "--quorum-wait", "120")
    assert r.exit_code == 0, r.output
    shown = invoke(client_api, "runs", "show", "waits", role=Role.AUDITOR)
    assert "quorum wait: a round waits up to 120 s for a quorum" in shown.output
    r = invoke(client_api, *base, "--name", "never", "--quorum-wait", "0")
    assert r.exit_code == 1 and "quorum_wait_s" in r.output


def test_audit_verify_from_peers_catches_a_log_cut_short(client_api: Api, tmp_path: Path) -> None:
    """``audit verify --from-peers`` asks the node for the heads of its log that its peers
    hold: the whole log agrees with them and says how many entries follow the last; the
    log cut before that head fails, naming the entries removed."""
    from coordinator_free.wire import Envelope

    from org_node.audit import EgressLog
    from tests.api.conftest import ORG, identity

    log_path = tmp_path / "egress.jsonl"
    log = EgressLog(identity(ORG), log_path)
    for seq in range(1, 6):
        env = Envelope("fed", "r", 1, "ready", "round.ready", ORG, "org-b", seq, 0.0, b"k" * 40)
        log(env, env.to_wire())
        if seq == 3:
            client_api.node.held_heads = [log.sign_head("r", 1)]
    log.close()
    r = invoke(client_api, "audit", "verify", str(log_path), "--from-peers")
    assert r.exit_code == 0, r.output
    assert "agrees with 1 head(s) held by peers, the last at entry 2 (2 entries after it)" in (
        r.output
    )
    lines = log_path.read_bytes().splitlines(keepends=True)
    entries = [i for i, line in enumerate(lines) if b'"type":"entry"' in line]
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(lines[: entries[2]]))  # entries 0 and 1 only
    r = invoke(client_api, "audit", "verify", str(cut), "--from-peers")
    assert r.exit_code == 1
    assert "entries 2..2 were removed" in r.output


def test_runs_propose_sets_a_compression_and_show_prints_it(client_api: Api) -> None:
    """``runs propose --compression`` stores the canonical form, ``runs show`` prints it;
    a compression the spec refuses (with an epsilon) fails with the reason."""
    base = ["runs", "propose", "--trainer", "tabular", "--rounds", "2"]
    base += ["--participant", "org-a", "--participant", "org-b"]
    r = invoke(client_api, *base, "--name", "small", "--compression", "q8,random-k=0.1")
    assert r.exit_code == 0, r.output
    shown = invoke(client_api, "runs", "show", "small", role=Role.AUDITOR)
    assert "compression: random-k=0.1,q8" in shown.output
    r = invoke(client_api, *base, "--name", "dp", "--compression", "q8", "--epsilon", "2")
    assert r.exit_code == 1 and "epsilon" in r.output
    r = invoke(client_api, *base, "--name", "bad", "--compression", "top-k=0.1")
    assert r.exit_code == 1 and "random-k" in r.output
