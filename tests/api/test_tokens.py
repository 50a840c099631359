"""``/v1/tokens`` and authentication: hashed storage, one opaque 401, revocation, the
failed-attempt limiter, first-run set-up."""

from __future__ import annotations

import itertools
from pathlib import Path

from sqlmodel import Session, select

from api.security import AuthFailureLimiter
from org_node.db.engine import make_engine
from org_node.db.models import ApiToken, Role
from org_node.db.repo import TOKEN_PATTERN, find_token, hash_token, init_database
from tests.api.conftest import Api


def test_create_shows_secret_once_and_stores_only_its_hash(api: Api) -> None:
    r = api.client.post("/v1/tokens", json={"name": "ci", "role": "operator"}, headers=api.h())
    assert r.status_code == 201
    body = r.json()
    secret = body["token"]
    assert TOKEN_PATTERN.fullmatch(secret)
    with Session(api.engine) as s:
        row = s.get(ApiToken, body["id"])
        assert row is not None
        assert row.token_hash == hash_token(secret) and secret not in row.model_dump_json()
    listed = api.client.get("/v1/tokens", headers=api.h()).json()
    assert listed["count"] == 4
    assert all("token" not in t and "token_hash" not in t for t in listed["data"])
    assert (
        api.client.get("/v1/node", headers={"Authorization": f"Bearer {secret}"}).status_code == 200
    )


def test_every_authentication_failure_is_the_same_401(api: Api) -> None:
    good = api.tokens[Role.ADMIN]
    wrong_secret = good[:-1] + ("A" if good[-1] != "A" else "B")
    answers = []
    for header in (
        None,
        "",
        "Bearer",
        "Basic dXNlcjpwYXNz",
        "Bearer nonsense",
        f"Bearer {wrong_secret}",
        "Bearer fw_000000000000_" + "a" * 43,
    ):
        headers = {} if header is None else {"Authorization": header}
        r = api.client.get("/v1/runs", headers=headers)
        answers.append((r.status_code, r.json(), r.headers.get("www-authenticate")))
    assert set(map(str, answers)) == {
        str((401, {"detail": "invalid or missing credentials"}, "Bearer"))
    }


def test_revoked_token_stops_working(api: Api) -> None:
    created = api.client.post(
        "/v1/tokens", json={"name": "tmp", "role": "auditor"}, headers=api.h()
    ).json()
    auth = {"Authorization": f"Bearer {created['token']}"}
    assert api.client.get("/v1/runs", headers=auth).status_code == 200
    r = api.client.delete(f"/v1/tokens/{created['id']}", headers=api.h())
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    assert api.client.get("/v1/runs", headers=auth).status_code == 401
    assert api.client.delete(f"/v1/tokens/{created['id']}", headers=api.h()).status_code == 409
    assert api.client.delete("/v1/tokens/99999", headers=api.h()).status_code == 404


def test_last_admin_token_cannot_be_revoked(api: Api) -> None:
    tokens = api.client.get("/v1/tokens", headers=api.h()).json()["data"]
    admin = next(t for t in tokens if t["role"] == "admin")
    r = api.client.delete(f"/v1/tokens/{admin['id']}", headers=api.h())
    assert r.status_code == 409 and "last live admin" in r.json()["detail"]


def test_idempotent_creation_never_repeats_the_secret(api: Api) -> None:
    h = api.h(Role.ADMIN, **{"Idempotency-Key": "k1"})
    first = api.client.post("/v1/tokens", json={"name": "a", "role": "auditor"}, headers=h)
    again = api.client.post("/v1/tokens", json={"name": "a", "role": "auditor"}, headers=h)
    assert first.status_code == 201 and again.status_code == 409
    assert first.json()["token"] not in again.text
    assert api.client.get("/v1/tokens", headers=api.h()).json()["count"] == 4


def test_bad_token_requests(api: Api) -> None:
    bodies: list[object] = [
        {"name": "", "role": "admin"},
        {"name": "x", "role": "root"},
        {"name": "x"},
        [],
    ]
    for body in bodies:
        assert api.client.post("/v1/tokens", json=body, headers=api.h()).status_code == 422
    assert api.client.delete("/v1/tokens/abc", headers=api.h()).status_code == 422


def test_failed_attempts_are_rate_limited_then_forgiven(api: Api) -> None:
    limit = api.app.state.auth_limiter.limit
    bad = {"Authorization": "Bearer x"}
    for _ in range(limit):
        assert api.client.get("/v1/runs", headers=bad).status_code == 401
    r = api.client.get("/v1/runs", headers=bad)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert api.client.get("/v1/runs").status_code == 429  # no credential at all, same address
    api.clock.now += api.app.state.auth_limiter.window_s + 1
    assert api.client.get("/v1/runs", headers=bad).status_code == 401


def test_finding_6_bad_requests_cannot_lock_the_real_token_out(api: Api) -> None:
    """Any local process shares the admin's address: its failures get 429, but the valid
    admin token, looked at first, is still admitted (before: 429 for a minute)."""
    limit = api.app.state.auth_limiter.limit
    for _ in range(limit + 5):
        api.client.get("/v1/runs", headers={"Authorization": "Bearer guess"})
    assert api.client.get("/v1/runs", headers={"Authorization": "Bearer guess"}).status_code == 429
    assert api.client.get("/v1/runs", headers=api.h()).status_code == 200
    assert api.client.get("/v1/tokens", headers=api.h(Role.ADMIN)).status_code == 200
    assert api.client.get("/v1/runs", headers=api.h(Role.AUDITOR)).status_code == 200


def test_limiter_window() -> None:
    t = [0.0]
    lim = AuthFailureLimiter(2, 10.0, clock=lambda: t[0])
    lim.failure("a")
    assert lim.retry_after("a") == 0
    lim.failure("a")
    assert lim.retry_after("a") == 10.0 and lim.retry_after("b") == 0
    t[0] = 10.5
    assert lim.retry_after("a") == 0


def test_init_database_creates_one_admin_token_once(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'n.db'}")
    counter = itertools.count()
    secret = init_database(engine, randbytes=lambda n: bytes([next(counter) % 256] * n))
    assert secret is not None and TOKEN_PATTERN.fullmatch(secret)
    assert secret.startswith("fw_000000000000_")
    assert init_database(engine) is None
    with Session(engine) as s:
        rows = s.exec(select(ApiToken)).all()
        assert [(r.role, r.name) for r in rows] == [("admin", "initial-admin")]
        assert find_token(s, secret) is not None
        assert find_token(s, secret + "x") is None
    engine.dispose()
