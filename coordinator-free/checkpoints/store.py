"""The on-disk store of the shards an org holds for others.

Layout: ``root/<owner hex>/<set hex>/<version>/{manifest.json, <index>.shard}``. Ids
become hex path components, so no id can escape the root. Every file is written
atomically (temporary file, fsync, rename). Shard bytes are checked against the
manifest on the way in; the manifest's signature is checked by the service
(:class:`~coordinator_free.checkpoints.service.ShardService`).

Quota. Each owner may hold at most ``quota_bytes_per_owner`` bytes (shards and
manifests). The bytes per owner are counted once when the store opens (a walk of its
directory) and then kept up to date by every write and removal the store makes: each
one measures the file or version directory it touches before and after, so a ``put``
or a ``delete`` costs in proportion to what it touches, never to the whole store, and
a write that fails half-way is counted as far as it went. The store owns its
directory: files changed behind its back are counted again at the next open.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from coordinator_free.checkpoints.errors import QuotaExceeded, ShardNotFound
from coordinator_free.erasure import ManifestInvalid, ShardSetManifest
from coordinator_free.files import atomic_write

__all__ = ["ShardStore", "StoredSet"]

_MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class StoredSet:
    """A set version held by one holder: its manifest and the shard indices held."""

    manifest: ShardSetManifest
    indices: tuple[int, ...]


def _name(text: str) -> str:
    """A path component for an id: hex of its UTF-8, so no id can escape the root."""
    return text.encode("utf-8").hex()


def _size(path: Path) -> int:
    """Bytes of the file at ``path`` (0 when it is gone)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _bytes_under(path: Path) -> int:
    """Bytes of the file at ``path``, or of every file below the directory ``path``."""
    if not path.is_dir():
        return _size(path)
    return sum(_size(p) for p in path.rglob("*") if p.is_file())


