"""The errors of shard sets: a malformed or badly signed manifest, a corrupt shard,
too few intact shards to decode."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from coordinator_free.errors import CoordinatorFreeError

__all__ = ["CorruptShard", "ManifestInvalid", "NotEnoughShards", "ShardError"]


class ShardError(CoordinatorFreeError):
    """Base of the shard-set errors."""


class ManifestInvalid(ShardError):
    """A shard-set manifest is malformed, inconsistent or badly signed."""


class CorruptShard(ShardError):
    """A shard's bytes do not hash to the value the manifest gives for its index."""

    def __init__(self, index: int, detail: str = "") -> None:
        self.index = index
        super().__init__(f"shard {index} is corrupt" + (f": {detail}" if detail else ""))


class NotEnoughShards(ShardError):
    """Fewer than ``k`` intact shards are available.

    ``missing`` lists the shard indices that could not be used; ``corrupt`` those of
    them whose bytes failed their hash; ``holders`` maps each missing index to where the
    manifest placed it (``""`` if unknown); ``reasons`` maps it to why it is missing.
    """

    def __init__(
        self,
        needed: int,
        have: int,
        missing: Sequence[int],
        *,
        corrupt: Sequence[int] = (),
        holders: Mapping[int, str] | None = None,
        reasons: Mapping[int, str] | None = None,
    ) -> None:
        self.needed = needed
        self.have = have
        self.missing = tuple(sorted(missing))
        self.corrupt = tuple(sorted(corrupt))
        self.holders = dict(holders or {})
        self.reasons = dict(reasons or {})
        parts = []
        for index in self.missing:
            where = self.holders.get(index) or "unknown holder"
            why = self.reasons.get(index) or ("corrupt" if index in self.corrupt else "missing")
            parts.append(f"#{index} on {where} ({why})")
        super().__init__(
            f"need {needed} intact shards, have {have}; unavailable: " + ", ".join(parts)
        )
