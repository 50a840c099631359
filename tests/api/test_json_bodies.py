"""Finding 6 (issue 20): a JSON body holding ``NaN``, ``Infinity`` or ``1e999`` is
answered 422 with a message, never 500, and nothing is stored."""

from __future__ import annotations

import json

import pytest

from api.jsonbody import NonFiniteNumber, check_finite_json
from tests.api.conftest import RUN_SPEC, Api

_BAD = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]


@pytest.mark.parametrize("bad", _BAD)
def test_finding_6_non_finite_json_numbers_are_answered_422(api: Api, bad: str) -> None:
    spec = json.dumps(RUN_SPEC).replace('"epsilon": 4.0', f'"epsilon": {bad}')
    assert bad in spec
    body = '{"name": "r1", "spec": ' + spec + "}"
    headers = api.h() | {"Content-Type": "application/json"}
    r = api.client.post("/v1/runs", content=body, headers=headers)
    assert r.status_code == 422, r.text
    assert "not a JSON number" in r.json()["detail"] or "out of range" in r.json()["detail"]
    assert "r1" not in api.client.get("/v1/runs", headers=api.h()).text  # nothing stored


@pytest.mark.parametrize("bad", _BAD)
def test_finding_6_non_finite_numbers_without_a_content_type_too(api: Api, bad: str) -> None:
    """FastAPI parses a body with no content type as JSON: it is checked the same way."""
    spec = json.dumps(RUN_SPEC).replace('"epsilon": 4.0', f'"epsilon": {bad}')
    body = ('{"name": "r2", "spec": ' + spec + "}").encode()
    r = api.client.post("/v1/runs", content=body, headers=api.h())
    assert "content-type" not in {k.lower() for k in r.request.headers}
    assert r.status_code == 422, r.text
    assert "r2" not in api.client.get("/v1/runs", headers=api.h()).text


def test_finite_bodies_and_broken_json_are_left_to_the_routes(api: Api) -> None:
    r = api.client.post(
        "/v1/runs",
        content=json.dumps({"name": "r1", "spec": RUN_SPEC | {"epsilon": 2.5e0}}),
        headers=api.h() | {"Content-Type": "application/json"},
    )
    assert r.status_code == 201, r.text
    broken = api.client.post(
        "/v1/tokens", content=b'{"name": ', headers=api.h() | {"Content-Type": "application/json"}
    )
    assert broken.status_code == 422 and "detail" in broken.json()


def test_check_finite_json() -> None:
    check_finite_json(b'{"a": [1, 2.5, -3e10, "NaN"]}')
    check_finite_json(b"not json")
    for bad in _BAD:
        with pytest.raises(NonFiniteNumber):
            check_finite_json(f'{{"a": [{bad}]}}'.encode())
