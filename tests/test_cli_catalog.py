"""``fedweave trainers`` and ``fedweave datasets`` against the real admin API app, in
process; and ``runs propose --data-like`` / ``runs accept --dataset``."""

from __future__ import annotations

from pathlib import Path

from org_node.cli_catalog import guess_kind
from org_node.db.models import Role
from org_node.trainers.code import code_hash
from tests.api.conftest import Api
from tests.test_cli_client import client_api, invoke, migrated_sqlite

__all__ = ["client_api", "migrated_sqlite"]

APP = """\
from flwr.client import ClientApp, NumPyClient


class C(NumPyClient):
    pass


app = ClientApp(client_fn=lambda context: C().to_client())
"""


def test_guess_kind_from_the_reference(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "pyproject.toml").write_text("")
    assert guess_kind(str(tmp_path / "app")) == ("flower-app", str((tmp_path / "app").resolve()))
    assert guess_kind(f"{tmp_path}/c.py:client") == ("flower-clientapp", f"{tmp_path}/c.py:client")
    assert guess_kind("mypkg.tasks:task") == ("task", "mypkg.tasks:task")


def test_trainers_install_list_show_remove(client_api: Api, tmp_path: Path) -> None:
    app = tmp_path / "code" / "client.py"
    app.parent.mkdir()
    app.write_text(APP)
    r = invoke(client_api, "trainers", "install", "mine", str(app), role=Role.OPERATOR)
    assert r.exit_code == 1 and "forbidden" in r.output
    r = invoke(client_api, "trainers", "install", "mine", str(app))
    assert r.exit_code == 0, r.output
    digest = code_hash("flower-clientapp", str(app))
    assert f"installed trainer mine (flower-clientapp): sha256 {digest}" in r.output
    r = invoke(client_api, "trainers", "list", role=Role.AUDITOR)
    assert r.exit_code == 0 and "breast_cancer" in r.output and "mine" in r.output
    r = invoke(client_api, "trainers", "show", "mine")
    assert r.exit_code == 0 and f"sha256: {digest}" in r.output
    r = invoke(client_api, "trainers", "install", "again", str(tmp_path / "missing"))
    assert (
        r.exit_code == 1
        and r.output.strip() == f"error: no such file or directory: {tmp_path}/missing"
    )
    assert invoke(client_api, "trainers", "remove", "mine").exit_code == 0
    r = invoke(client_api, "trainers", "show", "mine")
    assert r.exit_code == 1 and "not found" in r.output


def test_datasets_register_show_and_bind_at_consent(client_api: Api) -> None:
    (client_api.data_root / "wards.csv").write_text("age,weight,diagnosis\n61,70.5,benign\n")
    r = invoke(client_api, "datasets", "register", "wards", str(client_api.data_root / "wards.csv"))
    assert r.exit_code == 0, r.output
    assert "registered dataset wards (table, 1 rows)" in r.output
    assert "columns: age:int, weight:float, diagnosis:str" in r.output
    r = invoke(client_api, "datasets", "show", "wards", role=Role.AUDITOR)
    assert r.exit_code == 0 and "  age: int" in r.output
    args = ["--trainer", "tabular", "--rounds", "2", "--participant", "org-a"]
    args += ["--participant", "org-b", "--data-like", "wards", "--config", "target=diagnosis"]
    r = invoke(client_api, "runs", "propose", "--name", "d1", *args)
    assert r.exit_code == 0, r.output
    spec = client_api.client.get("/v1/runs", headers=client_api.h()).json()["data"][0]["spec"]
    assert spec["data"]["columns"] == {"age": "number", "weight": "number", "diagnosis": "str"}
    r = invoke(client_api, "runs", "accept", "d1")
    assert r.exit_code == 1 and "datasets that fit: wards" in r.output
    r = invoke(client_api, "runs", "accept", "d1", "--dataset", "wards")
    assert r.exit_code == 0, r.output
    assert "bound dataset wards (1 rows)" in r.output
    r = invoke(client_api, "datasets", "remove", "wards")
    assert r.exit_code == 1 and "bound to run 'd1'" in r.output
    r = invoke(client_api, "datasets", "rehash", "wards")
    assert r.exit_code == 0 and "content unchanged" in r.output
