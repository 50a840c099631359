"""The owner side of erasure-coded checkpoints of an org's private state.

:class:`CheckpointReplicator` seals the org's private state
(:mod:`coordinator_free.sealed`), codes it (:mod:`coordinator_free.erasure`), places the
shards by rendezvous hashing over the live members (:mod:`coordinator_free.placement`),
pushes them in parallel, keeps ``retention`` versions, and repairs the placement when
membership changes or a holder lost its shards. A version found on peers after
:func:`~coordinator_free.checkpoints.recovery.recover` is handed back with
:meth:`CheckpointReplicator.adopt`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from coordinator_free.checkpoints.errors import CheckpointFailed, ShardRequestError, describe
from coordinator_free.checkpoints.fetch import fetch_any_k, not_enough_shards
from coordinator_free.checkpoints.service import delete_shards, list_shards, put_shards
from coordinator_free.endpoint import Endpoint
from coordinator_free.erasure import (
    CodeParams,
    ErasureCodec,
    ManifestInvalid,
    ShardError,
    ShardSetManifest,
    encode_set,
)
from coordinator_free.errors import TransportError
from coordinator_free.membership import EventKind
from coordinator_free.placement import Placement, place, repair_plan, tolerated_losses
from coordinator_free.sealed import RecoverySecret, seal

__all__ = ["CheckpointReplicator", "RepairReport"]

logger = logging.getLogger(__name__)

_MESSAGE_SLACK = 64 << 10
"""Room left in a message for the envelope and the manifest around the shard bytes."""
_AUDIT_EVENTS = frozenset({EventKind.JOIN, EventKind.ALIVE})


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


def _batches(indices: list[int], shards: Mapping[int, bytes], limit: int) -> list[list[int]]:
    """``indices`` in order, cut into runs whose shards add up to at most ``limit``
    bytes (a single larger shard is a run of its own)."""
    out: list[list[int]] = []
    size = 0
    for index in indices:
        n = len(shards[index])
        if not out or size + n > limit:
            out.append([])
            size = 0
        out[-1].append(index)
        size += n
    return out


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
        limit = self.endpoint.guard.max_size - _MESSAGE_SLACK
        while indices:
            by_holder: dict[str, list[int]] = {}
            for index in sorted(indices):
                by_holder.setdefault(holders[index], []).append(index)
            # a holder that took over a failed holder's shard may get more than one
            # message can carry: one message per batch that fits
            puts = [
                (holder, batch)
                for holder, group in by_holder.items()
                for batch in _batches(group, shards, limit)
            ]
            results = await asyncio.gather(
                *(
                    put_shards(
                        self.endpoint,
                        holder,
                        current,
                        {i: shards[i] for i in batch},
                        timeout=self.timeout,
                    )
                    for holder, batch in puts
                ),
                return_exceptions=True,
            )
            retry: set[int] = set()
            for (holder, group), result in zip(puts, results, strict=True):
                if isinstance(result, BaseException):
                    if not isinstance(result, TransportError | ShardRequestError):
                        raise result
                    logger.warning(
                        "%s: %s did not take shards %s: %s",
                        self.me,
                        holder,
                        group,
                        describe(result),
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
        got, reasons = await fetch_any_k(self.endpoint, manifest, sources, timeout=self.timeout)
        if len(got) < manifest.k:
            raise not_enough_shards(manifest, got, reasons)
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
