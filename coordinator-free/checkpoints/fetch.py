"""Fetching any ``k`` verified shards of a set from its holders, in parallel.

Used by recovery (a wiped org rebuilding its state), by the replicator (regenerating
shards to move when nothing is cached) and by the global-model history (rebuilding a
version). Each shard is checked against the trusted manifest as it arrives, so the
decoder gets only intact shards.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence

from coordinator_free.checkpoints.errors import ShardNotFound, ShardRequestError, describe
from coordinator_free.checkpoints.service import get_shards
from coordinator_free.endpoint import Endpoint
from coordinator_free.erasure import CorruptShard, NotEnoughShards, ShardError, ShardSetManifest
from coordinator_free.errors import TransportError

__all__ = ["fetch_any_k", "not_enough_shards"]


async def _fetch_one(
    endpoint: Endpoint,
    manifest: ShardSetManifest,
    index: int,
    holders: Sequence[str],
    timeout: float,
) -> memoryview:
    """Shard ``index`` from the first of ``holders`` that returns it intact; raise
    :class:`ShardError` naming why each holder failed otherwise."""
    why: list[str] = []
    for holder in holders:
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
            why.append(f"{holder}: {describe(exc)}")
    raise ShardError("; ".join(why))


async def fetch_any_k(
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
    running: dict[asyncio.Task[memoryview], int] = {}

    def launch() -> None:
        while queue and len(running) + len(got) < k:
            index = queue.pop(0)
            fetch = _fetch_one(endpoint, manifest, index, sources[index], timeout)
            running[asyncio.create_task(fetch)] = index

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


def not_enough_shards(
    manifest: ShardSetManifest, got: Mapping[int, object], reasons: Mapping[int, str]
) -> NotEnoughShards:
    """The error for a fetch that found fewer than ``k`` intact shards of ``manifest``:
    each missing shard with the holder it was placed on and why it is missing."""
    missing = [i for i in range(manifest.k + manifest.m) if i not in got]
    return NotEnoughShards(
        manifest.k,
        len(got),
        missing,
        holders={i: manifest.holders[i] for i in missing},
        reasons=reasons,
    )
