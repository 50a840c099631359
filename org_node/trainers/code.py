"""Where a trainer's code lives, its content hash, and (in the worker only) loading it.

A trainer reference is ``module:attr`` (a module of the node's Python environment),
``path/to/file.py:attr``, or for a Flower App a directory holding its
``pyproject.toml``. :func:`code_root` finds the code **without executing any of it**
(``importlib.machinery.PathFinder`` only reads directories); :func:`code_hash` hashes
it: a module inside a package hashes the whole top-level package, a lone module its
file, a ``.py`` file the directory that holds it (its sibling modules are part of the
app), a Flower App its directory. Hidden entries, ``__pycache__`` and ``*.pyc`` are left
out; a tree larger than :data:`MAX_CODE_BYTES` is refused.

:func:`load_object` imports the code; only the worker process calls it, after checking
the hash against the one fixed when the trainer was installed.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "MAX_CODE_BYTES",
    "MAX_CODE_FILES",
    "CodeError",
    "FlowerAppConfig",
    "bundled_module_file",
    "code_hash",
    "code_root",
    "load_object",
    "read_flower_app",
    "split_ref",
]

MAX_CODE_BYTES = 256 << 20
MAX_CODE_FILES = 20_000
_CHUNK = 1 << 20


class CodeError(ValueError):
    """A trainer reference that names no code, or code that cannot be read (one line)."""


def split_ref(ref: str, default_attr: str | None = None) -> tuple[str, str]:
    """``(target, attr)`` of ``target:attr``; ``default_attr`` when there is no ``:attr``.

    ``target`` is a dotted module name or a path ending in ``.py``.
    """
    if not isinstance(ref, str) or not ref.strip() or "\x00" in ref:
        raise CodeError(f"{ref!r} is not a trainer reference")
    target, sep, attr = ref.rpartition(":")
    if not sep or (len(target) == 1 and target.isalpha()):  # no ':' (or a drive letter)
        target, attr = ref, ""
    attr = attr or (default_attr or "")
    if not target or not attr:
        raise CodeError(f"{ref!r} is not of the form 'module:attr' or 'file.py:attr'")
    if not attr.replace("_", "a").replace(".", "a").isalnum():
        raise CodeError(f"{attr!r} in {ref!r} is not an attribute name")
    return target, attr


def _is_path(target: str) -> bool:
    return target.endswith(".py") or os.sep in target or target.startswith(".")


def _module_spec(name: str) -> importlib.machinery.ModuleSpec:
    """Find a module's spec by reading directories only: no package ``__init__`` runs."""
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        raise CodeError(f"{name!r} is not a module name")
    search: list[str] | None = None
    spec: importlib.machinery.ModuleSpec | None = None
    for i in range(len(parts)):
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[: i + 1]), search)
        if spec is None:
            raise CodeError(f"no module {'.'.join(parts[: i + 1])!r} in this node's Python")
        locations = spec.submodule_search_locations
        if i < len(parts) - 1 and locations is None:
            raise CodeError(f"{'.'.join(parts[: i + 1])!r} is a module, not a package")
        search = list(locations) if locations is not None else None
    assert spec is not None
    return spec


def _top_level_root(name: str) -> Path:
    top = _module_spec(name.split(".")[0])
    if top.submodule_search_locations:
        return Path(next(iter(top.submodule_search_locations)))
    if top.origin is None or not Path(top.origin).is_file():
        raise CodeError(f"module {name!r} has no source file to hash (a built-in module?)")
    return Path(top.origin)


def bundled_module_file(name: str) -> Path:
    """The source file of bundled task ``name`` (``org_node/tasks/<name>.py``)."""
    return Path(__file__).resolve().parent.parent / "tasks" / f"{name}.py"


def code_root(kind: str, ref: str) -> Path:
    """The file or directory whose content is the trainer's code (nothing is imported)."""
    if kind == "bundled":
        path = bundled_module_file(ref)
        if not path.is_file():
            raise CodeError(f"no bundled task {ref!r}")
        return path
    if kind == "flower-app":
        root = Path(ref).expanduser()
        if not (root / "pyproject.toml").is_file():
            raise CodeError(f"{ref} is not a Flower App directory: it has no pyproject.toml")
        return root.resolve()
    target, _attr = split_ref(ref, "app" if kind == "flower-clientapp" else None)
    if _is_path(target):
        path = Path(target).expanduser()
        if path.suffix != ".py" or not path.is_file():
            raise CodeError(f"{target} is not a Python file")
        return path.resolve().parent
    return _top_level_root(target)


