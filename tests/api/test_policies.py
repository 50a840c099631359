"""``/v1/policies`` and :mod:`org_node.policy`: CRUD, the violation check, and optimistic
concurrency (two admins updating one policy: one wins, one gets 409)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlmodel import Session

from org_node.db.models import PolicyRecord, Role
from org_node.db.repo import update_versioned
from org_node.policy import Policy, PolicyError, RunSpec, check_run_against_policy
from tests.api.conftest import RUN_SPEC, Api

SPEC = RunSpec.from_dict(RUN_SPEC)


def _create(api: Api, **fields: Any) -> dict[str, Any]:
    r = api.client.post("/v1/policies", json={"name": "p1"} | fields, headers=api.h())
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


def test_create_read_list_delete(api: Api) -> None:
    p = _create(api, min_participants=3, required_backend="masked", allowed_trainers=["tabular"])
    assert p["version"] == 1 and p["enabled"] is True and p["max_epsilon"] is None
    url = f"/v1/policies/{p['id']}"
    assert api.client.get(url, headers=api.h(Role.AUDITOR)).json() == p
    assert api.client.get("/v1/policies", headers=api.h()).json()["count"] == 1
    assert api.client.post("/v1/policies", json={"name": "p1"}, headers=api.h()).status_code == 409
    assert api.client.delete(url, headers=api.h(Role.OPERATOR)).status_code == 403
    assert api.client.delete(url, headers=api.h()).status_code == 204
    assert api.client.get(url, headers=api.h()).status_code == 404


def test_check_endpoint_lists_violations(api: Api) -> None:
    _create(api, max_epsilon=1.0, min_threshold=3)
    r = api.client.post("/v1/policies/check", json=RUN_SPEC, headers=api.h(Role.AUDITOR)).json()
    assert r["allowed"] is False
    assert {v["requirement"] for v in r["violations"]} == {"max_epsilon", "min_threshold"}
    ok = api.client.post(
        "/v1/policies/check", json=RUN_SPEC | {"epsilon": 0.5, "threshold": 3}, headers=api.h()
    ).json()
    assert ok == {"allowed": True, "violations": []}


def test_disabled_policy_is_not_enforced(api: Api) -> None:
    p = _create(api, max_epsilon=1.0)
    r = api.client.patch(
        f"/v1/policies/{p['id']}", json={"version": 1, "enabled": False}, headers=api.h()
    )
    assert r.status_code == 200 and r.json()["enabled"] is False and r.json()["version"] == 2
    check = api.client.post("/v1/policies/check", json=RUN_SPEC, headers=api.h()).json()
    assert check["allowed"] is True


def test_stale_update_is_409_and_changes_nothing(api: Api) -> None:
    p = _create(api)
    url = f"/v1/policies/{p['id']}"
    assert (
        api.client.patch(url, json={"version": 1, "max_epsilon": 2}, headers=api.h()).status_code
        == 200
    )
    r = api.client.patch(url, json={"version": 1, "max_epsilon": 9}, headers=api.h())
    assert r.status_code == 409 and "version is 2" in r.json()["detail"]
    assert api.client.get(url, headers=api.h()).json()["max_epsilon"] == 2


def test_two_admins_racing_one_wins(api: Api) -> None:
    p = _create(api)
    url = f"/v1/policies/{p['id']}"
    barrier = threading.Barrier(2)
    codes: list[int] = []

    def admin(eps: float) -> None:
        barrier.wait()
        r = api.client.patch(url, json={"version": 1, "max_epsilon": eps}, headers=api.h())
        codes.append(r.status_code)

    threads = [threading.Thread(target=admin, args=(e,)) for e in (1.0, 2.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(codes) == [200, 409]
    final = api.client.get(url, headers=api.h()).json()
    assert final["version"] == 2 and final["max_epsilon"] in (1.0, 2.0)


def test_versioned_update_is_atomic_across_sessions(api: Api) -> None:
    p = _create(api)
    with Session(api.engine) as a, Session(api.engine) as b:
        assert update_versioned(a, PolicyRecord, p["id"], 1, {"min_participants": 4})
        a.commit()
        assert not update_versioned(b, PolicyRecord, p["id"], 1, {"min_participants": 5})
        b.rollback()
    assert (
        api.client.get(f"/v1/policies/{p['id']}", headers=api.h()).json()["min_participants"] == 4
    )


@pytest.mark.parametrize(
    "body",
    [
        {"name": "x", "max_epsilon": 0},
        {"name": "x", "required_backend": "plain"},
        {"name": "x", "min_participants": 0},
        {"name": "x", "allowed_peers": ["a", "a"]},
        {"name": "bad name!"},
        {"name": "x", "max_epsilon": "NaN"},
    ],
)
def test_invalid_policies_are_422(api: Api, body: dict[str, Any]) -> None:
    assert api.client.post("/v1/policies", json=body, headers=api.h()).status_code == 422
    assert api.client.get("/v1/policies", headers=api.h()).json()["count"] == 0


def test_check_run_against_policy() -> None:
    assert check_run_against_policy(SPEC, Policy()) == []
    strict = Policy(
        min_participants=5,
        required_backend="ckks",
        min_threshold=3,
        max_epsilon=1.0,
        allowed_trainers=("digits",),
        allowed_peers=("org-a", "org-b"),
    )
    found = {v.requirement: v.message for v in check_run_against_policy(SPEC, strict)}
    assert set(found) == {
        "min_participants",
        "required_backend",
        "min_threshold",
        "max_epsilon",
        "allowed_trainers",
        "allowed_peers",
    }
    assert "org-c" in found["allowed_peers"]
    no_dp = RunSpec.from_dict(RUN_SPEC | {"epsilon": None})
    assert [v.requirement for v in check_run_against_policy(no_dp, Policy(max_epsilon=8))] == [
        "max_epsilon"
    ]


@pytest.mark.parametrize(
    ("values", "match"),
    [
        (RUN_SPEC | {"extra": 1}, "unknown"),
        (RUN_SPEC | {"threshold": 4}, "threshold"),
        (RUN_SPEC | {"rounds": True}, "rounds"),
        (RUN_SPEC | {"epsilon": float("inf")}, "epsilon"),
        ({"trainer": "t"}, "incomplete"),
    ],
)
def test_run_spec_rejects(values: dict[str, Any], match: str) -> None:
    with pytest.raises(PolicyError, match=match):
        RunSpec.from_dict(values)


def test_policy_rejects() -> None:
    with pytest.raises(PolicyError, match="unknown"):
        Policy.from_dict({"max_eps": 1})
    with pytest.raises(PolicyError, match="required_backend"):
        Policy(required_backend="rot13")
