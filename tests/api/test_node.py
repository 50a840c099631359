"""Node, health, metrics, federation, peers and checkpoints routes; settings and the
transport-level guards (body size, CORS)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from api.settings import Settings
from org_node.db.models import Role
from tests.api.conftest import ORG, Api, make_api, member


def test_node_identity_and_health(api: Api) -> None:
    r = api.client.get("/v1/node", headers=api.h(Role.AUDITOR)).json()
    assert r["org_id"] == ORG and len(r["fingerprint"]) == 64 and r["ready"] is True
    assert api.client.get("/healthz").json()["ready"] is True
    ready = api.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"]["database"] == "ok"
    api.node.ready = False
    ready = api.client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["engine"] == "down"


def test_metrics_are_prometheus_text(api: Api) -> None:
    assert api.client.get("/metrics").status_code == 401
    r = api.client.get("/metrics", headers=api.h(Role.AUDITOR))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    lines = r.text.splitlines()
    assert "# TYPE fedweave_runs gauge" in lines
    assert 'fedweave_peers{status="alive"} 1' in lines
    assert any(line.startswith('fedweave_http_requests_total{class="4xx"}') for line in lines)


def test_peers_live_view(api: Api) -> None:
    r = api.client.get("/v1/peers", headers=api.h(Role.OPERATOR)).json()
    assert r["count"] == 1
    assert r["data"][0] == {
        "org_id": "org-b",
        "status": "alive",
        "incarnation": 3,
        "last_seen_s_ago": None,
        "latency_ms": pytest.approx(4.0),
    }


def test_federation_manifest_members_and_proposals(api: Api) -> None:
    m = api.client.get("/v1/federation/manifest", headers=api.h(Role.AUDITOR)).json()
    assert m["version"] == 0 and m["signers"] == [ORG, "org-b", "org-c"]
    members = api.client.get("/v1/federation/members", headers=api.h()).json()
    assert [x["org_id"] for x in members["data"]] == [ORG, "org-b", "org-c"]
    new = member("org-d", 9004)
    body = {
        "action": "add",
        "member": {
            "org_id": new.org_id,
            "display_name": new.display_name,
            "endpoint": new.endpoint,
            "certificate_pem": new.certificate_pem,
            "fingerprint": new.fingerprint,
            "public_key": new.public_key.hex(),
        },
        "note": "welcome",
    }
    assert (
        api.client.post(
            "/v1/federation/proposals", json=body, headers=api.h(Role.OPERATOR)
        ).status_code
        == 403
    )
    r = api.client.post("/v1/federation/proposals", json=body, headers=api.h())
    assert r.status_code == 201 and r.json()["signers"] == [ORG] and r.json()["version"] == 1
    forged = body | {"member": body["member"] | {"fingerprint": "0" * 64}}  # type: ignore[operator]
    assert (
        api.client.post("/v1/federation/proposals", json=forged, headers=api.h()).status_code == 422
    )
    rm = api.client.post(
        "/v1/federation/proposals", json={"action": "remove", "org_id": "org-b"}, headers=api.h()
    ).json()
    assert rm["signers"] == []
    signed = api.client.post(f"/v1/federation/proposals/{rm['digest']}/signature", headers=api.h())
    assert signed.status_code == 200 and signed.json()["signers"] == [ORG]
    listed = api.client.get("/v1/federation/proposals", headers=api.h()).json()
    assert listed["count"] == 2
    missing = api.client.post(f"/v1/federation/proposals/{'f' * 64}/signature", headers=api.h())
    assert missing.status_code == 404
    bad = api.client.post(
        "/v1/federation/proposals", json={"action": "remove", "org_id": "org-z"}, headers=api.h()
    )
    assert bad.status_code == 422 and "not a member" in bad.json()["detail"]


def test_checkpoints(api: Api) -> None:
    listed = api.client.get("/v1/checkpoints", headers=api.h(Role.AUDITOR)).json()
    assert listed["count"] == 1 and listed["data"][0]["checkpoint_id"] == "ck-1"
    v = api.client.post("/v1/checkpoints/ck-1/verify", headers=api.h(Role.OPERATOR)).json()
    assert v["restorable"] is True and v["missing"] == ["org-c"]
    assert api.client.post("/v1/checkpoints/ck-2/verify", headers=api.h()).status_code == 404
    assert (
        api.client.post("/v1/checkpoints/ck-1/restore", headers=api.h(Role.OPERATOR)).status_code
        == 403
    )
    assert api.client.post("/v1/checkpoints/ck-1/restore", headers=api.h()).json()["round"] == 4


def test_oversized_bodies_are_413(api: Api) -> None:
    limit = api.app.state.settings.max_request_bytes
    big = b'{"name":"' + b"a" * limit + b'","role":"admin"}'
    r = api.client.post(
        "/v1/tokens", content=big, headers=api.h(Role.ADMIN, **{"Content-Type": "application/json"})
    )
    assert r.status_code == 413 and "larger than" in r.json()["detail"]

    def chunks() -> object:
        yield b'{"name":"'
        yield b"a" * limit
        yield b'"}'

    r = api.client.post("/v1/tokens", content=chunks(), headers=api.h())
    assert r.status_code == 413


def test_cors_is_off_by_default(api: Api) -> None:
    r = api.client.options(
        "/v1/runs",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "GET"},
    )
    assert "access-control-allow-origin" not in r.headers


def test_cors_when_configured(tmp_path: Path) -> None:
    for a in make_api(tmp_path, cors_origins=("https://ops.example",)):
        r = a.client.get("/healthz", headers={"Origin": "https://ops.example"})
        assert r.headers["access-control-allow-origin"] == "https://ops.example"


def test_settings_refuse_unsafe_values(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="not loopback"):
        Settings(admin_host="0.0.0.0")
    assert Settings(admin_host="0.0.0.0", allow_remote_admin=True).admin_host == "0.0.0.0"
    assert Settings(admin_host="::1").admin_host == "::1"
    with pytest.raises(ValidationError, match="absolute"):
        Settings(dataset_roots=(Path("relative"),))
    with pytest.raises(ValidationError, match="wildcard"):
        Settings(cors_origins=("*",))
    with pytest.raises(ValidationError):
        Settings(surprise=1)  # type: ignore[call-arg]
    s = Settings(data_dir=tmp_path)
    assert s.resolved_database_url == f"sqlite:///{tmp_path.resolve()}/fedweave.db"


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDWEAVE_DATABASE_URL", "postgresql://u@127.0.0.1/db")
    monkeypatch.setenv("FEDWEAVE_DATASET_ROOTS", '["/srv/data"]')
    s = Settings()
    assert s.resolved_database_url == "postgresql://u@127.0.0.1/db"
    assert s.dataset_roots == (Path("/srv/data"),)


def test_unexpected_errors_are_opaque_and_log_no_secrets(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> object:
        raise RuntimeError(f"engine exploded near {api.tokens[Role.ADMIN]}")

    api.node.health = broken  # type: ignore[method-assign,assignment]
    client = TestClient(api.app, raise_server_exceptions=False)
    with caplog.at_level(logging.DEBUG):
        r = client.get("/v1/node", headers=api.h())
    assert r.status_code == 500 and r.json() == {"detail": "internal error"}
    assert "RuntimeError" in caplog.text
    for secret in api.tokens.values():
        assert secret not in caplog.text and secret not in r.text