class ShardStore:
    """Shards held for others, on disk under ``root``, with a per-owner byte quota.

    Layout: ``root/<owner hex>/<set hex>/<version>/{manifest.json, <index>.shard}``.
    Every file is written atomically. Shard bytes are checked against the manifest on
    the way in; the manifest's signature is checked by the service. Usage per owner
    is counted at open and kept up to date by every put and delete.
    """

    def __init__(self, root: Path, *, quota_bytes_per_owner: int = 1 << 30) -> None:
        if quota_bytes_per_owner <= 0:
            raise ValueError("quota_bytes_per_owner must be positive")
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.quota = quota_bytes_per_owner
        self._lock = threading.RLock()
        self._usage: dict[str, int] = {}
        for owner_dir in self.root.iterdir():
            try:
                owner = bytes.fromhex(owner_dir.name).decode("utf-8")
            except ValueError:  # not one of ours (UnicodeDecodeError is a ValueError)
                continue
            if owner_dir.is_dir():
                self._usage[owner] = _bytes_under(owner_dir)

    def usage(self, owner: str) -> int:
        """Bytes held for ``owner`` (shards and manifests)."""
        with self._lock:
            return self._usage.get(owner, 0)

    def total_bytes(self) -> int:
        """Bytes held for every owner."""
        with self._lock:
            return sum(self._usage.values())

    @contextlib.contextmanager
    def _counted(self, owner: str, path: Path) -> Iterator[None]:
        """Add what the block changes under ``path`` (a file or a version directory)
        to ``owner``'s usage, also when the block fails half-way. Hold the lock."""
        before = _bytes_under(path)
        try:
            yield
        finally:
            self._usage[owner] = self._usage.get(owner, 0) + _bytes_under(path) - before

    def _dir(self, owner: str, set_id: str, version: int | None = None) -> Path:
        base = self.root / _name(owner) / _name(set_id)
        return base if version is None else base / f"{version:020d}"

    def _read_manifest(self, directory: Path) -> ShardSetManifest | None:
        try:
            return ShardSetManifest.from_json((directory / _MANIFEST_FILE).read_bytes())
        except (OSError, ManifestInvalid):
            return None

    def put(
        self,
        manifest: ShardSetManifest,
        shards: Mapping[int, bytes | bytearray | memoryview],
    ) -> list[int]:
        """Store ``shards`` of ``manifest`` (all-or-nothing per file); return indices.

        A version with another Merkle root replaces the one held; a manifest with a
        lower epoch than the one held is ignored. Raises :class:`CorruptShard`,
        :class:`QuotaExceeded`, or :class:`ShardNotFound` for a manifest-only refresh of
        a set not held.
        """
        for index, data in shards.items():
            manifest.check_shard(index, data)
        owner = manifest.owner
        directory = self._dir(owner, manifest.set_id, manifest.version)
        body = manifest.to_json()
        with self._lock:
            held = self._read_manifest(directory)
            replace_all = held is not None and held.merkle_root != manifest.merkle_root
            if held is None and not shards:
                raise ShardNotFound(f"no shards of {owner}/{manifest.set_id}@{manifest.version}")
            freed = 0
            if replace_all:
                freed = sum(_size(p) for p in directory.iterdir())
            else:
                freed = sum(_size(directory / f"{i}.shard") for i in shards)
                if held is not None:
                    freed += _size(directory / _MANIFEST_FILE)
            added = sum(len(d) for d in shards.values()) + len(body)
            usage = self._usage.get(owner, 0)
            if usage - freed + added > self.quota:
                raise QuotaExceeded(
                    f"holding {added} more bytes for {owner!r} would exceed its quota "
                    f"({usage - freed + added} > {self.quota})"
                )
            if replace_all:
                with self._counted(owner, directory):
                    shutil.rmtree(directory)
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            for index, data in shards.items():
                path = directory / f"{index}.shard"
                with self._counted(owner, path):
                    atomic_write(path, data)
            if held is None or replace_all or manifest.epoch >= held.epoch:
                with self._counted(owner, directory / _MANIFEST_FILE):
                    atomic_write(directory / _MANIFEST_FILE, body)
        return sorted(shards)

    def get(
        self, owner: str, set_id: str, version: int, indices: Iterable[int] | None = None
    ) -> tuple[ShardSetManifest, dict[int, bytes]]:
        """The manifest and the requested (default: all held) shards of a version."""
        directory = self._dir(owner, set_id, version)
        with self._lock:
            manifest = self._read_manifest(directory)
            if manifest is None:
                raise ShardNotFound(f"no set {owner}/{set_id}@{version}")
            wanted = self._indices(directory) if indices is None else sorted(set(indices))
            out: dict[int, bytes] = {}
            for index in wanted:
                try:
                    out[index] = (directory / f"{index}.shard").read_bytes()
                except OSError:
                    continue
        if indices is not None and not out:
            raise ShardNotFound(f"none of shards {wanted} of {owner}/{set_id}@{version}")
        return manifest, out

    @staticmethod
    def _indices(directory: Path) -> list[int]:
        return sorted(int(p.stem) for p in directory.glob("*.shard") if p.stem.isdigit())

    def list(self, owner: str, set_id: str | None = None) -> list[StoredSet]:
        """Every set version held for ``owner`` (optionally one set id), oldest first."""
        owner_dir = self.root / _name(owner)
        sets = (
            [owner_dir / _name(set_id)]
            if set_id is not None
            else sorted(p for p in owner_dir.glob("*") if p.is_dir())
        )
        out: list[StoredSet] = []
        with self._lock:
            for set_dir in sets:
                for version_dir in sorted(set_dir.glob("*")):
                    manifest = self._read_manifest(version_dir)
                    if manifest is not None:
                        out.append(StoredSet(manifest, tuple(self._indices(version_dir))))
        return out

    def delete(
        self,
        owner: str,
        set_id: str,
        versions: Iterable[int] | None = None,
        indices: Iterable[int] | None = None,
    ) -> int:
        """Drop versions (default all) of a set, or only some shard indices of them.

        Returns the number of shard files removed.
        """
        removed = 0
        set_dir = self._dir(owner, set_id)
        with self._lock:
            if versions is None:
                targets = sorted(p for p in set_dir.glob("*") if p.is_dir())
            else:
                targets = [self._dir(owner, set_id, v) for v in versions]
            for directory in targets:
                if not directory.is_dir():
                    continue
                if indices is None:
                    removed += len(self._indices(directory))
                    with self._counted(owner, directory):
                        shutil.rmtree(directory)
                    continue
                for index in indices:
                    path = directory / f"{index}.shard"
                    if path.exists():
                        with self._counted(owner, path):
                            path.unlink()
                        removed += 1
                if not self._indices(directory):
                    with self._counted(owner, directory):
                        shutil.rmtree(directory)
        return removed
