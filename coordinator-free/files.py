"""Files that hold an org's secrets or state: written all-or-nothing, read only when private.

:func:`atomic_write` replaces a file whole (temporary file, fsync, rename, fsync of the
directory), so a reader never sees half of it; :func:`require_private` refuses a file
that group or others may access. The standard library only: any module, however light,
may import this one.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "require_private"]


def atomic_write(path: Path, data: bytes | bytearray | memoryview, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` all-or-nothing: temporary file, fsync, rename, fsync dir."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def require_private(path: Path, error: Callable[[str], Exception]) -> None:
    """Raise ``error(reason)`` when group or others may access ``path`` (``OSError``
    when it cannot be looked at)."""
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise error(
            f"{path.name} is accessible by group or others "
            f"(mode {stat.S_IMODE(mode):o}); chmod 600 it"
        )
