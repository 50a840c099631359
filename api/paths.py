"""Dataset paths confined to the configured roots, and their content hash.

:func:`confine` resolves a client-given path (absolute, or relative to a root) with
every symlink followed and accepts it only if the real path lies under the real path
of a configured root: ``..`` and symlinks that point outside are refused alike.
:func:`content_hash` hashes a file, or a directory tree in a canonical order; a symlink
inside the tree that points outside the roots is refused too.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["PathRefused", "confine", "content_hash"]

_CHUNK = 1 << 20


class PathRefused(ValueError):
    """A dataset path outside the roots, missing, or unreadable (message says which)."""


def _real_roots(roots: Sequence[Path]) -> list[Path]:
    return [Path(os.path.realpath(r)) for r in roots]


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == r or path.is_relative_to(r) for r in roots)


def confine(raw: str, roots: Sequence[Path]) -> Path:
    """The real path of ``raw`` if it exists under one of ``roots``; else PathRefused."""
    if not roots:
        raise PathRefused("no dataset roots are configured on this node")
    if "\x00" in raw or not raw.strip():
        raise PathRefused("invalid path")
    real_roots = _real_roots(roots)
    given = Path(raw)
    candidates = [given] if given.is_absolute() else [r / given for r in roots]
    for candidate in candidates:
        try:
            real = Path(os.path.realpath(candidate, strict=True))
        except (OSError, RuntimeError):
            continue
        if not _inside(real, real_roots):
            raise PathRefused("path is outside the configured dataset roots")
        if not (real.is_file() or real.is_dir()):
            raise PathRefused("path is neither a regular file nor a directory")
        return real
    raise PathRefused("no such file or directory under the dataset roots")


def _hash_file(path: Path, h: hashlib._Hash) -> None:
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)


def content_hash(path: Path, roots: Sequence[Path]) -> str:
    """SHA-256 of a file's bytes, or of a directory tree.

    For a directory: for every regular file in sorted relative-path order, the UTF-8
    relative path, a NUL, the file's SHA-256 (hex) and a newline are hashed.
    """
    real_roots = _real_roots(roots)
    try:
        if path.is_file():
            h = hashlib.sha256()
            _hash_file(path, h)
            return h.hexdigest()
        outer = hashlib.sha256()
        files: list[tuple[str, Path]] = []
        for dirpath, _dirs, names in os.walk(path, followlinks=False):
            for name in names:
                p = Path(dirpath) / name
                real = Path(os.path.realpath(p))
                if not _inside(real, real_roots):
                    raise PathRefused(f"{p.relative_to(path)} links outside the dataset roots")
                if real.is_file():
                    files.append((p.relative_to(path).as_posix(), real))
        for rel, real in sorted(files):
            h = hashlib.sha256()
            _hash_file(real, h)
            outer.update(rel.encode("utf-8") + b"\x00" + h.hexdigest().encode() + b"\n")
        return outer.hexdigest()
    except OSError as exc:
        raise PathRefused(f"cannot read the dataset: {exc.strerror or 'I/O error'}") from None
