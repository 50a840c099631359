"""Checkpoint shards across peers: storage, the shard service, replication, recovery.

Peer side. :class:`ShardStore` keeps the shards an org holds for others on disk, per
owner under a byte quota, each file written atomically (temporary file, fsync, rename).
:class:`ShardService` answers four :class:`~coordinator_free.endpoint.Endpoint` message
kinds (stage ``"shards"``):

``shard.put``
    a signed shard-set manifest and some of its shards. Accepted only from the set's
    owner (the envelope's authenticated sender), with a valid owner signature, each
    shard matching its hash, within the owner's quota. With no shards it refreshes the
    manifest of a set already held (a new placement epoch after repair).
``shard.get`` / ``shard.list``
    hand shards (or the list of sets held) back; an owned set only to its owner, the
    global-model history (owner :data:`GLOBAL_OWNER`) to any member.
``shard.delete``
    the owner drops versions it no longer keeps.

Owner side. :class:`CheckpointReplicator` seals the org's private state
(:mod:`coordinator_free.sealed`), codes it (:mod:`coordinator_free.erasure`), places the
shards by rendezvous hashing over the live members (:mod:`coordinator_free.placement`),
pushes them in parallel, keeps ``retention`` versions, and repairs the placement when
membership changes or a holder lost its shards. :func:`recover` is what a node with an
empty disk calls: it asks every peer what it holds, fetches any ``k`` shards in
parallel, verifies them, decodes and decrypts.

:class:`GlobalHistoryStore` codes each kept version of the global model across the
members. Every node holds the same model, and the code is deterministic, so each node
computes all shards itself and keeps only those placed on it: no bytes travel until a
node must rebuild a version or repair its own share.

Replies start with one status byte: 0 and the body, or 1 and canonical JSON
``{"code", "message"}`` (``not_owner``, ``quota``, ``not_found``, ``bad_request``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator_free.endpoint import Endpoint
from coordinator_free.erasure import (
    CodeParams,
    CorruptShard,
    ErasureCodec,
    ManifestInvalid,
    NotEnoughShards,
    ShardError,
    ShardSetManifest,
    decode_set,
    decode_shards_message,
    encode_set,
    encode_shards_message,
)
from coordinator_free.errors import RefusalReason, Refused, TransportError
from coordinator_free.manifest import canonical_json
from coordinator_free.membership import EventKind
from coordinator_free.placement import Placement, place, repair_plan, tolerated_losses
from coordinator_free.sealed import RecoverySecret, atomic_write, open_sealed, seal
from coordinator_free.wire import Envelope

__all__ = [
    "DELETE",
    "GET",
    "GLOBAL_OWNER",
    "GLOBAL_SET",
    "LIST",
    "PUT",
    "STAGE",
    "CheckpointFailed",
    "CheckpointReplicator",
    "GlobalHistoryStore",
    "NoCheckpoint",
    "NotOwner",
    "QuotaExceeded",
    "RecoveredCheckpoint",
    "RepairReport",
    "ShardNotFound",
    "ShardRequestError",
    "ShardService",
    "ShardStore",
    "StoredSet",
    "delete_shards",
    "get_shards",
    "list_shards",
    "put_shards",
    "recover",
]

logger = logging.getLogger(__name__)

PUT = "shard.put"
GET = "shard.get"
LIST = "shard.list"
DELETE = "shard.delete"
STAGE = "shards"
GLOBAL_OWNER = "_global"
"""Owner id of the global-model history sets (org ids starting with ``_`` are reserved)."""
GLOBAL_SET = "global"
_OK, _ERR = b"\x00", b"\x01"
_MESSAGE_SLACK = 64 << 10
"""Room left in a message for the envelope and the manifest around the shard bytes."""
_AUDIT_EVENTS = frozenset({EventKind.JOIN, EventKind.ALIVE})
_MANIFEST_FILE = "manifest.json"


class ShardRequestError(ShardError):
    """A holder refused or could not serve a shard request; ``code`` says why."""

    code = "bad_request"

    def __init__(self, message: str, code: str | None = None) -> None:
        if code is not None:
            self.code = code
        super().__init__(message)


class QuotaExceeded(ShardRequestError):
    """The holder's per-owner quota would be exceeded."""

    code = "quota"


class NotOwner(ShardRequestError):
    """The requester is not the owner of the set it asks about."""

    code = "not_owner"


class ShardNotFound(ShardRequestError):
    """The holder has no such set, version or shard."""

    code = "not_found"


_ERRORS: dict[str, type[ShardRequestError]] = {
    c.code: c for c in (ShardRequestError, QuotaExceeded, NotOwner, ShardNotFound)
}


class CheckpointFailed(ShardError):
    """Fewer than ``k`` shards of a new checkpoint could be placed on live peers."""


class NoCheckpoint(ShardError):
    """No reachable peer holds a checkpoint of the requested set."""


# --------------------------------------------------------------------------- storage


@dataclass(frozen=True)
class StoredSet:
    """A set version held by one holder: its manifest and the shard indices held."""

    manifest: ShardSetManifest
    indices: tuple[int, ...]


def _name(text: str) -> str:
    """A path component for an id: hex of its UTF-8, so no id can escape the root."""
    return text.encode("utf-8").hex()


