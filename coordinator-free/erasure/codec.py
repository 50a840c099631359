"""The Reed-Solomon code with per-shard SHA-256: :class:`ErasureCodec` and its parameters.

An object is cut into ``k`` equal data shards (the last one zero-padded) and ``m``
parity shards are computed with zfec; any ``k`` of the ``k + m`` give it back. Shards
are hashed on a small thread pool while zfec codes (both release the GIL), and an
:class:`EncodedSet` carries the shards, their hashes and their RFC 6962 Merkle root
(:func:`merkle_root`).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import zfec
from coordinator_free.erasure.errors import CorruptShard, NotEnoughShards

__all__ = [
    "MAX_SHARDS",
    "CodeParams",
    "EncodedSet",
    "ErasureCodec",
    "hashing_threads",
    "merkle_root",
    "sha256_digest",
]

MAX_SHARDS = 256
"""zfec works over GF(2^8): at most 256 shards in a set."""
_PARALLEL_MIN_BYTES = 1 << 20


def sha256_digest(data: bytes | bytearray | memoryview) -> bytes:
    """SHA-256 of a buffer, read in place (hashlib releases the GIL on large inputs)."""
    return hashlib.sha256(data).digest()


def merkle_root(leaves: Sequence[bytes]) -> bytes:
    """RFC 6962 (Certificate Transparency) Merkle tree head over ``leaves``.

    ``MTH({}) = SHA-256()``, ``MTH({d}) = SHA-256(0x00 || d)`` and, for ``n > 1`` with
    ``k`` the largest power of two below ``n``,
    ``MTH(D[n]) = SHA-256(0x01 || MTH(D[0:k]) || MTH(D[k:n]))`` (RFC 6962 §2.1).
    """
    if not leaves:
        return hashlib.sha256(b"").digest()
    if len(leaves) == 1:
        return hashlib.sha256(b"\x00" + leaves[0]).digest()
    split = 1 << ((len(leaves) - 1).bit_length() - 1)
    return hashlib.sha256(
        b"\x01" + merkle_root(leaves[:split]) + merkle_root(leaves[split:])
    ).digest()


@dataclass(frozen=True)
class CodeParams:
    """Reed-Solomon parameters: ``k`` data shards, ``m`` parity shards.

    Any ``k`` of the ``k + m`` shards rebuild the object, so the set survives the loss of
    any ``m`` shards, and stores ``(k + m) / k`` times the object's size in total.
    """

    k: int = 4
    m: int = 2

    def __post_init__(self) -> None:
        for name in ("k", "m"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"CodeParams.{name} must be an int")
        if self.k < 1:
            raise ValueError(f"CodeParams.k must be at least 1, got {self.k}")
        if self.m < 0:
            raise ValueError(f"CodeParams.m must be non-negative, got {self.m}")
        if self.k + self.m > MAX_SHARDS:
            raise ValueError(f"k + m must be at most {MAX_SHARDS}, got {self.k + self.m}")

    @property
    def n(self) -> int:
        """Total shards in a set."""
        return self.k + self.m


_POOL_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None


def hashing_threads() -> int:
    """Threads of the shard-hashing pool: one fewer than the CPUs this process may use
    (the calling thread runs zfec meanwhile, and hashes too once it is done), 1 to 4."""
    return max(1, min(4, _cpus() - 1))


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            workers = hashing_threads()
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fedweave-shard")
        return _POOL


class _ShardHashes:
    """SHA-256 of whole shards, on the pool while the caller codes (``parallel``) or inline.

    :meth:`add` queues a shard (on the pool, hashlib releases the GIL, as zfec does while
    it codes); :meth:`digests` first hashes, in the caller's thread, every queued shard
    no pool thread has started yet (from the last one back, the pool takes them from the
    front), so that the caller never waits idle for work it could do itself.
    """

    def __init__(self, parallel: bool) -> None:
        self._parallel = parallel
        self._jobs: dict[int, tuple[memoryview | bytes, Future[bytes] | None]] = {}

    def add(self, index: int, shard: memoryview | bytes) -> None:
        future = _pool().submit(sha256_digest, shard) if self._parallel else None
        self._jobs[index] = (shard, future)

    def digests(self) -> dict[int, bytes]:
        done: dict[int, bytes] = {}
        for index in reversed(self._jobs):
            shard, future = self._jobs[index]
            if future is None or future.cancel():
                done[index] = sha256_digest(shard)
        for index, (_, future) in self._jobs.items():
            if index not in done and future is not None:
                done[index] = future.result()
        return done


@dataclass(frozen=True)
class EncodedSet:
    """The shards of one object and their SHA-256 hashes (index ``i`` is shard ``i``)."""

    params: CodeParams
    size: int
    shard_size: int
    shards: tuple[memoryview | bytes, ...]
    hashes: tuple[bytes, ...]

    @property
    def root(self) -> bytes:
        """Merkle root over the shard hashes."""
        return merkle_root(self.hashes)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class ErasureCodec:
    """zfec Reed-Solomon with per-shard SHA-256, for one :class:`CodeParams`.

    zfec codes whole shards (so each parity shard is returned as it is, never joined
    from pieces) in a few calls (:func:`_parity_groups`), releasing the GIL while it
    does; with ``parallel`` the shards are hashed on a thread pool meanwhile: the data
    shards during the first call, each call's parity shards during the next one. Only
    the last parity shard's hash (on encode) is left after the coding. ``parallel`` is on by
    default when this process may use at least two CPUs, and only for objects of at
    least ``parallel_min_bytes`` (below that, handing work to a thread costs more than
    it saves). Shards and hashes are the same either way.
    """

    def __init__(
        self,
        params: CodeParams,
        *,
        parallel: bool | None = None,
        parallel_min_bytes: int = _PARALLEL_MIN_BYTES,
    ) -> None:
        self.params = params
        self.parallel = _cpus() >= 2 if parallel is None else parallel
        self.parallel_min_bytes = parallel_min_bytes
        self._encoder = zfec.Encoder(params.k, params.n)
        self._decoder = zfec.Decoder(params.k, params.n)

    @staticmethod
    def shard_size_for(size: int, k: int) -> int:
        """Bytes per shard for an object of ``size`` bytes (at least 1)."""
        return max(1, -(-size // k))

    def _blocks(self, data: memoryview) -> tuple[memoryview, ...]:
        """The k data shards: views into ``data``, only the last one copied and padded."""
        k = self.params.k
        shard = self.shard_size_for(len(data), k)
        blocks: list[memoryview] = []
        for i in range(k):
            piece = data[i * shard : (i + 1) * shard]
            if len(piece) < shard:
                padded = bytearray(shard)
                padded[: len(piece)] = piece
                piece = memoryview(padded)
            blocks.append(piece)
        return tuple(blocks)

    def _threads(self, total: int) -> bool:
        return self.parallel and total >= self.parallel_min_bytes

    def encode(self, data: bytes | bytearray | memoryview) -> EncodedSet:
        """Cut ``data`` into k data shards, compute m parity shards, hash all of them."""
        view = memoryview(data).cast("B")
        blocks = self._blocks(view)
        k, n = self.params.k, self.params.n
        hashes = _ShardHashes(self._threads(len(view)))
        for index, block in enumerate(blocks):
            hashes.add(index, block)
        parity: list[bytes] = []
        for group in _parity_groups(k, n):
            for index, piece in zip(group, self._encoder.encode(blocks, group), strict=True):
                parity.append(piece)
                hashes.add(index, piece)
        digests = hashes.digests()
        return EncodedSet(
            params=self.params,
            size=len(view),
            shard_size=len(blocks[0]),
            shards=blocks + tuple(parity),
            hashes=tuple(digests[i] for i in range(n)),
        )

    def decode(
        self,
        shards: Mapping[int, bytes | bytearray | memoryview],
        size: int,
        hashes: Sequence[bytes] | None = None,
    ) -> bytes:
        """Rebuild the object from any k shards (``index -> bytes``).

        With ``hashes`` (the manifest's), every shard used is checked against its hash
        (on the pool while zfec decodes, with ``parallel``) before anything is returned;
        a corrupt shard is set aside and another one used instead. Raises
        :class:`NotEnoughShards` when fewer than k intact shards are given.
        """
        k, n = self.params.k, self.params.n
        if hashes is not None and len(hashes) != n:
            raise ValueError(f"expected {n} shard hashes, got {len(hashes)}")
        shard_size = self.shard_size_for(size, k)
        available: dict[int, memoryview] = {}
        for index, buffer in shards.items():
            if not 0 <= index < n:
                raise ValueError(f"shard index {index} is outside 0..{n - 1}")
            view = memoryview(buffer).cast("B")
            if len(view) != shard_size:
                raise CorruptShard(index, f"{len(view)} bytes, expected {shard_size}")
            available[index] = view
        corrupt: list[int] = []
        # Data shards first: when all k are intact, decoding is a concatenation.
        order = sorted(available)
        while True:
            chosen = order[:k]
            if len(chosen) < k:
                missing = [i for i in range(n) if i not in available or i in corrupt]
                raise NotEnoughShards(k, len(chosen), missing, corrupt=corrupt)
            views = [available[i] for i in chosen]
            checks = _ShardHashes(self._threads(k * shard_size))
            if hashes is not None:
                for index, view in zip(chosen, views, strict=True):
                    checks.add(index, view)
            if chosen == list(range(k)):
                pieces: Sequence[memoryview | bytes] = views
            else:
                # zfec reorders the lists it is given in place: give it copies.
                pieces = self._decoder.decode(list(views), list(chosen))
            digests = checks.digests()
            bad = [i for i in chosen if hashes is not None and digests[i] != hashes[i]]
            if not bad:
                return _join(pieces, size)
            corrupt.extend(bad)
            order = [i for i in order if i not in bad]

    def regenerate(
        self, shards: Mapping[int, bytes | bytearray | memoryview], size: int, wanted: Sequence[int]
    ) -> dict[int, bytes]:
        """Recompute the shards ``wanted`` from any k intact ones (used by repair)."""
        data = self.decode(shards, size)
        encoded = self.encode(data)
        return {i: bytes(encoded.shards[i]) for i in wanted}


def _parity_groups(k: int, n: int) -> list[tuple[int, ...]]:
    """The parity shards ``k .. n-1`` in the groups zfec computes them in, one call each.

    One call for all reads the data shards once (zfec walks them in 8 KiB strides for
    every output), but nothing can be hashed before it returns. So the last group is one
    shard (its hash is all that is left after the coding), the one before it up to ``k``
    shards (hashing them costs about what zfec spends on one parity shard of ``k``
    inputs), the one before that up to ``k**2``, and so on; the first takes the rest.
    """
    groups: list[tuple[int, ...]] = []
    end, size = n, 1
    while end > k:
        start = max(k, end - size)
        groups.append(tuple(range(start, end)))
        end, size = start, size * k
    return groups[::-1]


def _join(blocks: Sequence[memoryview | bytes], size: int) -> bytes:
    """Concatenate decoded data shards, dropping the padding, in one copy."""
    views: list[memoryview] = []
    left = size
    for block in blocks:
        view = memoryview(block).cast("B")
        if left <= 0:
            break
        views.append(view[:left] if len(view) > left else view)
        left -= len(view)
    return b"".join(views)
