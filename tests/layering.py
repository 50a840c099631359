"""The layering rule of fedweave, checked over source files with ``ast``.

``secure_agg <- coordinator_free <- org_node <- api``: a layer imports only layers to
its left. ``secure_agg`` also imports nothing that does I/O over the network or pulls
in a heavy framework. Used by ``tests/test_layering.py`` on the repository and on
deliberately broken trees; ``make test`` also runs import-linter on the same rules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# package -> its directory in the repository
LAYER_DIRS: dict[str, str] = {
    "secure_agg": "secure_agg",
    "coordinator_free": "coordinator-free",
    "org_node": "org_node",
    "api": "api",
}
ORDER = ["secure_agg", "coordinator_free", "org_node", "api"]

# third-party or stdlib modules a layer must never import (top-level names)
FORBIDDEN: dict[str, set[str]] = {
    "secure_agg": {
        "torch",
        "fastapi",
        "starlette",
        "httpx",
        "uvicorn",
        "requests",
        "sqlmodel",
        "sqlalchemy",
        "asyncio",
        "socket",
        "ssl",
        "http",
        "urllib",
        "aiohttp",
        "grpc",
        "flwr",
    },
    "coordinator_free": {"torch"},
    "org_node": set(),
    "api": set(),
}


@dataclass(frozen=True)
class Violation:
    path: Path
    line: int
    layer: str
    imported: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.layer} imports {self.imported} ({self.reason})"


def _imports(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def check_tree(root: Path) -> list[Violation]:
    """Every layering violation under ``root`` (a repository checkout)."""
    found: list[Violation] = []
    for layer, directory in LAYER_DIRS.items():
        base = root / directory
        if not base.is_dir():
            continue
        higher = set(ORDER[ORDER.index(layer) + 1 :])
        for path in sorted(base.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for line, name in _imports(tree):
                top = name.split(".")[0]
                if top in higher:
                    found.append(Violation(path, line, layer, name, f"{top} is a higher layer"))
                elif top in FORBIDDEN[layer]:
                    found.append(Violation(path, line, layer, name, f"{layer} must not use {top}"))
    return found
