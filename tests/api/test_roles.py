"""Role checks for every route: a token of each role either passes the role check or
gets 403; no token gets 401; every route under /v1 and /metrics declares its roles."""

from __future__ import annotations

import re

import pytest
from fastapi.routing import APIRoute

from api.app import ROUTERS
from org_node.db.models import Role
from tests.api.conftest import Api

PUBLIC = {"/healthz", "/readyz"}

EXPECTED: dict[tuple[str, str], set[Role]] = {
    ("GET", "/v1/node"): set(Role),
    ("GET", "/metrics"): set(Role),
    ("POST", "/v1/tokens"): {Role.ADMIN},
    ("GET", "/v1/tokens"): {Role.ADMIN},
    ("DELETE", "/v1/tokens/{token_id}"): {Role.ADMIN},
    ("POST", "/v1/policies"): {Role.ADMIN},
    ("PATCH", "/v1/policies/{policy_id}"): {Role.ADMIN},
    ("DELETE", "/v1/policies/{policy_id}"): {Role.ADMIN},
    ("GET", "/v1/policies"): set(Role),
    ("POST", "/v1/datasets"): {Role.ADMIN, Role.OPERATOR},
    ("POST", "/v1/runs"): {Role.ADMIN, Role.OPERATOR},
    ("POST", "/v1/runs/{run_id}/start"): {Role.ADMIN, Role.OPERATOR},
    ("GET", "/v1/runs/{run_id}"): set(Role),
    ("POST", "/v1/federation/proposals"): {Role.ADMIN},
    ("POST", "/v1/checkpoints/{checkpoint_id}/restore"): {Role.ADMIN},
    ("POST", "/v1/checkpoints/{checkpoint_id}/verify"): {Role.ADMIN, Role.OPERATOR},
    ("GET", "/v1/audit/events"): {Role.ADMIN, Role.AUDITOR},
    ("GET", "/v1/audit/report"): {Role.ADMIN, Role.AUDITOR},
}


def _admitted(route: APIRoute) -> set[Role] | None:
    for dep in route.dependencies:
        admitted = getattr(dep.dependency, "admitted", None)
        if admitted is not None:
            return set(admitted)
    return None


def _routes(api: Api) -> list[tuple[str, str, set[Role] | None]]:
    out = []
    for router in ROUTERS:
        for route in router.routes:
            assert isinstance(route, APIRoute)
            for method in sorted(route.methods or ()):
                out.append((method, route.path, _admitted(route)))
    operations = {
        (method.upper(), path)
        for path, item in api.app.openapi()["paths"].items()
        for method in item
    }
    assert {(m, p) for m, p, _ in out} == operations
    return out


def _url(path: str) -> str:
    return re.sub(r"\{digest\}", "f" * 64, re.sub(r"\{[a-z_]+\}", "9999", path))


def test_every_route_declares_roles(api: Api) -> None:
    routes = _routes(api)
    assert len(routes) >= 35
    for method, path, admitted in routes:
        if path in PUBLIC:
            assert admitted is None
        else:
            assert admitted, f"{method} {path} declares no roles"
    table = {(m, p): a for m, p, a in routes}
    for key, roles in EXPECTED.items():
        assert table[key] == roles, key


def test_roles_are_enforced_on_every_route(api: Api) -> None:
    for method, path, admitted in _routes(api):
        if admitted is None:
            continue
        url = _url(path)
        anonymous = api.client.request(method, url)
        assert anonymous.status_code == 401, (method, path)
        api.clock.now += api.app.state.auth_limiter.window_s  # forget the failure
        for role in Role:
            r = api.client.request(method, url, headers=api.h(role))
            if role in admitted:
                assert r.status_code not in (401, 403), (method, path, role, r.text)
            else:
                assert r.status_code == 403, (method, path, role)
                assert role.value in r.json()["detail"]


@pytest.mark.parametrize("role", list(Role))
def test_public_routes_need_no_token(api: Api, role: Role) -> None:
    for path in PUBLIC:
        assert api.client.get(path).status_code == 200
        assert api.client.get(path, headers=api.h(role)).status_code == 200