def _files(root: Path) -> list[tuple[str, Path]]:
    if root.is_file():
        return [(root.name, root)]
    out: list[tuple[str, Path]] = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
        for name in names:
            if name.startswith(".") or name.endswith(".pyc"):
                continue
            path = Path(dirpath) / name
            if path.is_file():
                out.append((path.relative_to(root).as_posix(), path))
            if len(out) > MAX_CODE_FILES:
                raise CodeError(
                    f"{root} holds more than {MAX_CODE_FILES} files: put the trainer's code "
                    "in a directory of its own"
                )
    return sorted(out)


def code_hash(kind: str, ref: str) -> str:
    """SHA-256 of the trainer's code (see the module docstring); CodeError if unreadable."""
    root = code_root(kind, ref)
    outer = hashlib.sha256(f"fedweave/trainer/v1\x00{kind}\x00".encode())
    total = 0
    try:
        for rel, path in _files(root):
            h = hashlib.sha256()
            with path.open("rb") as f:
                while chunk := f.read(_CHUNK):
                    total += len(chunk)
                    if total > MAX_CODE_BYTES:
                        raise CodeError(
                            f"the code under {root} exceeds {MAX_CODE_BYTES >> 20} MiB: put the "
                            "trainer's code in a directory of its own"
                        )
                    h.update(chunk)
            outer.update(rel.encode("utf-8") + b"\x00" + h.hexdigest().encode() + b"\n")
    except OSError as exc:
        raise CodeError(f"cannot read the code under {root}: {exc.strerror}") from None
    return outer.hexdigest()


@dataclass(frozen=True)
class FlowerAppConfig:
    """What a Flower App's ``pyproject.toml`` says: its components and default config."""

    root: Path
    clientapp: str
    serverapp: str | None = None
    config: Mapping[str, Any] = field(default_factory=dict)


def read_flower_app(root: Path) -> FlowerAppConfig:
    """Parse ``[tool.flwr.app.components]`` and ``[tool.flwr.app.config]``."""
    path = Path(root) / "pyproject.toml"
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CodeError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise CodeError(f"{path} is not valid TOML: {exc}") from None
    app = doc.get("tool", {}).get("flwr", {}).get("app", {})
    components = app.get("components", {})
    client = components.get("clientapp")
    if not isinstance(client, str) or not client:
        raise CodeError(f"{path} names no [tool.flwr.app.components] clientapp")
    server = components.get("serverapp")
    config = app.get("config", {})
    if not isinstance(config, Mapping):
        raise CodeError(f"{path}: [tool.flwr.app.config] must be a table")
    flat = _flatten(config)
    return FlowerAppConfig(Path(root).resolve(), client, server if server else None, flat)


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested TOML tables as Flower flattens them (``a.b = 1``)."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out |= _flatten(value, f"{name}.")
        else:
            out[name] = value
    return out


def _import_file(path: Path) -> Any:
    """Import ``path`` as a top-level module named after its stem, its directory first
    on ``sys.path`` so that its sibling modules import as they do under Flower."""
    directory = str(path.parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise CodeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def load_object(ref: str, default_attr: str | None = None, *, app_root: Path | None = None) -> Any:
    """Import ``module:attr`` or ``file.py:attr`` and return the attribute (worker only).

    ``app_root`` (a Flower App directory) goes first on ``sys.path``, as ``flwr run``
    does. The code's own exceptions propagate; a missing attribute is a CodeError.
    """
    target, attr = split_ref(ref, default_attr)
    if app_root is not None and str(app_root) not in sys.path:
        sys.path.insert(0, str(app_root))
    if _is_path(target):
        path = Path(target).expanduser()
        if app_root is not None and not path.is_absolute():
            path = app_root / path
        module = _import_file(path.resolve())
    else:
        module = importlib.import_module(target)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CodeError(f"{target} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
