"""What a crash leaves behind, removed when the node starts: temporary files and plaintext work files.

An atomic write (:func:`coordinator_free.files.atomic_write`: ``.NAME.PID.HEX.tmp``,
shards included as ``.N.shard.PID.HEX.tmp``) or a report write (``NAME.tmp``) cut short
by a kill leaves its temporary file; a local worker killed mid-round leaves its request
directories (``req-N``: the global model in, the update out) and its round directories
(``round-N``: the local model's training checkpoints). None of them is read again, and
every one holds plaintext this org's model or its peers' shards: :func:`clean_leftovers`
removes them before the node does anything else. Only the node's own directories are
searched (identity, federation, audit, shards, runs, and the data directory's top level);
a dataset root is never entered.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

from org_node.config import NodePaths

__all__ = ["WORKER_DIR", "clean_leftovers", "worker_leftovers"]

logger = logging.getLogger(__name__)

WORKER_DIR = "worker"
"""A run's local-worker directory under ``runs/<key>/`` (:mod:`org_node.trainers.channel`)."""

_WORK_PREFIXES = ("req-", "round-")


def worker_leftovers(directory: Path) -> list[Path]:
    """A worker directory's request and round directories and the temporary files of its
    channel (``.NAME.XXXX``), which only a worker at work uses."""
    if not directory.is_dir():
        return []
    return sorted(
        p
        for p in directory.iterdir()
        if (p.is_dir() and p.name.startswith(_WORK_PREFIXES))
        or (p.is_file() and p.name.startswith("."))
    )


def _temporary_files(top: Path, skip: Sequence[Path]) -> Iterable[Path]:
    for dirpath, dirnames, filenames in os.walk(top):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if (here / d).resolve() not in skip]
        for name in filenames:
            if name.endswith(".tmp"):
                yield here / name


def clean_leftovers(paths: NodePaths, dataset_roots: Sequence[str | Path] = ()) -> int:
    """Remove the temporary files and worker leftovers under ``paths`` (see the module
    docstring); the number of files and directories removed. Blocking: the node runs it
    in a worker thread."""
    skip = [Path(r).resolve() for r in (*dataset_roots, paths.datasets)]
    removed = 0
    found: list[Path] = [
        p for p in paths.root.glob("*.tmp") if p.is_file()
    ]  # the top level only: a dataset root may live beside the node's files
    for sub in ("identity", "federation", "audit", "shards", "runs"):
        top = paths.root / sub
        if top.is_dir() and top.resolve() not in skip:
            found.extend(_temporary_files(top, skip))
    if paths.runs.is_dir():
        for run_dir in paths.runs.iterdir():
            found.extend(worker_leftovers(run_dir / WORKER_DIR))
    for path in found:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed += 1
        except FileNotFoundError:
            continue
        except OSError as exc:
            logger.warning("cannot remove the leftover %s: %s", path, exc.strerror)
    if removed:
        logger.info("removed %d leftover temporary or work files", removed)
    return removed
