"""Recovery: a node with an empty disk rebuilds its private state from its peers.

:func:`recover` asks every peer what it holds for the org (:func:`survey`), keeps the
manifests the org's own key signed, takes the newest version (or the one asked for) at
its latest placement epoch, fetches any ``k`` shards in parallel from the holders that
reported them (:func:`sources_of`,
:func:`~coordinator_free.checkpoints.fetch.fetch_any_k`), verifies each against the
manifest, decodes and decrypts (:mod:`coordinator_free.sealed`). :func:`recover_sets`
does the same for every set of the org whose id starts with a prefix (one per run of a
node's private state), so that a wiped node gets back every run it was in, not only
the one whose version number happens to be highest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from coordinator_free.checkpoints.errors import NoCheckpoint, describe
from coordinator_free.checkpoints.fetch import fetch_any_k, not_enough_shards
from coordinator_free.checkpoints.service import list_shards
from coordinator_free.checkpoints.store import StoredSet
from coordinator_free.endpoint import Endpoint
from coordinator_free.erasure import (
    ErasureCodec,
    ManifestInvalid,
    ShardError,
    ShardSetManifest,
    decode_set,
)
from coordinator_free.errors import TransportError
from coordinator_free.files import atomic_write
from coordinator_free.sealed import RecoverySecret, open_sealed

__all__ = ["RecoveredCheckpoint", "recover", "recover_sets", "sources_of", "survey"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveredCheckpoint:
    """A recovered private state: its version (round), plaintext and manifest."""

    version: int
    state: bytes = field(repr=False)
    manifest: ShardSetManifest

    def write(self, path: Path) -> None:
        """Write the state atomically (temporary file, fsync, rename), mode 0600."""
        atomic_write(Path(path), self.state)


async def survey(
    endpoint: Endpoint, peers: Sequence[str], owner: str, set_id: str | None, timeout: float
) -> tuple[dict[str, list[StoredSet]], dict[str, str]]:
    """What each of ``peers`` holds for ``owner``, and why each one that could not
    answer did not."""
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
            failures[peer] = describe(result)
        else:
            held[peer] = result
    return held, failures


def sources_of(
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


def _signed_candidates(
    me: str, key: bytes, set_id: str, held: Mapping[str, Sequence[StoredSet]]
) -> dict[tuple[int, int], ShardSetManifest]:
    """The manifests of our ``set_id`` that our own key signed, by (version, epoch)."""
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
    return candidates


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
    asked = sorted({p for p in peers if p != me})
    held, failures = await survey(endpoint, asked, me, set_id, min(timeout, 15.0))
    return await _recover_set(
        endpoint, secret, held, failures, len(asked), set_id, version, timeout
    )


async def recover_sets(
    endpoint: Endpoint,
    secret: RecoverySecret,
    peers: Iterable[str],
    *,
    prefix: str,
    legacy: str | None = None,
    timeout: float = 60.0,
) -> tuple[dict[str, RecoveredCheckpoint], dict[str, str]]:
    """The newest checkpoint of every set of this org whose id starts with ``prefix``
    (and of the set ``legacy``, when given), and why each set that could not be
    rebuilt was not. Raises :class:`NoCheckpoint` when no peer holds any such set."""
    me = endpoint.org_id
    asked = sorted({p for p in peers if p != me})
    held, failures = await survey(endpoint, asked, me, None, min(timeout, 15.0))
    sets = sorted(
        {
            s.manifest.set_id
            for stored in held.values()
            for s in stored
            if s.manifest.set_id.startswith(prefix) or s.manifest.set_id == legacy
        }
    )
    got: dict[str, RecoveredCheckpoint] = {}
    lost: dict[str, str] = {}
    for set_id in sets:
        try:
            got[set_id] = await _recover_set(
                endpoint, secret, held, failures, len(asked), set_id, None, timeout
            )
        except (NoCheckpoint, ShardError) as exc:
            lost[set_id] = str(exc)
    if not got and not lost:
        unreachable = ", ".join(f"{p} ({why})" for p, why in sorted(failures.items()))
        raise NoCheckpoint(
            f"no reachable peer holds a checkpoint of {me!r}; asked {len(asked)} peers"
            + (f", unreachable: {unreachable}" if unreachable else "")
        )
    return got, lost


async def _recover_set(
    endpoint: Endpoint,
    secret: RecoverySecret,
    held: Mapping[str, Sequence[StoredSet]],
    failures: Mapping[str, str],
    asked: int,
    set_id: str,
    version: int | None,
    timeout: float,
) -> RecoveredCheckpoint:
    """:func:`recover` of one set, from what the peers said they hold."""
    me = endpoint.org_id
    candidates = _signed_candidates(me, endpoint.identity.public_key, set_id, held)
    if version is not None:
        candidates = {vk: m for vk, m in candidates.items() if vk[0] == version}
    if not candidates:
        unreachable = ", ".join(f"{p} ({why})" for p, why in sorted(failures.items()))
        what = f"{set_id}@{version}" if version is not None else set_id
        raise NoCheckpoint(
            f"no reachable peer holds a checkpoint {what} of {me!r}; asked {asked} "
            f"peers" + (f", unreachable: {unreachable}" if unreachable else "")
        )
    manifest = candidates[max(candidates)]
    sources = sources_of(manifest, held)
    got, reasons = await fetch_any_k(endpoint, manifest, sources, timeout=timeout)
    for index, holders in sources.items():
        for holder in holders:
            if holder in failures and index not in got:
                reasons.setdefault(index, f"{holder}: {failures[holder]}")
    if len(got) < manifest.k:
        error = not_enough_shards(manifest, got, reasons)
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
