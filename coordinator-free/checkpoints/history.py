"""The federation's global-model history, coded across the members.

Every node holds the same model, and the code is deterministic, so each node computes
all shards of a version itself and keeps only those placed on it (in its own
:class:`~coordinator_free.checkpoints.store.ShardStore`, under the reserved owner
:data:`~coordinator_free.checkpoints.service.GLOBAL_OWNER` and set :data:`GLOBAL_SET`):
no bytes travel until a node must rebuild a version or repair its own share. The sets
carry no signature and no encryption; every member may read them, and a rebuilt
version is checked against the model hash the members gossiped.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Iterable, Sequence

from coordinator_free.checkpoints.errors import NoCheckpoint
from coordinator_free.checkpoints.fetch import fetch_any_k
from coordinator_free.checkpoints.recovery import sources_of, survey
from coordinator_free.checkpoints.service import GLOBAL_OWNER
from coordinator_free.checkpoints.store import ShardStore, StoredSet
from coordinator_free.endpoint import Endpoint
from coordinator_free.erasure import (
    CodeParams,
    EncodedSet,
    ErasureCodec,
    ManifestInvalid,
    NotEnoughShards,
    ShardSetManifest,
    decode_set,
    encode_set,
)
from coordinator_free.placement import Placement, place

__all__ = ["GLOBAL_SET", "GlobalHistoryStore"]

GLOBAL_SET = "global"
"""Set id of the global-model history (owner :data:`GLOBAL_OWNER`)."""


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
    ) -> tuple[ShardSetManifest, EncodedSet]:
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
        held, failures = await survey(
            self.endpoint, asked, GLOBAL_OWNER, GLOBAL_SET, min(self.timeout, 15.0)
        )
        local = self.store.list(GLOBAL_OWNER, GLOBAL_SET)
        manifest = _first_match([local, *held.values()], version, model_sha256)
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
            for i, srcs in sources_of(manifest, held).items()
            if i not in shards
        }
        if len(shards) < manifest.k:
            got, reasons = await fetch_any_k(
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
        held, _ = await survey(
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


def _first_match(
    listings: Iterable[Sequence[StoredSet]], version: int, model_sha256: str
) -> ShardSetManifest | None:
    """The first manifest of ``version`` whose content hash is ``model_sha256``."""
    for sets in listings:
        for stored in sets:
            m = stored.manifest
            if m.version == version and m.content_sha256 == model_sha256:
                return m
    return None
