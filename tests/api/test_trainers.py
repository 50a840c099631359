"""``/v1/trainers`` and consent: an org runs only trainers its admin installed, pinned by
their code hash; a run spec names a trainer and never code, and nothing is imported
when an org consents; a run that needs data binds one of the org's own datasets."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import Session

from org_node.db.models import Role, Run
from org_node.trainers.code import code_hash
from tests.api.conftest import ORG, RUN_SPEC, Api, propose_run

CLIENT_APP = """\
from flwr.client import ClientApp, NumPyClient
import numpy as np


class Tiny(NumPyClient):
    def get_parameters(self, config):
        return [np.zeros(2)]

    def fit(self, parameters, config):
        return [p + 1 for p in parameters], 4, {}


def client_fn(context):
    return Tiny().to_client()


app = ClientApp(client_fn=client_fn)
"""


def _install(api: Api, name: str, ref: str, role: Role = Role.ADMIN, **extra: Any) -> Any:
    body = {"name": name, "kind": "flower-clientapp", "ref": ref, **extra}
    return api.client.post("/v1/trainers", json=body, headers=api.h(role))


@pytest.fixture
def app_file(tmp_path: Path) -> Path:
    code = tmp_path / "app"
    code.mkdir()
    (code / "client.py").write_text(CLIENT_APP)
    return code / "client.py"


def test_bundled_trainers_are_always_installed(api: Api) -> None:
    body = api.client.get("/v1/trainers", headers=api.h(Role.AUDITOR)).json()
    bundled = {t["name"]: t for t in body["data"] if t["source"] == "bundled"}
    assert set(bundled) == {"tabular", "breast_cancer", "digits", "gpt"}
    assert bundled["digits"]["sha256"] == code_hash("bundled", "digits")
    one = api.client.get("/v1/trainers/gpt", headers=api.h()).json()
    assert one["kind"] == "bundled" and len(one["sha256"]) == 64


def test_an_admin_installs_a_trainer_and_its_hash_is_fixed(api: Api, app_file: Path) -> None:
    assert _install(api, "tiny", str(app_file), Role.OPERATOR).status_code == 403
    assert _install(api, "tiny", str(app_file), Role.AUDITOR).status_code == 403
    r = _install(api, "tiny", str(app_file), description="a test app")
    assert r.status_code == 201, r.text
    assert r.json()["sha256"] == code_hash("flower-clientapp", str(app_file))
    assert r.json()["source"] == "api" and r.json()["installed_by"] == "admin-token"
    assert _install(api, "tiny", str(app_file)).status_code == 409
    assert _install(api, "digits", str(app_file)).status_code == 409
    names = [t["name"] for t in api.client.get("/v1/trainers", headers=api.h()).json()["data"]]
    assert "tiny" in names


def test_install_refuses_code_that_does_not_import_or_hashes_otherwise(
    api: Api, app_file: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "client.py").write_text("import no_such_module_here\n")
    r = _install(api, "broken", str(broken / "client.py"))
    assert r.status_code == 422 and "ModuleNotFoundError" in r.json()["detail"]
    assert "\n" not in r.json()["detail"]
    r = _install(api, "pinned", str(app_file), sha256="0" * 64)
    assert r.status_code == 422 and "hashes to" in r.json()["detail"]
    r = _install(api, "nowhere", str(tmp_path / "missing.py"))
    assert r.status_code == 422 and "not a Python file" in r.json()["detail"]
    names = {t["name"] for t in api.client.get("/v1/trainers", headers=api.h()).json()["data"]}
    assert not names & {"broken", "pinned", "nowhere"}


def test_remove_refuses_bundled_trainers_and_trainers_in_use(api: Api, app_file: Path) -> None:
    assert api.client.delete("/v1/trainers/digits", headers=api.h()).status_code == 409
    assert _install(api, "tiny", str(app_file)).status_code == 201
    assert api.client.delete("/v1/trainers/tiny", headers=api.h(Role.OPERATOR)).status_code == 403
    run = propose_run(api, trainer="tiny", epsilon=None)
    assert api.client.post(f"/v1/runs/{run['id']}/accept", headers=api.h()).status_code == 200
    r = api.client.delete("/v1/trainers/tiny", headers=api.h())
    assert r.status_code == 409 and "uses trainer 'tiny'" in r.json()["detail"]
    assert api.client.post(f"/v1/runs/{run['id']}/abort", headers=api.h()).status_code == 200
    assert api.client.delete("/v1/trainers/tiny", headers=api.h()).status_code == 204
    assert api.client.get("/v1/trainers/tiny", headers=api.h()).status_code == 404


@pytest.mark.parametrize("trainer", ["os:abort", "signal:pause", "_thread:interrupt_main", "a b"])
def test_a_spec_naming_code_is_refused_at_the_door(api: Api, trainer: str) -> None:
    r = api.client.post(
        "/v1/runs", json={"name": "x", "spec": RUN_SPEC | {"trainer": trainer}}, headers=api.h()
    )
    assert r.status_code == 422


def _stored_run(api: Api, trainer: str) -> str:
    """A run row as if relayed with a spec that named code (bypassing the API's check)."""
    run_id = uuid.uuid4().hex
    with Session(api.engine) as session:
        session.add(
            Run(
                id=run_id,
                name="relayed",
                spec=RUN_SPEC | {"trainer": trainer, "epsilon": None},
                proposed_by="peer",
            )
        )
        session.commit()
    return run_id


@pytest.mark.parametrize("trainer", ["os:abort", "signal:pause", "fw_never_imported"])
def test_consent_to_a_spec_naming_code_imports_nothing(
    api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, trainer: str
) -> None:
    # a module on the path that would leave a mark if anything imported it
    mark = tmp_path / "imported"
    (tmp_path / "fw_never_imported.py").write_text(f"open({str(mark)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    run_id = _stored_run(api, trainer)
    started = time.monotonic()
    r = api.client.post(f"/v1/runs/{run_id}/accept", headers=api.h())
    assert r.status_code in (409, 422), r.text
    assert time.monotonic() - started < 30  # answered, not hung in the trainer's code
    assert not mark.exists() and "fw_never_imported" not in sys.modules
    assert {
        m for m in set(sys.modules) - before if m.startswith(("fw_", "org_node.tasks."))
    } == set()
    with Session(api.engine) as session:
        row = session.get(Run, run_id)
        assert row is not None and row.state == "proposed"
    # the database is still writable: the accept left no lock behind
    assert propose_run(api)["state"] == "proposed"


def test_consent_refuses_a_missing_trainer_naming_it(api: Api) -> None:
    run = propose_run(api, trainer="hospital-model")
    r = api.client.post(f"/v1/runs/{run['id']}/accept", headers=api.h())
    assert r.status_code == 409
    assert "no trainer named 'hospital-model'" in r.json()["detail"]


def test_consent_checks_the_pinned_hash(api: Api) -> None:
    good = code_hash("bundled", "breast_cancer")
    run = propose_run(api, trainer_hash="f" * 64)
    r = api.client.post(f"/v1/runs/{run['id']}/accept", headers=api.h())
    assert r.status_code == 409 and "pins ffffffffffff" in r.json()["detail"]
    pinned = api.client.post(
        "/v1/runs", json={"name": "p", "spec": RUN_SPEC | {"trainer_hash": good}}, headers=api.h()
    ).json()
    r = api.client.post(f"/v1/runs/{pinned['id']}/accept", headers=api.h())
    assert r.status_code == 200 and r.json()["trainer_hash"] == good


DATA = {"kind": "table", "columns": {"age": "number", "diagnosis": "str"}}


def _dataset(api: Api, name: str, text: str) -> dict[str, Any]:
    (api.data_root / f"{name}.csv").write_text(text)
    r = api.client.post("/v1/datasets", json={"name": name, "path": f"{name}.csv"}, headers=api.h())
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


def test_consent_binds_a_dataset_that_fits_the_spec(api: Api) -> None:
    ok = _dataset(api, "wards", "age,diagnosis,extra\n61,benign,1\n70,malignant,2\n")
    _dataset(api, "labs", "age,result\n1,2\n")
    run = propose_run(api, trainer="tabular", data=DATA, epsilon=None)
    r = api.client.post(f"/v1/runs/{run['id']}/accept", headers=api.h())
    assert r.status_code == 409 and "datasets that fit: wards" in r.json()["detail"]
    r = api.client.post(f"/v1/runs/{run['id']}/accept", json={"dataset": "nope"}, headers=api.h())
    assert r.status_code == 409 and "no dataset named 'nope'" in r.json()["detail"]
    r = api.client.post(f"/v1/runs/{run['id']}/accept", json={"dataset": "labs"}, headers=api.h())
    assert r.status_code == 409 and "column 'diagnosis' (str) is missing" in r.json()["detail"]
    r = api.client.post(f"/v1/runs/{run['id']}/accept", json={"dataset": "wards"}, headers=api.h())
    assert r.status_code == 200, r.text
    row = r.json()
    assert (row["dataset_name"], row["dataset_id"], row["dataset_rows"]) == ("wards", ok["id"], 2)
    assert row["dataset_hash"] == ok["content_hash"]
    assert row["trainer_hash"] == code_hash("bundled", "tabular")


def test_a_bound_dataset_stays_what_it_was(api: Api) -> None:
    ds = _dataset(api, "wards", "age,diagnosis\n61,benign\n")
    run = propose_run(api, trainer="tabular", data=DATA, epsilon=None)
    body = {"dataset": "wards"}
    assert api.client.post(f"/v1/runs/{run['id']}/accept", json=body, headers=api.h()).is_success
    (api.data_root / "wards.csv").write_text("age,diagnosis\n99,malignant\n")
    url = f"/v1/datasets/{ds['id']}"
    r = api.client.patch(url, json={"version": 1, "rehash": True}, headers=api.h())
    assert r.status_code == 409 and "changed on disk" in r.json()["detail"]
    assert api.client.get(url, headers=api.h()).json()["content_hash"] == ds["content_hash"]
    r = api.client.delete(url, headers=api.h())
    assert r.status_code == 409 and "bound to run 'r1'" in r.json()["detail"]
    assert api.client.post(f"/v1/runs/{run['id']}/abort", headers=api.h()).is_success
    assert api.client.delete(url, headers=api.h()).status_code == 204


def test_a_dataset_is_given_only_when_accepting_a_run_that_needs_one(api: Api) -> None:
    _dataset(api, "wards", "age,diagnosis\n61,benign\n")
    run = propose_run(api, epsilon=None)
    r = api.client.post(f"/v1/runs/{run['id']}/accept", json={"dataset": "wards"}, headers=api.h())
    assert r.status_code == 409 and "needs no data" in r.json()["detail"]
    r = api.client.post(f"/v1/runs/{run['id']}/decline", json={"dataset": "wards"}, headers=api.h())
    assert r.status_code == 409


def test_the_org_of_the_api_is_named(api: Api) -> None:
    assert ORG  # the fixture's org, used by RUN_SPEC's participants