class ShardStore:
    """Shards held for others, on disk under ``root``, with a per-owner byte quota.

    Layout: ``root/<owner hex>/<set hex>/<version>/{manifest.json, <index>.shard}``.
    Every file is written atomically. Shard bytes are checked against the manifest on
    the way in; the manifest's signature is checked by :class:`ShardService`.
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
                self._usage[owner] = sum(
                    p.stat().st_size for p in owner_dir.rglob("*") if p.is_file()
                )

    def usage(self, owner: str) -> int:
        """Bytes held for ``owner`` (shards and manifests)."""
        with self._lock:
            return self._usage.get(owner, 0)

    def total_bytes(self) -> int:
        """Bytes held for every owner."""
        with self._lock:
            return sum(self._usage.values())

    def _dir(self, owner: str, set_id: str, version: int | None = None) -> Path:
        base = self.root / _name(owner) / _name(set_id)
        return base if version is None else base / f"{version:020d}"

    def _read_manifest(self, directory: Path) -> ShardSetManifest | None:
        try:
            return ShardSetManifest.from_json((directory / _MANIFEST_FILE).read_bytes())
        except (OSError, ManifestInvalid):
            return None

    @staticmethod
    def _size(path: Path) -> int:
        try:
            return path.stat().st_size
        except OSError:
            return 0

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
                freed = sum(self._size(p) for p in directory.iterdir())
            else:
                freed = sum(self._size(directory / f"{i}.shard") for i in shards)
                if held is not None:
                    freed += self._size(directory / _MANIFEST_FILE)
            added = sum(len(d) for d in shards.values()) + len(body)
            usage = self._usage.get(owner, 0)
            if usage - freed + added > self.quota:
                raise QuotaExceeded(
                    f"holding {added} more bytes for {owner!r} would exceed its quota "
                    f"({usage - freed + added} > {self.quota})"
                )
            if replace_all:
                shutil.rmtree(directory)
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            for index, data in shards.items():
                atomic_write(directory / f"{index}.shard", data)
            if held is None or replace_all or manifest.epoch >= held.epoch:
                atomic_write(directory / _MANIFEST_FILE, body)
            self._usage[owner] = sum(
                p.stat().st_size for p in (self.root / _name(owner)).rglob("*") if p.is_file()
            )
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
                    shutil.rmtree(directory)
                    continue
                for index in indices:
                    path = directory / f"{index}.shard"
                    if path.exists():
                        path.unlink()
                        removed += 1
                if not self._indices(directory):
                    shutil.rmtree(directory)
            owner_dir = self.root / _name(owner)
            self._usage[owner] = sum(p.stat().st_size for p in owner_dir.rglob("*") if p.is_file())
        return removed


# --------------------------------------------------------------------------- service


def _ok(body: bytes = b"") -> bytes:
    return _OK + body


def _json(obj: Any) -> bytes:
    return canonical_json(obj)


def _request(
    payload: bytes, required: Set[str], optional: Set[str] = frozenset()
) -> dict[str, Any]:
    try:
        obj = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        raise Refused(RefusalReason.MALFORMED, "shard request is not JSON") from None
    if not isinstance(obj, dict) or not required <= set(obj) <= required | optional:
        raise Refused(RefusalReason.MALFORMED, "shard request has unexpected fields")
    return obj


def _uint(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Refused(RefusalReason.MALFORMED, "expected a non-negative integer")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise Refused(RefusalReason.MALFORMED, "expected a non-empty string")
    return value


class ShardService:
    """Serves the ``shard.*`` kinds on an endpoint from a :class:`ShardStore`.

    ``public_keys()`` maps members to their Ed25519 keys (the manifest's); the
    endpoint's guard already refuses non-members, so every request here comes from an
    authenticated member.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        store: ShardStore,
        public_keys: Callable[[], Mapping[str, bytes]],
    ) -> None:
        self.endpoint = endpoint
        self.store = store
        self.public_keys = public_keys
        endpoint.on(PUT, self._on_put)
        endpoint.on(GET, self._on_get)
        endpoint.on(LIST, self._on_list)
        endpoint.on(DELETE, self._on_delete)

    async def _serve(self, work: Callable[[], bytes]) -> bytes:
        try:
            return await asyncio.to_thread(work)
        except ShardRequestError as exc:
            return _ERR + _json({"code": exc.code, "message": str(exc)})
        except CorruptShard as exc:
            return _ERR + _json({"code": "bad_request", "message": str(exc)})

    @staticmethod
    def _may_read(env: Envelope, owner: str) -> None:
        if owner != env.sender and owner != GLOBAL_OWNER:
            raise NotOwner(f"{env.sender!r} asked for shards owned by {owner!r}")

    async def _on_put(self, env: Envelope) -> bytes:
        try:
            manifest, shards = decode_shards_message(env.payload)
        except ManifestInvalid as exc:
            raise Refused(RefusalReason.MALFORMED, str(exc)) from None

        def work() -> bytes:
            if manifest.owner != env.sender:
                raise NotOwner(f"{env.sender!r} cannot store shards owned by {manifest.owner!r}")
            key = self.public_keys().get(env.sender)
            try:
                if key is None:
                    raise ManifestInvalid(f"no key for {env.sender!r}")
                manifest.verify(key)
            except ManifestInvalid as exc:
                raise ShardRequestError(str(exc)) from None
            stored = self.store.put(manifest, shards)
            return _ok(_json({"stored": stored}))

        return await self._serve(work)

    async def _on_get(self, env: Envelope) -> bytes:
        req = _request(env.payload, {"owner", "set_id", "version"}, {"indices"})
        owner, set_id, version = _str(req["owner"]), _str(req["set_id"]), _uint(req["version"])
        raw = req.get("indices")
        if raw is not None and not isinstance(raw, list):
            raise Refused(RefusalReason.MALFORMED, "indices must be a list")
        indices = None if raw is None else [_uint(i) for i in raw]

        def work() -> bytes:
            self._may_read(env, owner)
            manifest, shards = self.store.get(owner, set_id, version, indices)
            return _ok(encode_shards_message(manifest, shards))

        return await self._serve(work)

    async def _on_list(self, env: Envelope) -> bytes:
        req = _request(env.payload, {"owner"}, {"set_id"})
        owner = _str(req["owner"])
        set_id = None if req.get("set_id") is None else _str(req["set_id"])

        def work() -> bytes:
            self._may_read(env, owner)
            entries = [
                {"manifest": s.manifest.to_json().decode(), "indices": list(s.indices)}
                for s in self.store.list(owner, set_id)
            ]
            return _ok(_json({"sets": entries}))

        return await self._serve(work)

    async def _on_delete(self, env: Envelope) -> bytes:
        req = _request(env.payload, {"owner", "set_id"}, {"versions", "indices"})
        owner, set_id = _str(req["owner"]), _str(req["set_id"])
        versions = req.get("versions")
        indices = req.get("indices")
        for value in (versions, indices):
            if value is not None and not isinstance(value, list):
                raise Refused(RefusalReason.MALFORMED, "versions/indices must be lists")
        vs = None if versions is None else [_uint(v) for v in versions]
        ix = None if indices is None else [_uint(i) for i in indices]

        def work() -> bytes:
            if owner != env.sender:
                raise NotOwner(f"{env.sender!r} cannot delete shards owned by {owner!r}")
            return _ok(_json({"deleted": self.store.delete(owner, set_id, vs, ix)}))

        return await self._serve(work)


