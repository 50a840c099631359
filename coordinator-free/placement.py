"""Where shards go: rendezvous hashing over the live members, and repair plans.

Rendezvous (highest-random-weight) hashing, Thaler and Ravishankar, *Using name-based
mappings to increase hit rates* (IEEE/ACM ToN 1998): shard ``i`` of set ``key`` scores
every candidate ``c`` as ``SHA-256(b"fedweave/hrw/v1\\0" || key || "#" || i || "\\0" || c)``
read as a 64-bit integer, and goes to the best-scoring candidate not already loaded more
than the others. With at least ``k + m`` candidates every shard lands on a different
org, so any ``m`` of them may fail; with fewer, shards are spread as evenly as possible
and :meth:`Placement.tolerated_losses` says how many losses remain survivable.

Every node computes the same placement from the same inputs (no coordination), and a
membership change moves as few shards as possible: :func:`repair_plan` keeps every
shard whose holder is still live, re-places only the others (each on its next-best
candidate) and, when new members make it possible, spreads shards off any holder that
has more than one.

This module is pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "Placement",
    "RepairPlan",
    "hrw_score",
    "place",
    "rank",
    "repair_plan",
    "tolerated_losses",
]

_DOMAIN = b"fedweave/hrw/v1\x00"


def hrw_score(key: str, candidate: str) -> int:
    """The rendezvous weight of ``candidate`` for ``key`` (64-bit, from SHA-256)."""
    digest = hashlib.sha256(_DOMAIN + key.encode() + b"\x00" + candidate.encode()).digest()
    return int.from_bytes(digest[:8], "big")


def rank(key: str, candidates: Iterable[str]) -> list[str]:
    """``candidates`` ordered by decreasing weight for ``key`` (ties by id)."""
    return sorted(set(candidates), key=lambda c: (-hrw_score(key, c), c))


def _shard_key(set_key: str, index: int) -> str:
    return f"{set_key}#{index}"


def tolerated_losses(holders: Sequence[str], k: int) -> int:
    """How many holders may fail, any of them, with ``k`` shards still held.

    Unplaced shards (holder ``""``) count as already lost. Returns -1 when fewer than
    ``k`` shards are placed at all.
    """
    placed = [h for h in holders if h]
    if len(placed) < k:
        return -1
    spare = len(placed) - k
    losses = 0
    for load in sorted(Counter(placed).values(), reverse=True):
        if load > spare:
            break
        spare -= load
        losses += 1
    return losses


@dataclass(frozen=True)
class Placement:
    """The holder of each shard of one set (index ``i`` -> ``holders[i]``)."""

    set_key: str
    holders: tuple[str, ...]

    def shards_of(self, holder: str) -> list[int]:
        """Indices placed on ``holder``."""
        return [i for i, h in enumerate(self.holders) if h == holder]

    def tolerated_losses(self, k: int) -> int:
        """See :func:`tolerated_losses`."""
        return tolerated_losses(self.holders, k)


def _pick(set_key: str, index: int, candidates: Sequence[str], load: Mapping[str, int]) -> str:
    key = _shard_key(set_key, index)
    return min(candidates, key=lambda c: (load.get(c, 0), -hrw_score(key, c), c))


def place(set_key: str, n_shards: int, candidates: Iterable[str]) -> Placement:
    """Place ``n_shards`` shards of ``set_key`` on ``candidates`` (least loaded, then
    highest weight). Raises ``ValueError`` when there is no candidate."""
    pool = sorted(set(candidates))
    if not pool:
        raise ValueError("no candidate holders to place shards on")
    if n_shards < 1:
        raise ValueError("n_shards must be positive")
    load: Counter[str] = Counter()
    holders: list[str] = []
    for index in range(n_shards):
        chosen = _pick(set_key, index, pool, load)
        load[chosen] += 1
        holders.append(chosen)
    return Placement(set_key, tuple(holders))


@dataclass(frozen=True)
class RepairPlan:
    """What repair must do: ``moves[i] = (old holder or "", new holder)``."""

    before: Placement
    after: Placement
    moves: Mapping[int, tuple[str, str]]

    @property
    def empty(self) -> bool:
        return not self.moves


def repair_plan(current: Placement, live: Iterable[str]) -> RepairPlan:
    """Re-place the shards of ``current`` whose holder is not in ``live``.

    Shards on live holders stay put, except that a holder with more than one shard gives
    its extra shards to live candidates holding none (after a join), so that the set
    survives as many losses as the live membership allows.
    """
    pool = sorted(set(live))
    holders = list(current.holders)
    if not pool:
        return RepairPlan(current, current, {})
    load: Counter[str] = Counter(h for h in holders if h in pool)
    moves: dict[int, tuple[str, str]] = {}
    for index, holder in enumerate(holders):
        if holder not in pool:
            chosen = _pick(current.set_key, index, pool, load)
            load[chosen] += 1
            moves[index] = (holder, chosen)
            holders[index] = chosen
    # Spread: move a shard off the most loaded holder while someone holds none.
    while True:
        idle = [c for c in pool if load[c] == 0]
        heavy = max(pool, key=lambda c: (load[c], c))
        if not idle or load[heavy] <= 1:
            break
        index = max(
            (i for i, h in enumerate(holders) if h == heavy),
            key=lambda i: (-hrw_score(_shard_key(current.set_key, i), heavy), i),
        )
        chosen = _pick(current.set_key, index, idle, load)
        load[heavy] -= 1
        load[chosen] += 1
        original = moves.get(index, (current.holders[index], ""))[0]
        moves[index] = (original, chosen)
        holders[index] = chosen
    return RepairPlan(current, Placement(current.set_key, tuple(holders)), moves)
