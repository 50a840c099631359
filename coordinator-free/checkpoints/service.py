"""The shard service: its wire format, the holder's handlers and the client calls.

:class:`ShardService` answers four :class:`~coordinator_free.endpoint.Endpoint` message
kinds (stage ``"shards"``) from a :class:`~coordinator_free.checkpoints.store.ShardStore`:

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

Requests other than ``shard.put`` (whose payload is a shards message,
:func:`~coordinator_free.erasure.encode_shards_message`) are canonical JSON objects.
Replies start with one status byte: 0 and the body, or 1 and canonical JSON
``{"code", "message"}`` (``not_owner``, ``quota``, ``not_found``, ``bad_request``).
:func:`put_shards`, :func:`get_shards`, :func:`list_shards` and :func:`delete_shards`
are the client side; they raise the holder's error as its
:class:`~coordinator_free.checkpoints.errors.ShardRequestError` subclass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

from coordinator_free.checkpoints.errors import NotOwner, ShardRequestError, error_for_code
from coordinator_free.checkpoints.store import ShardStore, StoredSet
from coordinator_free.endpoint import Endpoint
from coordinator_free.erasure import (
    CorruptShard,
    ManifestInvalid,
    ShardSetManifest,
    decode_shards_message,
    encode_shards_message,
)
from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.manifest import canonical_json
from coordinator_free.peer_json import loads_bounded
from coordinator_free.wire import Envelope

__all__ = [
    "DELETE",
    "GET",
    "GLOBAL_OWNER",
    "LIST",
    "PUT",
    "STAGE",
    "ShardService",
    "delete_shards",
    "get_shards",
    "list_shards",
    "put_shards",
]

PUT = "shard.put"
GET = "shard.get"
LIST = "shard.list"
DELETE = "shard.delete"
STAGE = "shards"
GLOBAL_OWNER = "_global"
"""Owner id of the global-model history sets (org ids starting with ``_`` are reserved);
any member may read them, nobody may write them over the wire."""
_OK, _ERR = b"\x00", b"\x01"


# --------------------------------------------------------------------------- wire format


def _ok(body: bytes = b"") -> bytes:
    return _OK + body


def _json(obj: Any) -> bytes:
    return canonical_json(obj)


def _request(
    payload: bytes, required: Set[str], optional: Set[str] = frozenset()
) -> dict[str, Any]:
    obj = loads_bounded(payload, what="shard request")
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


def _unwrap(reply: bytes) -> memoryview:
    """The body of an OK reply (a view, no copy); raise the holder's error otherwise."""
    if reply[:1] == _OK:
        return memoryview(reply)[1:]
    try:
        obj = loads_bounded(bytes(reply[1:]), what="shard reply")
        code, message = str(obj["code"]), str(obj["message"])
    except (Refused, KeyError, TypeError):
        raise ShardRequestError("malformed reply from a shard holder") from None
    raise error_for_code(code)(message, code)


# --------------------------------------------------------------------------- holder side


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
    try:
        stored = loads_bounded(bytes(_unwrap(reply)), what="shard reply")["stored"]
        return [int(i) for i in stored]
    except (Refused, KeyError, TypeError, ValueError) as exc:
        raise ShardRequestError(f"{peer!r} sent a malformed reply: {exc}") from None


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
        entries = loads_bounded(bytes(_unwrap(reply)), what="shard list")["sets"]
        return [
            StoredSet(
                ShardSetManifest.from_json(e["manifest"]), tuple(int(i) for i in e["indices"])
            )
            for e in entries
        ]
    except (Refused, ValueError, KeyError, TypeError) as exc:
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
    try:
        return int(loads_bounded(bytes(_unwrap(reply)), what="shard reply")["deleted"])
    except (Refused, KeyError, TypeError, ValueError) as exc:
        raise ShardRequestError(f"{peer!r} sent a malformed reply: {exc}") from None
