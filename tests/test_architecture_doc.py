"""docs/ARCHITECTURE.md's map of modules matches the tree: every module of the four
layers is named under its package, and nothing named there is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("secure_agg", "coordinator-free", "org_node", "api")


def tree() -> set[str]:
    return {
        str(p.relative_to(ROOT))
        for layer in LAYERS
        for p in (ROOT / layer).rglob("*.py")
        if "migrations/versions" not in str(p) and "__pycache__" not in p.parts
    }


def mapped() -> set[str]:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text[text.index("## Map of modules") :]
    found: set[str] = set()
    package = ""
    for line in section.splitlines():
        heading = re.fullmatch(r"\*\*`([^`]+)/`\*\*", line.strip())
        if heading:
            package = heading.group(1)
            continue
        row = re.match(r"\| `([^`]+\.py)` \|", line)
        if row and package:
            found.add(f"{package}/{row.group(1)}")
    return found


def test_the_map_names_every_module_and_only_modules_that_exist() -> None:
    in_tree, in_map = tree(), mapped()
    assert in_tree - in_map == set(), "modules the map does not name"
    assert in_map - in_tree == set(), "modules the map names that are gone"


def test_the_checker_sees_the_map() -> None:
    assert len(mapped()) > 150  # the section parses; it is not vacuously equal