# --------------------------------------------------------------------------- client calls


def _unwrap(reply: bytes) -> memoryview:
    """The body of an OK reply (a view, no copy); raise the holder's error otherwise."""
    if reply[:1] == _OK:
        return memoryview(reply)[1:]
    try:
        obj = json.loads(reply[1:])
        code, message = str(obj["code"]), str(obj["message"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise ShardRequestError("malformed reply from a shard holder") from None
    raise _ERRORS.get(code, ShardRequestError)(message, code)


async def put_shards(
    endpoint: Endpoint,
    peer: str,
    manifest: ShardSetManifest,
    shards: Mapping[int, bytes | bytearray | memoryview],
    *,
    timeout: float = 60.0,
) -> list[int]:
    """Push ``shards`` of ``manifest`` (ours) to ``peer``; return the indices stored."""
    reply = await endpoint.send(
        peer, PUT, encode_shards_message(manifest, shards), stage=STAGE, timeout=timeout
    )
    stored = json.loads(bytes(_unwrap(reply)))["stored"]
    return [int(i) for i in stored]


async def get_shards(
    endpoint: Endpoint,
    peer: str,
    owner: str,
    set_id: str,
    version: int,
    indices: Sequence[int] | None = None,
    *,
    timeout: float = 60.0,
) -> tuple[ShardSetManifest, dict[int, memoryview]]:
    """Fetch shards (unverified: check them against a trusted manifest)."""
    body: dict[str, Any] = {"owner": owner, "set_id": set_id, "version": version}
    if indices is not None:
        body["indices"] = list(indices)
    reply = await endpoint.send(peer, GET, _json(body), stage=STAGE, timeout=timeout)
    payload = _unwrap(reply)
    try:
        return decode_shards_message(payload)
    except ManifestInvalid as exc:
        raise ShardRequestError(f"{peer!r} sent a malformed shard message: {exc}") from None


async def list_shards(
    endpoint: Endpoint,
    peer: str,
    owner: str,
    set_id: str | None = None,
    *,
    timeout: float = 10.0,
) -> list[StoredSet]:
    """What ``peer`` holds for ``owner`` (unverified manifests)."""
    body: dict[str, Any] = {"owner": owner}
    if set_id is not None:
        body["set_id"] = set_id
    reply = await endpoint.send(peer, LIST, _json(body), stage=STAGE, timeout=timeout)
    try:
        entries = json.loads(bytes(_unwrap(reply)))["sets"]
        return [
            StoredSet(
                ShardSetManifest.from_json(e["manifest"]), tuple(int(i) for i in e["indices"])
            )
            for e in entries
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise ShardRequestError(f"{peer!r} sent a malformed list: {exc}") from None


async def delete_shards(
    endpoint: Endpoint,
    peer: str,
    set_id: str,
    versions: Sequence[int] | None = None,
    indices: Sequence[int] | None = None,
    *,
    timeout: float = 10.0,
) -> int:
    """Ask ``peer`` to drop our shards of ``set_id`` (some versions, some indices)."""
    body: dict[str, Any] = {"owner": endpoint.org_id, "set_id": set_id}
    if versions is not None:
        body["versions"] = list(versions)
    if indices is not None:
        body["indices"] = list(indices)
    reply = await endpoint.send(peer, DELETE, _json(body), stage=STAGE, timeout=timeout)
    return int(json.loads(bytes(_unwrap(reply)))["deleted"])


def _describe(exc: BaseException) -> str:
    if isinstance(exc, Refused):
        return f"refused ({exc.reason.value})"
    if isinstance(exc, TransportError):
        return f"unreachable ({type(exc).__name__})"
    if isinstance(exc, ShardRequestError):
        return f"{exc.code}: {exc}"
    if isinstance(exc, CorruptShard):
        return "corrupt (hash mismatch)"
    return f"{type(exc).__name__}: {exc}"


async def _fetch_any_k(
    endpoint: Endpoint,
    manifest: ShardSetManifest,
    sources: Mapping[int, Sequence[str]],
    *,
    timeout: float,
    need: int | None = None,
) -> tuple[dict[int, memoryview], dict[int, str]]:
    """Fetch and verify shards of ``manifest`` until ``need`` (default ``k``) are intact.

    ``sources[i]`` lists who may hold shard ``i``, best first. ``k`` fetches start at
    once (data shards first, as decoding them is a concatenation); each failure or
    corrupt shard starts the next candidate. Returns the intact shards and, for every
    index given up on, why.
    """
    k = manifest.k if need is None else need
    queue = sorted(i for i, holders in sources.items() if holders)
    reasons: dict[int, str] = {
        i: "no holder known" for i in range(manifest.k + manifest.m) if not sources.get(i)
    }
    got: dict[int, memoryview] = {}

    async def fetch(index: int) -> memoryview:
        why: list[str] = []
        for holder in sources[index]:
            try:
                _, shards = await get_shards(
                    endpoint,
                    holder,
                    manifest.owner,
                    manifest.set_id,
                    manifest.version,
                    [index],
                    timeout=timeout,
                )
                data = shards.get(index)
                if data is None:
                    raise ShardNotFound(f"{holder!r} did not return shard {index}")
                await asyncio.to_thread(manifest.check_shard, index, data)
                return data
            except (TransportError, ShardRequestError, CorruptShard) as exc:
                why.append(f"{holder}: {_describe(exc)}")
        raise ShardError("; ".join(why))

    running: dict[asyncio.Task[memoryview], int] = {}

    def launch() -> None:
        while queue and len(running) + len(got) < k:
            index = queue.pop(0)
            running[asyncio.create_task(fetch(index))] = index

    launch()
    try:
        while running and len(got) < k:
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = running.pop(task)
                try:
                    got[index] = task.result()
                except ShardError as exc:
                    reasons[index] = str(exc)
            launch()
    finally:
        for task in running:
            task.cancel()
        for task in running:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    for index in queue:
        reasons.setdefault(index, "not tried")
    return got, reasons


# --------------------------------------------------------------------------- owner side


@dataclass(frozen=True)
class RepairReport:
    """What one repair pass did to one kept version."""

    version: int
    moved: Mapping[int, tuple[str, str]]
    tolerated_losses: int
    epoch: int


@dataclass
class _Kept:
    manifest: ShardSetManifest
    shards: dict[int, bytes] | None = field(default=None, repr=False)


class CheckpointReplicator:
    """Owner side of erasure-coded checkpoints of this org's private state.

    ``live()`` gives the live members (e.g. ``Membership.live``); shards go to live
    members other than this org. ``retention`` versions are kept; older ones are
    deleted from their holders. ``cache_shards`` keeps the newest version's shards in
    memory so that repair needs no fetch.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        secret: RecoverySecret,
        live: Callable[[], Iterable[str]],
        *,
        params: CodeParams | None = None,
        set_id: str = "state",
        retention: int = 2,
        timeout: float = 60.0,
        cache_shards: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if retention < 1:
            raise ValueError("retention must be at least 1")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self.endpoint = endpoint
        self.secret = secret
        self.live = live
        self.params = params or CodeParams()
        self.set_id = set_id
        self.retention = retention
        self.timeout = timeout
        self.cache_shards = cache_shards
        self.clock = clock
        self.codec = ErasureCodec(self.params)
        self._kept: dict[int, _Kept] = {}
        self._lock = asyncio.Lock()
        self._watch: asyncio.Task[None] | None = None

    @property
    def me(self) -> str:
        return self.endpoint.org_id

    def _peers(self, exclude: Iterable[str] = ()) -> list[str]:
        skip = {self.me, *exclude}
        return sorted(p for p in self.live() if p not in skip)

    def _set_key(self, version: int) -> str:
        return f"{self.me}/{self.set_id}/{version}"

    @property
    def versions(self) -> list[int]:
        """Versions kept on peers, oldest first."""
        return sorted(self._kept)

    def manifest(self, version: int) -> ShardSetManifest:
        """The current manifest of a kept version."""
        return self._kept[version].manifest

    async def checkpoint(
        self, state: bytes, version: int, *, nonce: bytes | None = None
    ) -> ShardSetManifest:
        """Seal, code, place and push ``state`` as ``version``; return its manifest.

        Shards that a peer does not take are re-placed on the next candidates. Raises
        :class:`CheckpointFailed` when fewer than ``k`` shards found a holder.
        """
        async with self._lock:
            sealed = seal(self.secret, self.me, self.set_id, version, state, nonce=nonce)
            peers = self._peers()
            if not peers:
                raise CheckpointFailed("no live peer to hold checkpoint shards")
            shard_bytes = ErasureCodec.shard_size_for(len(sealed), self.params.k)
            per_holder = shard_bytes * -(-self.params.n // len(peers))
            limit = self.endpoint.guard.max_size - _MESSAGE_SLACK
            if per_holder > limit:
                raise CheckpointFailed(
                    f"{per_holder} bytes of shards per holder exceed the message limit "
                    f"({limit}); raise k or the endpoint's max_size"
                )
            placement = place(self._set_key(version), self.params.n, peers)
            manifest, encoded = await asyncio.to_thread(
                encode_set,
                sealed,
                params=self.params,
                owner=self.me,
                set_id=self.set_id,
                version=version,
                created_at=int(self.clock()),
                holders=placement.holders,
                identity=self.endpoint.identity,
                codec=self.codec,
            )
            shards = {i: bytes(s) for i, s in enumerate(encoded.shards)}
            manifest = await self._push(manifest, shards, set(range(self.params.n)))
            if manifest.epoch > 0:
                await self._refresh_manifest(manifest)
            self._kept[version] = _Kept(manifest, shards if self.cache_shards else None)
            for older in sorted(self._kept)[: -self.retention]:
                await self._drop(older)
            if self.cache_shards:
                for kept_version, kept in self._kept.items():
                    if kept_version != version:
                        kept.shards = None
            return manifest

    async def _push(
        self,
        manifest: ShardSetManifest,
        shards: Mapping[int, bytes],
        indices: set[int],
    ) -> ShardSetManifest:
        """Push ``indices`` to their holders, re-placing the shards of failing holders.

        Returns the manifest of the final placement (a higher epoch, signed again, when
        some shards had to move); the caller refreshes it on the holders.
        """
        current = manifest
        holders = list(manifest.holders)
        failed: set[str] = set()
        while indices:
            by_holder: dict[str, list[int]] = {}
            for index in sorted(indices):
                by_holder.setdefault(holders[index], []).append(index)
            results = await asyncio.gather(
                *(
                    put_shards(
                        self.endpoint,
                        holder,
                        current,
                        {i: shards[i] for i in group},
                        timeout=self.timeout,
                    )
                    for holder, group in by_holder.items()
                ),
                return_exceptions=True,
            )
            retry: set[int] = set()
            for (holder, group), result in zip(by_holder.items(), results, strict=True):
                if isinstance(result, BaseException):
                    if not isinstance(result, TransportError | ShardRequestError):
                        raise result
                    logger.warning(
                        "%s: %s did not take shards %s: %s",
                        self.me,
                        holder,
                        group,
                        _describe(result),
                    )
                    failed.add(holder)
                    retry.update(group)
            if not retry:
                break
            candidates = self._peers(exclude=failed)
            if candidates:
                plan = repair_plan(
                    Placement(self._set_key(manifest.version), tuple(holders)), candidates
                )
                holders = list(plan.after.holders)
                # Every shard the plan moved (those of failed holders, and any spread
                # off a doubly loaded holder) goes to its new holder.
                indices = set(plan.moves)
            else:
                indices = set()
            for index in retry:
                if holders[index] in failed:
                    holders[index] = ""
            current = current.with_holders(holders, current.epoch + 1).sign(self.endpoint.identity)
        placed = sum(1 for h in holders if h)
        if placed < manifest.k:
            raise CheckpointFailed(
                f"only {placed} of {manifest.k + manifest.m} shards of "
                f"{self.set_id}@{manifest.version} found a holder; need {manifest.k}"
            )
        return current

    async def _refresh_manifest(self, manifest: ShardSetManifest) -> None:
        """Send the current manifest (no shards) to every holder, best effort."""
        holders = sorted({h for h in manifest.holders if h})
        results = await asyncio.gather(
            *(put_shards(self.endpoint, h, manifest, {}, timeout=self.timeout) for h in holders),
            return_exceptions=True,
        )
        for holder, result in zip(holders, results, strict=True):
            if isinstance(result, BaseException):
                logger.info("%s: manifest refresh on %s failed: %s", self.me, holder, result)

    async def _drop(self, version: int) -> None:
        kept = self._kept.pop(version)
        holders = sorted({h for h in kept.manifest.holders if h})
        await asyncio.gather(
            *(
                delete_shards(self.endpoint, h, self.set_id, [version], timeout=self.timeout)
                for h in holders
            ),
            return_exceptions=True,
        )

    async def _shards_for(self, version: int, wanted: Iterable[int]) -> dict[int, bytes]:
        """Shards ``wanted`` of a kept version: from the cache or rebuilt from any k."""
        kept = self._kept[version]
        wanted = sorted(set(wanted))
        if kept.shards is not None:
            return {i: kept.shards[i] for i in wanted}
        manifest = kept.manifest
        sources = {i: [h] for i, h in enumerate(manifest.holders) if h}
        got, reasons = await _fetch_any_k(self.endpoint, manifest, sources, timeout=self.timeout)
        if len(got) < manifest.k:
            missing = [i for i in range(manifest.k + manifest.m) if i not in got]
            raise NotEnoughShards(
                manifest.k,
                len(got),
                missing,
                holders={i: manifest.holders[i] for i in missing},
                reasons=reasons,
            )
        return await asyncio.to_thread(self.codec.regenerate, got, manifest.size, wanted)

    async def _held(self, holder: str, version: int) -> set[int] | None:
        """Indices ``holder`` reports for ``version`` (None if it cannot be asked)."""
        try:
            sets = await list_shards(
                self.endpoint, holder, self.me, self.set_id, timeout=self.timeout
            )
        except (TransportError, ShardRequestError):
            return None
        return {i for s in sets if s.manifest.version == version for i in s.indices}

    async def repair(self, *, audit: bool = False) -> list[RepairReport]:
        """Re-place the shards of every kept version whose holder is not live.

        With ``audit``, also ask each live holder which shards it still has and push
        back the ones it lost. Returns what was done per version.
        """
        reports: list[RepairReport] = []
        async with self._lock:
            for version in sorted(self._kept):
                reports.append(await self._repair_version(version, audit))
        return reports

    async def _repair_version(self, version: int, audit: bool) -> RepairReport:
        manifest = self._kept[version].manifest
        live = self._peers()
        plan = repair_plan(Placement(self._set_key(version), manifest.holders), live)
        moves: dict[int, tuple[str, str]] = dict(plan.moves)
        holders = list(plan.after.holders)
        if audit:
            for holder in sorted({h for h in holders if h}):
                mine = {i for i, h in enumerate(holders) if h == holder and i not in moves}
                held = await self._held(holder, version)
                if held is not None:
                    for index in sorted(mine - held):
                        moves[index] = (holder, holder)
        if not moves:
            return RepairReport(version, {}, tolerated_losses(holders, manifest.k), manifest.epoch)
        shards = await self._shards_for(version, moves)
        updated = manifest.with_holders(holders, manifest.epoch + 1).sign(self.endpoint.identity)
        updated = await self._push(updated, shards, set(moves))
        self._kept[version].manifest = updated
        await self._refresh_manifest(updated)
        stale = [(old, i) for i, (old, new) in moves.items() if old and old != new and old in live]
        for old, index in stale:
            with contextlib.suppress(TransportError, ShardRequestError):
                await delete_shards(
                    self.endpoint, old, self.set_id, [version], [index], timeout=self.timeout
                )
        logger.info("%s: repaired %s@%d, moved %s", self.me, self.set_id, version, moves)
        return RepairReport(
            version, moves, tolerated_losses(updated.holders, updated.k), updated.epoch
        )

    def watch(self, events: asyncio.Queue[Any], *, settle_s: float = 0.5) -> asyncio.Task[None]:
        """Repair after membership changes read from ``events`` (``Membership.subscribe()``).

        Events arriving within ``settle_s`` of each other trigger a single repair; a
        JOIN or ALIVE event (a member back, perhaps with an empty disk) makes it an
        audit that also asks every holder which shards it still has.
        """

        async def loop() -> None:
            while True:
                batch = [await events.get()]
                await asyncio.sleep(settle_s)
                while not events.empty():
                    batch.append(events.get_nowait())
                # A member coming back may have lost its disk: audit what it holds.
                audit = any(getattr(e, "kind", None) in _AUDIT_EVENTS for e in batch)
                try:
                    await self.repair(audit=audit)
                except (ShardError, TransportError) as exc:
                    logger.warning("%s: checkpoint repair failed: %s", self.me, exc)

        self._watch = asyncio.create_task(loop())
        return self._watch

    async def close(self) -> None:
        """Stop the repair watcher, if any."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None

    def adopt(self, manifest: ShardSetManifest) -> None:
        """Take over a version found on peers (after :func:`recover`), for repair."""
        manifest.verify(self.endpoint.identity.public_key)
        if manifest.owner != self.me or manifest.set_id != self.set_id:
            raise ManifestInvalid("the manifest is not one of this replicator's sets")
        self._kept[manifest.version] = _Kept(manifest)


# --------------------------------------------------------------------------- recovery


@dataclass(frozen=True)
class RecoveredCheckpoint:
    """A recovered private state: its version (round), plaintext and manifest."""

    version: int
    state: bytes = field(repr=False)
    manifest: ShardSetManifest

    def write(self, path: Path) -> None:
        """Write the state atomically (temporary file, fsync, rename), mode 0600."""
        atomic_write(Path(path), self.state)


async def _survey(
    endpoint: Endpoint, peers: Sequence[str], owner: str, set_id: str | None, timeout: float
) -> tuple[dict[str, list[StoredSet]], dict[str, str]]:
    results = await asyncio.gather(
        *(list_shards(endpoint, p, owner, set_id, timeout=timeout) for p in peers),
        return_exceptions=True,
    )
    held: dict[str, list[StoredSet]] = {}
    failures: dict[str, str] = {}
    for peer, result in zip(peers, results, strict=True):
        if isinstance(result, BaseException):
            if not isinstance(result, TransportError | ShardError):
                raise result
            failures[peer] = _describe(result)
        else:
            held[peer] = result
    return held, failures


def _sources(
    manifest: ShardSetManifest, held: Mapping[str, Sequence[StoredSet]]
) -> dict[int, list[str]]:
    """Who reported each shard of ``manifest``'s version (same Merkle root), placed
    holder first; the placed holder is listed even when it could not be asked."""
    sources: dict[int, list[str]] = {i: [] for i in range(manifest.k + manifest.m)}
    for index, holder in enumerate(manifest.holders):
        if holder:
            sources[index].append(holder)
    for peer, sets in sorted(held.items()):
        for stored in sets:
            if stored.manifest.key != manifest.key:
                continue
            if stored.manifest.merkle_root != manifest.merkle_root:
                continue
            for index in stored.indices:
                holders = sources.get(index)
                if holders is not None and peer not in holders:
                    holders.append(peer)
    return sources


async def recover(
    endpoint: Endpoint,
    secret: RecoverySecret,
    peers: Iterable[str],
    *,
    set_id: str = "state",
    version: int | None = None,
    timeout: float = 60.0,
) -> RecoveredCheckpoint:
    """Rebuild this org's private state from its peers (a node with an empty disk).

    Asks every peer which shards of ``set_id`` it holds for us, keeps the manifests our
    own key signed, picks ``version`` (default: the newest) at its latest placement
    epoch, fetches any ``k`` shards in parallel, verifies each against the manifest,
    decodes, decrypts. Raises :class:`NoCheckpoint` when no peer holds one,
    :class:`~coordinator_free.erasure.NotEnoughShards` (naming each missing shard,
    where it was placed and why it is missing), or
    :class:`~coordinator_free.sealed.WrongRecoverySecret`.
    """
    me = endpoint.org_id
    key = endpoint.identity.public_key
    asked = sorted({p for p in peers if p != me})
    held, failures = await _survey(endpoint, asked, me, set_id, min(timeout, 15.0))
    candidates: dict[tuple[int, int], ShardSetManifest] = {}
    for sets in held.values():
        for stored in sets:
            m = stored.manifest
            if m.owner != me or m.set_id != set_id:
                continue
            try:
                m.verify(key)
            except ManifestInvalid:
                logger.warning("%s: ignoring a manifest not signed by our key", me)
                continue
            candidates.setdefault((m.version, m.epoch), m)
    if version is not None:
        candidates = {vk: m for vk, m in candidates.items() if vk[0] == version}
    if not candidates:
        unreachable = ", ".join(f"{p} ({why})" for p, why in sorted(failures.items()))
        what = f"{set_id}@{version}" if version is not None else set_id
        raise NoCheckpoint(
            f"no reachable peer holds a checkpoint {what} of {me!r}; asked {len(asked)} "
            f"peers" + (f", unreachable: {unreachable}" if unreachable else "")
        )
    manifest = candidates[max(candidates)]
    sources = _sources(manifest, held)
    got, reasons = await _fetch_any_k(endpoint, manifest, sources, timeout=timeout)
    for index, holders in sources.items():
        for holder in holders:
            if holder in failures and index not in got:
                reasons.setdefault(index, f"{holder}: {failures[holder]}")
    if len(got) < manifest.k:
        missing = [i for i in range(manifest.k + manifest.m) if i not in got]
        error = NotEnoughShards(
            manifest.k,
            len(got),
            missing,
            holders={i: manifest.holders[i] for i in missing},
            reasons=reasons,
        )
        older = sorted({v for v, _ in candidates if v < manifest.version})
        if older:
            error.add_note(
                f"peers also hold older versions {older} of {set_id!r}; "
                "recover(..., version=V) fetches one of them"
            )
        raise error
    codec = ErasureCodec(manifest.params)
    # Every shard in ``got`` was checked against the manifest as it arrived.
    sealed = await asyncio.to_thread(decode_set, manifest, got, codec=codec, verified=True)
    state = await asyncio.to_thread(open_sealed, secret, me, set_id, manifest.version, sealed)
    return RecoveredCheckpoint(manifest.version, state, manifest)


# --------------------------------------------------------------------------- global history


class GlobalHistoryStore:
    """The federation's global-model history, coded across the members.

    Each node calls :meth:`add_version` with the model it just stepped to (the same
    bytes on every node, as the round engine checks by gossiping its SHA-256). The code
    is deterministic and the placement is computed from the round's agreed survivors
    (the live members when none are given), so every node
    stores only the shards placed on it: about ``(k + m) / (k n)`` of each version,
    instead of a full copy. ``retention`` versions are kept. Any node rebuilds version
    ``v`` from any ``k`` shards (:meth:`rebuild`), verified against the gossiped hash.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        store: ShardStore,
        live: Callable[[], Iterable[str]],
        *,
        params: CodeParams | None = None,
        retention: int = 8,
        timeout: float = 60.0,
    ) -> None:
        if retention < 1:
            raise ValueError("retention must be at least 1")
        self.endpoint = endpoint
        self.store = store
        self.live = live
        self.params = params or CodeParams()
        self.retention = retention
        self.timeout = timeout
        self.codec = ErasureCodec(self.params)
        self._seen: set[int] = set()

    @property
    def me(self) -> str:
        return self.endpoint.org_id

    def _placement(self, version: int, members: Iterable[str]) -> Placement:
        return place(f"{GLOBAL_OWNER}/{GLOBAL_SET}/{version}", self.params.n, members)

    def _manifest(
        self, model: bytes, version: int, model_sha256: str, holders: Sequence[str]
    ) -> tuple[ShardSetManifest, Any]:
        return encode_set(
            model,
            params=self.params,
            owner=GLOBAL_OWNER,
            set_id=GLOBAL_SET,
            version=version,
            created_at=0,
            holders=holders,
            content_sha256=model_sha256,
            codec=self.codec,
        )

    def versions(self) -> list[int]:
        """Versions of which this node holds shards, oldest first."""
        return sorted({s.manifest.version for s in self.store.list(GLOBAL_OWNER, GLOBAL_SET)})

    def add_version(
        self,
        version: int,
        model: bytes,
        model_sha256: str,
        *,
        members: Iterable[str] | None = None,
    ) -> ShardSetManifest:
        """Code ``model`` (version ``version``), keep this node's shards, prune old ones.

        ``members`` are the orgs that hold this version (a round's agreed survivors):
        the shards are placed on them only, so every holder computes the same placement
        from the same agreed set, and no shard lands on a live member that missed the
        round and so cannot store it. Without ``members``, the live members.

        CPU-bound (hashing and coding the whole model): from a coroutine, run it with
        ``asyncio.to_thread`` for large models.
        """
        if hashlib.sha256(model).hexdigest() != model_sha256:
            raise ManifestInvalid(f"model bytes of version {version} do not match its hash")
        placement = self._placement(version, self.live() if members is None else members)
        manifest, encoded = self._manifest(model, version, model_sha256, placement.holders)
        mine = {i: encoded.shards[i] for i in placement.shards_of(self.me)}
        if mine:
            self.store.put(manifest, mine)
        self._seen.add(version)
        self._prune()
        return manifest

    def _prune(self) -> None:
        """Drop held versions older than the ``retention`` newest ones seen."""
        known = sorted(self._seen | set(self.versions()))
        keep = set(known[-self.retention :])
        self._seen &= keep
        old = [v for v in self.versions() if v not in keep]
        if old:
            self.store.delete(GLOBAL_OWNER, GLOBAL_SET, old)

    async def rebuild(self, version: int, model_sha256: str, peers: Iterable[str]) -> bytes:
        """Rebuild model ``version`` from any k shards held by this node and ``peers``.

        Only manifests whose ``content_sha256`` equals the gossiped ``model_sha256``
        are used, and the decoded bytes are checked against it.
        """
        asked = sorted({p for p in peers if p != self.me})
        held, failures = await _survey(
            self.endpoint, asked, GLOBAL_OWNER, GLOBAL_SET, min(self.timeout, 15.0)
        )
        local = self.store.list(GLOBAL_OWNER, GLOBAL_SET)
        manifest = None
        for sets in [local, *held.values()]:
            for stored in sets:
                m = stored.manifest
                if m.version == version and m.content_sha256 == model_sha256:
                    manifest = m
                    break
            if manifest is not None:
                break
        if manifest is None:
            raise NoCheckpoint(
                f"no reachable member holds global model version {version} with hash "
                f"{model_sha256[:16]}…" + (f"; unreachable: {sorted(failures)}" if failures else "")
            )
        shards: dict[int, bytes | memoryview] = {}
        for stored in local:
            if (
                stored.manifest.version == version
                and stored.manifest.merkle_root == manifest.merkle_root
            ):
                shards.update(self.store.get(GLOBAL_OWNER, GLOBAL_SET, version)[1])
        need = {
            i: [p for p in srcs if p != self.me]
            for i, srcs in _sources(manifest, held).items()
            if i not in shards
        }
        if len(shards) < manifest.k:
            got, reasons = await _fetch_any_k(
                self.endpoint,
                manifest,
                need,
                timeout=self.timeout,
                need=manifest.k - len(shards),
            )
            shards.update(got)
        else:
            reasons = {}
        try:
            return await asyncio.to_thread(decode_set, manifest, shards, codec=self.codec)
        except NotEnoughShards as exc:
            raise NotEnoughShards(
                manifest.k,
                exc.have,
                exc.missing,
                corrupt=exc.corrupt,
                holders=exc.holders,
                reasons={**reasons, **exc.reasons},
            ) from None

    async def repair(self, peers: Iterable[str] | None = None) -> list[int]:
        """Fetch and regenerate the shards that the current placement gives this node
        for each version known to it or to ``peers``; return the versions repaired."""
        live = sorted(set(self.live()))
        peer_list = sorted(set(peers) if peers is not None else set(live))
        held, _ = await _survey(
            self.endpoint,
            [p for p in peer_list if p != self.me],
            GLOBAL_OWNER,
            GLOBAL_SET,
            min(self.timeout, 15.0),
        )
        known: dict[int, ShardSetManifest] = {}
        for sets in [self.store.list(GLOBAL_OWNER, GLOBAL_SET), *held.values()]:
            for stored in sets:
                known.setdefault(stored.manifest.version, stored.manifest)
        repaired: list[int] = []
        self._seen |= set(known)
        for version in sorted(known)[-self.retention :]:
            manifest = known[version]
            placement = self._placement(version, live)
            wanted = set(placement.shards_of(self.me))
            have = {
                i
                for s in self.store.list(GLOBAL_OWNER, GLOBAL_SET)
                if s.manifest.version == version
                for i in s.indices
            }
            if not wanted - have:
                continue
            model = await self.rebuild(version, manifest.content_sha256, peer_list)
            fresh, encoded = self._manifest(
                model, version, manifest.content_sha256, placement.holders
            )
            self.store.put(fresh, {i: encoded.shards[i] for i in wanted})
            repaired.append(version)
        self._prune()
        return repaired
