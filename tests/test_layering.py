"""The layering rule holds for the repository, and the checker catches violations."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.layering import LAYER_DIRS, check_tree

REPO = Path(__file__).resolve().parents[1]


def test_repository_respects_layers() -> None:
    violations = check_tree(REPO)
    assert violations == [], "\n".join(map(str, violations))


def _tree(tmp_path: Path, layer: str, source: str) -> Path:
    for directory in LAYER_DIRS.values():
        (tmp_path / directory).mkdir(exist_ok=True)
        (tmp_path / directory / "__init__.py").write_text("")
    (tmp_path / LAYER_DIRS[layer] / "bad.py").write_text(textwrap.dedent(source))
    return tmp_path


@pytest.mark.parametrize(
    ("layer", "source", "imported"),
    [
        ("secure_agg", "from coordinator_free import transport\n", "coordinator_free"),
        ("secure_agg", "import torch\n", "torch"),
        ("secure_agg", "import asyncio\n", "asyncio"),
        ("secure_agg", "def f():\n    import httpx\n", "httpx"),
        ("coordinator_free", "from org_node.cli import app\n", "org_node.cli"),
        ("coordinator_free", "import torch.distributed as dist\n", "torch.distributed"),
        ("org_node", "from api import app\n", "api"),
        ("secure_agg", "import api.routes\n", "api.routes"),
    ],
)
def test_violation_is_caught(tmp_path: Path, layer: str, source: str, imported: str) -> None:
    violations = check_tree(_tree(tmp_path, layer, source))
    assert [(v.layer, v.imported) for v in violations] == [(layer, imported)]


@pytest.mark.parametrize(
    ("layer", "source"),
    [
        ("api", "from org_node import cli\nfrom coordinator_free import x\nimport secure_agg\n"),
        ("org_node", "import torch\nfrom coordinator_free import x\n"),
        ("coordinator_free", "from secure_agg import codec\nimport asyncio\n"),
        ("secure_agg", "from secure_agg import codec\nimport numpy\n"),
        ("secure_agg", "from . import codec\n"),
    ],
)
def test_allowed_imports_pass(tmp_path: Path, layer: str, source: str) -> None:
    assert check_tree(_tree(tmp_path, layer, source)) == []
