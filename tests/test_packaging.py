"""The distribution ships every package and the data files the code reads."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_name(init: Path) -> str:
    rel = init.parent.relative_to(REPO)
    dirs = {v: k for k, v in CONFIG["package-dir"].items()}
    top = dirs.get(rel.parts[0], rel.parts[0])
    return ".".join((top, *rel.parts[1:]))


def test_every_package_is_listed() -> None:
    roots = list(CONFIG["package-dir"].values())
    found = {
        _package_name(init)
        for root in roots
        for init in (REPO / root).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert found == set(CONFIG["packages"])


def test_data_files_are_declared() -> None:
    declared = CONFIG["package-data"]["org_node"]
    data = [
        p
        for p in (REPO / "org_node").rglob("*")
        if p.is_file()
        and p.suffix not in {".py", ".pyc"}
        and p.name != "py.typed"
        and "__pycache__" not in p.parts
    ]
    assert data, "org_node ships data files"
    for path in data:
        rel = path.relative_to(REPO / "org_node")
        assert any(rel.match(pattern) for pattern in declared), f"{rel} is not in package-data"
