"""``/v1/datasets``: registration under the roots only, content hashes, versioned updates."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.paths import PathRefused, confine, content_hash
from org_node.db.models import Role
from tests.api.conftest import Api

COLUMNS = {"age": "int", "label": "int"}
CSV = b"age,label\n1,0\n"


def _register(
    api: Api, path: str, name: str = "ds", role: Role = Role.OPERATOR, **extra: object
) -> dict[str, object]:
    r = api.client.post(
        "/v1/datasets", json={"name": name, "path": path, **extra}, headers=api.h(role)
    )
    return {"status": r.status_code, **r.json()}


def test_register_a_file_and_read_it_back(api: Api) -> None:
    (api.data_root / "a.csv").write_bytes(CSV)
    got = _register(api, "a.csv")
    assert got["status"] == 201
    assert got["content_hash"] == hashlib.sha256(CSV).hexdigest()
    assert got["path"] == str((api.data_root / "a.csv").resolve())
    one = api.client.get(f"/v1/datasets/{got['id']}", headers=api.h(Role.AUDITOR)).json()
    assert one["columns"] == COLUMNS and one["version"] == 1
    assert (one["kind"], one["row_count"]) == ("table", 1)
    assert api.client.get("/v1/datasets", headers=api.h()).json()["count"] == 1


def test_a_table_schema_is_read_from_the_file_and_checked_when_given(api: Api) -> None:
    (api.data_root / "t.csv").write_bytes(b"x,y,name\n1,2.5,a\n3,4,b\n")
    got = _register(api, "t.csv", columns={"x": "int", "y": "float", "name": "str"})
    assert got["status"] == 201 and got["row_count"] == 2
    wrong = _register(api, "t.csv", name="t2", columns={"x": "str", "y": "float", "name": "str"})
    assert wrong["status"] == 422 and "do not match the file" in str(wrong["detail"])
    rows = _register(api, "t.csv", name="t3", row_count=9)
    assert rows["status"] == 422 and "has 2 rows" in str(rows["detail"])
    bad = api.data_root / "bad.csv"
    bad.write_bytes(b"a,b\n1\n")
    short = _register(api, "bad.csv", name="bad")
    assert short["status"] == 422 and "row 1 has 1 fields" in str(short["detail"])
    assert api.client.get("/v1/datasets", headers=api.h()).json()["count"] == 1


def test_kinds_of_directories(api: Api) -> None:
    images = api.data_root / "imgs"
    for label in ("cat", "dog"):
        (images / label).mkdir(parents=True)
        (images / label / "1.png").write_bytes(b"png")
    got = _register(api, "imgs")
    assert (got["status"], got["kind"], got["row_count"]) == (201, "image-folder", 2)
    (api.data_root / "misc").mkdir()
    (api.data_root / "misc" / "notes.txt").write_text("n")
    other = _register(api, "misc", name="misc")
    assert (other["status"], other["kind"]) == (201, "files")
    refused = _register(api, "misc", name="misc2", kind="image-folder")
    assert refused["status"] == 422 and "not 'image-folder'" in str(refused["detail"])


def test_directory_hash_is_order_independent_and_content_sensitive(api: Api) -> None:
    d = api.data_root / "dir"
    (d / "sub").mkdir(parents=True)
    (d / "x").write_bytes(b"1")
    (d / "sub" / "y").write_bytes(b"2")
    h1 = content_hash(confine("dir", [api.data_root]), [api.data_root])
    (d / "sub" / "y").write_bytes(b"3")
    h2 = content_hash(confine("dir", [api.data_root]), [api.data_root])
    assert h1 != h2 and len(h1) == 64


@pytest.mark.parametrize(
    "path",
    ["../outside.csv", "/etc/passwd", "sub/../../outside.csv", "missing.csv", "link.csv", "a\x00b"],
)
def test_paths_outside_the_roots_are_refused(api: Api, path: str) -> None:
    outside = api.data_root.parent / "outside.csv"
    outside.write_text("secret")
    (api.data_root / "sub").mkdir(exist_ok=True)
    os.symlink(outside, api.data_root / "link.csv")
    got = _register(api, path)
    assert got["status"] == 422, got
    assert api.client.get("/v1/datasets", headers=api.h()).json()["count"] == 0


def test_symlink_inside_a_directory_may_not_escape(api: Api) -> None:
    outside = api.data_root.parent / "secret.txt"
    outside.write_text("s")
    d = api.data_root / "d"
    d.mkdir()
    os.symlink(outside, d / "leak")
    got = _register(api, "d")
    assert got["status"] == 422 and "outside" in str(got["detail"])


def test_confine_without_roots() -> None:
    with pytest.raises(PathRefused, match="no dataset roots"):
        confine("/tmp", [])


def test_duplicate_name_and_versioned_update(api: Api) -> None:
    f = api.data_root / "a.csv"
    f.write_bytes(CSV)
    first = _register(api, "a.csv")
    assert _register(api, "a.csv")["status"] == 409
    f.write_bytes(b"age,label,extra\n1,0,x\n2,1,y\n")
    url = f"/v1/datasets/{first['id']}"
    r = api.client.patch(url, json={"version": 1, "rehash": True}, headers=api.h())
    assert r.status_code == 200
    assert r.json()["version"] == 2 and r.json()["row_count"] == 2
    assert r.json()["columns"] == COLUMNS | {"extra": "str"}
    assert r.json()["content_hash"] == hashlib.sha256(f.read_bytes()).hexdigest()
    stale = api.client.patch(url, json={"version": 1, "description": "d"}, headers=api.h())
    assert stale.status_code == 409 and "version is 2" in stale.json()["detail"]
    assert api.client.get(url, headers=api.h()).json()["description"] == ""


def test_unregister(api: Api) -> None:
    (api.data_root / "a.csv").write_bytes(b"x")
    got = _register(api, "a.csv")
    url = f"/v1/datasets/{got['id']}"
    assert api.client.delete(url, headers=api.h(Role.AUDITOR)).status_code == 403
    assert api.client.delete(url, headers=api.h()).status_code == 204
    assert api.client.get(url, headers=api.h()).status_code == 404
    assert (api.data_root / "a.csv").exists()


def test_idempotent_registration(api: Api) -> None:
    (api.data_root / "a.csv").write_bytes(b"x")
    body = {"name": "ds", "path": "a.csv", "columns": {"x": "str"}, "row_count": 0}
    h = api.h(Role.ADMIN, **{"Idempotency-Key": "same"})
    a = api.client.post("/v1/datasets", json=body, headers=h)
    b = api.client.post("/v1/datasets", json=body, headers=h)
    assert a.status_code == b.status_code == 201 and a.json() == b.json()


_SEGMENTS = st.sampled_from(["..", ".", "a", "b", "up", "loop", "a.csv", "outside", ""])


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(_SEGMENTS, min_size=1, max_size=6), absolute=st.booleans())
def test_confine_never_escapes_the_root(
    tree: tuple[Path, Path], parts: list[str], absolute: bool
) -> None:
    root, outside = tree
    for escape in ("up/outside/a.csv", "../outside/a", "loop/../../outside"):
        with pytest.raises(PathRefused, match="outside the configured"):
            confine(escape, [root])
    raw = "/".join(parts)
    if absolute:
        raw = str(root / raw)
    try:
        real = confine(raw, [root])
    except PathRefused:
        return
    assert real == root.resolve() or real.is_relative_to(root.resolve())
    assert not real.is_relative_to(outside.resolve())


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """root/{a/a.csv, b/, up -> .., loop -> root/a} next to outside/a.csv."""
    base = tmp_path_factory.mktemp("confine")
    root, outside = base / "root", base / "outside"
    for d in (root / "a", root / "b", outside / "a"):
        d.mkdir(parents=True)
    (root / "a" / "a.csv").write_text("in")
    (outside / "a" / "a.csv").write_text("out")
    (outside / "a.csv").write_text("out")
    os.symlink("..", root / "up")
    os.symlink(root / "a", root / "loop")
    return root, outside


def test_finding_6_registration_outside_the_roots_is_no_existence_oracle(
    api: Api, tmp_path: Path
) -> None:
    """A path outside the dataset roots gets the same answer whether it exists or not
    (before: "outside the configured dataset roots" for an existing one, "no such file"
    for a missing one), absolute or relative (``..``), file or directory."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "secret.csv").write_bytes(CSV)
    rel = os.path.relpath(outside, api.data_root)
    pairs = [
        (str(outside / "secret.csv"), str(outside / "missing.csv")),
        (str(outside), str(tmp_path / "no-such-dir")),
        (f"{rel}/secret.csv", f"{rel}/missing.csv"),
        ("/etc/passwd", "/etc/no-such-file-here"),
    ]
    for existing, missing in pairs:
        a = _register(api, existing, name="a")
        b = _register(api, missing, name="b")
        assert a["status"] == b["status"] == 422
        assert a["detail"] == b["detail"] == "path is outside the configured dataset roots"
    inside_missing = _register(api, "missing.csv", name="c")
    assert inside_missing["status"] == 422 and "no such file" in str(inside_missing["detail"])
