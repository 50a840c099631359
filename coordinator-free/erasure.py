"""Reed-Solomon shard sets: the codec, the signed shard-set manifest, its Merkle root.

An object (an org's sealed private state, or one version of the global model) of
``size`` bytes is cut into ``k`` equal data shards (the last one zero-padded) and ``m``
parity shards are computed with zfec's systematic Reed-Solomon code over GF(2^8)
(Rizzo, *Effective erasure codes for reliable computer communication protocols*,
SIGCOMM CCR 1997): any ``k`` of the ``k + m`` shards give the object back.

Each shard is identified by its SHA-256. A :class:`ShardSetManifest` describes the set:
owner, set id, version (the round), placement epoch, ``k``, ``m``, sizes, every shard
hash, the RFC 6962 Merkle tree head over those hashes, the holder of each shard, and,
for sets without a single owner (the global model), the SHA-256 of the whole object as
gossiped by the round engine. An owned set's manifest is signed with the owner's
Ed25519 key over ``b"fedweave/shardset/v1\\x00" + canonical JSON body``; only the
manifest is signed, never the bulk data, whose integrity follows from the signed hashes.

Cost: hashing is what costs next to the code itself, so shards are hashed with
``hashlib.sha256`` on memoryviews (no copies) on a small thread pool while zfec codes
(both release the GIL): on encode the data shards while zfec computes the first parity
shards and those while it computes the next ones; on decode the k shards used while
zfec rebuilds the missing data shards. The decoded object is not hashed again: every
shard it comes from was checked against the manifest, which signs ``size`` too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import zfec
from coordinator_free.errors import CoordinatorFreeError
from coordinator_free.identity import OrgIdentity, verify_signature
from coordinator_free.manifest import canonical_json

__all__ = [
    "FORMAT",
    "MAX_SHARDS",
    "CodeParams",
    "CorruptShard",
    "EncodedSet",
    "ErasureCodec",
    "ManifestInvalid",
    "NotEnoughShards",
    "ShardError",
    "ShardSetManifest",
    "decode_set",
    "decode_shards_message",
    "encode_set",
    "encode_shards_message",
    "hashing_threads",
    "merkle_root",
    "sha256_digest",
]

FORMAT = "fedweave/shardset/v1"
SIGNING_DOMAIN = b"fedweave/shardset/v1\x00"
MAX_SHARDS = 256
"""zfec works over GF(2^8): at most 256 shards in a set."""
_PARALLEL_MIN_BYTES = 1 << 20
_ID = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")
_WIRE_MAGIC = b"FWS\x01"


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


def _check_id(value: str, what: str) -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise ManifestInvalid(f"{what} must match {_ID.pattern}, got {value!r}")
    return value


def _check_uint(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise ManifestInvalid(f"{what} must be a non-negative integer")
    return value


@dataclass(frozen=True)
class ShardSetManifest:
    """What a shard set is, where its shards are, and who vouches for it.

    owner: the org whose set this is (it signs the manifest); for the global model
        history, :data:`coordinator_free.checkpoints.GLOBAL_OWNER` and no signature.
    set_id: which object of the owner (``state`` for private state, ``global``...).
    version: the object's version, the training round it was taken at.
    epoch: placement revision; raised each time repair moves shards.
    k, m: Reed-Solomon parameters.
    size: bytes of the coded object; shard_size: bytes of each shard.
    shard_hashes: SHA-256 of each shard, by index.
    merkle_root: RFC 6962 tree head over ``shard_hashes``.
    holders: the org placed to hold each shard (``""`` where none is).
    content_sha256: SHA-256 of the whole object, hex; set for unsigned (global) sets,
        whose trust comes from the model hash gossiped by the round engine.
    created_at: unix seconds.
    signature: the owner's Ed25519 signature (empty for unsigned sets).
    """

    owner: str
    set_id: str
    version: int
    epoch: int
    k: int
    m: int
    size: int
    shard_size: int
    shard_hashes: tuple[bytes, ...]
    merkle_root: bytes
    holders: tuple[str, ...]
    created_at: int
    content_sha256: str = ""
    signature: bytes = field(default=b"", compare=False)

    def __post_init__(self) -> None:
        _check_id(self.owner, "owner")
        _check_id(self.set_id, "set_id")
        for name in ("version", "epoch", "size", "created_at"):
            _check_uint(getattr(self, name), name)
        try:
            params = CodeParams(self.k, self.m)
        except (TypeError, ValueError) as exc:
            raise ManifestInvalid(str(exc)) from None
        if self.shard_size != ErasureCodec.shard_size_for(self.size, self.k):
            raise ManifestInvalid("shard_size does not match size and k")
        if len(self.shard_hashes) != params.n or any(
            not isinstance(h, bytes) or len(h) != 32 for h in self.shard_hashes
        ):
            raise ManifestInvalid(f"expected {params.n} SHA-256 shard hashes")
        if len(self.holders) != params.n or any(not isinstance(h, str) for h in self.holders):
            raise ManifestInvalid(f"expected {params.n} holders")
        if self.merkle_root != merkle_root(self.shard_hashes):
            raise ManifestInvalid("merkle_root does not match the shard hashes")
        if self.content_sha256 and not re.fullmatch(r"[0-9a-f]{64}", self.content_sha256):
            raise ManifestInvalid("content_sha256 must be 64 lowercase hex digits")

    @property
    def params(self) -> CodeParams:
        return CodeParams(self.k, self.m)

    @property
    def key(self) -> tuple[str, str, int]:
        """``(owner, set_id, version)``: what identifies the coded object."""
        return (self.owner, self.set_id, self.version)

    def body(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "owner": self.owner,
            "set_id": self.set_id,
            "version": self.version,
            "epoch": self.epoch,
            "k": self.k,
            "m": self.m,
            "size": self.size,
            "shard_size": self.shard_size,
            "shard_hashes": [h.hex() for h in self.shard_hashes],
            "merkle_root": self.merkle_root.hex(),
            "holders": list(self.holders),
            "created_at": self.created_at,
            "content_sha256": self.content_sha256,
        }

    def signing_bytes(self) -> bytes:
        """Domain tag followed by the canonical JSON body (everything but the signature)."""
        return SIGNING_DOMAIN + canonical_json(self.body())

    @property
    def digest(self) -> str:
        """SHA-256 of the canonical body, hex."""
        return hashlib.sha256(canonical_json(self.body())).hexdigest()

    def sign(self, identity: OrgIdentity) -> ShardSetManifest:
        """This manifest signed by its owner."""
        if identity.org_id != self.owner:
            raise ManifestInvalid(f"{identity.org_id!r} cannot sign a set owned by {self.owner!r}")
        return replace(self, signature=identity.sign(self.signing_bytes()))

    def verify(self, owner_public_key: bytes) -> None:
        """Raise :class:`ManifestInvalid` unless the owner's signature is valid."""
        if not verify_signature(owner_public_key, self.signing_bytes(), self.signature):
            raise ManifestInvalid(
                f"manifest of {self.owner}/{self.set_id}@{self.version} has a bad signature"
            )

    def with_holders(self, holders: Sequence[str], epoch: int) -> ShardSetManifest:
        """A copy with a new placement (unsigned: sign it again)."""
        return replace(self, holders=tuple(holders), epoch=epoch, signature=b"")

    def to_json(self) -> bytes:
        obj = self.body()
        obj["signature"] = self.signature.hex()
        return canonical_json(obj)

    @classmethod
    def from_json(cls, data: bytes | str) -> ShardSetManifest:
        """Parse a manifest; any malformation is :class:`ManifestInvalid`."""
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise ManifestInvalid("manifest is not JSON") from None
        expected = {
            "format",
            "owner",
            "set_id",
            "version",
            "epoch",
            "k",
            "m",
            "size",
            "shard_size",
            "shard_hashes",
            "merkle_root",
            "holders",
            "created_at",
            "content_sha256",
            "signature",
        }
        if not isinstance(obj, dict) or set(obj) != expected:
            raise ManifestInvalid("manifest fields are not the expected ones")
        if obj["format"] != FORMAT:
            raise ManifestInvalid(f"unknown manifest format {obj['format']!r}")
        try:
            hashes = tuple(bytes.fromhex(h) for h in obj["shard_hashes"])
            root = bytes.fromhex(obj["merkle_root"])
            signature = bytes.fromhex(obj["signature"])
            holders = tuple(obj["holders"])
        except (TypeError, ValueError, AttributeError):
            raise ManifestInvalid("manifest hex fields are malformed") from None
        for name in ("owner", "set_id", "content_sha256"):
            if not isinstance(obj[name], str):
                raise ManifestInvalid(f"{name} must be a string")
        for name in ("version", "epoch", "k", "m", "size", "shard_size", "created_at"):
            _check_uint(obj[name], name)
        try:
            return cls(
                owner=obj["owner"],
                set_id=obj["set_id"],
                version=obj["version"],
                epoch=obj["epoch"],
                k=obj["k"],
                m=obj["m"],
                size=obj["size"],
                shard_size=obj["shard_size"],
                shard_hashes=hashes,
                merkle_root=root,
                holders=holders,
                created_at=obj["created_at"],
                content_sha256=obj["content_sha256"],
                signature=signature,
            )
        except (TypeError, ValueError) as exc:
            raise ManifestInvalid(str(exc)) from None

    def check_shard(self, index: int, data: bytes | bytearray | memoryview) -> None:
        """Raise :class:`CorruptShard` unless ``data`` is shard ``index`` of this set."""
        if not 0 <= index < self.k + self.m:
            raise CorruptShard(index, "index outside the set")
        if len(data) != self.shard_size:
            raise CorruptShard(index, f"{len(data)} bytes, expected {self.shard_size}")
        if sha256_digest(data) != self.shard_hashes[index]:
            raise CorruptShard(index, "SHA-256 mismatch")


def encode_set(
    data: bytes | bytearray | memoryview,
    *,
    params: CodeParams,
    owner: str,
    set_id: str,
    version: int,
    created_at: int,
    holders: Sequence[str] | None = None,
    identity: OrgIdentity | None = None,
    content_sha256: str = "",
    codec: ErasureCodec | None = None,
) -> tuple[ShardSetManifest, EncodedSet]:
    """Code ``data`` and describe it: the (signed, with ``identity``) manifest and shards."""
    codec = codec or ErasureCodec(params)
    if codec.params != params:
        raise ValueError("codec parameters differ from params")
    encoded = codec.encode(data)
    manifest = ShardSetManifest(
        owner=owner,
        set_id=set_id,
        version=version,
        epoch=0,
        k=params.k,
        m=params.m,
        size=encoded.size,
        shard_size=encoded.shard_size,
        shard_hashes=encoded.hashes,
        merkle_root=encoded.root,
        holders=tuple(holders) if holders is not None else ("",) * params.n,
        created_at=created_at,
        content_sha256=content_sha256,
    )
    if identity is not None:
        manifest = manifest.sign(identity)
    return manifest, encoded


def decode_set(
    manifest: ShardSetManifest,
    shards: Mapping[int, bytes | bytearray | memoryview],
    *,
    owner_public_key: bytes | None = None,
    codec: ErasureCodec | None = None,
    verified: bool = False,
) -> bytes:
    """Verify (signature when a key is given, each shard's hash) and decode a set.

    Corrupt shards are set aside and others used; :class:`NotEnoughShards` names the
    unusable indices and where the manifest placed them. ``verified`` skips the shard
    hashes, for shards already checked one by one with :meth:`ShardSetManifest.check_shard`.
    """
    if owner_public_key is not None:
        manifest.verify(owner_public_key)
    codec = codec or ErasureCodec(manifest.params)
    usable = {i: s for i, s in shards.items() if len(s) == manifest.shard_size}
    wrong_size = [i for i in shards if i not in usable]
    try:
        data = codec.decode(usable, manifest.size, None if verified else manifest.shard_hashes)
    except NotEnoughShards as exc:
        corrupt = sorted(set(exc.corrupt) | set(wrong_size))
        raise NotEnoughShards(
            manifest.k,
            exc.have,
            exc.missing,
            corrupt=corrupt,
            holders={i: manifest.holders[i] for i in exc.missing},
        ) from None
    if manifest.content_sha256 and hashlib.sha256(data).hexdigest() != manifest.content_sha256:
        raise ManifestInvalid("decoded object does not match content_sha256")
    return data


def encode_shards_message(
    manifest: ShardSetManifest, shards: Mapping[int, bytes | bytearray | memoryview]
) -> bytes:
    """Wire form of a manifest with some of its shards (``shard.put`` / ``shard.get``).

    ``b"FWS\\x01" | u32 len | manifest JSON | u16 count | (u16 index | u64 len | bytes)*``
    """
    head = manifest.to_json()
    parts: list[bytes | bytearray | memoryview] = [
        _WIRE_MAGIC,
        struct.pack(">I", len(head)),
        head,
        struct.pack(">H", len(shards)),
    ]
    for index in sorted(shards):
        data = shards[index]
        parts.append(struct.pack(">HQ", index, len(data)))
        parts.append(data)
    return b"".join(parts)


def decode_shards_message(
    data: bytes | memoryview,
) -> tuple[ShardSetManifest, dict[int, memoryview]]:
    """Parse :func:`encode_shards_message` output; raise :class:`ManifestInvalid`.

    Shard bytes are views into ``data`` (no copies); their hashes are not checked here.
    """
    view = memoryview(data)
    if bytes(view[:4]) != _WIRE_MAGIC or len(view) < 8:
        raise ManifestInvalid("not a shard message")
    (head_len,) = struct.unpack(">I", view[4:8])
    pos = 8 + head_len
    if pos + 2 > len(view):
        raise ManifestInvalid("truncated shard message")
    manifest = ShardSetManifest.from_json(bytes(view[8:pos]))
    (count,) = struct.unpack(">H", view[pos : pos + 2])
    pos += 2
    shards: dict[int, memoryview] = {}
    for _ in range(count):
        if pos + 10 > len(view):
            raise ManifestInvalid("truncated shard message")
        index, length = struct.unpack(">HQ", view[pos : pos + 10])
        pos += 10
        if pos + length > len(view) or index in shards:
            raise ManifestInvalid("truncated shard message or repeated index")
        if index >= manifest.k + manifest.m:
            raise ManifestInvalid(f"shard index {index} outside the set")
        shards[index] = view[pos : pos + length]
        pos += length
    if pos != len(view):
        raise ManifestInvalid("trailing bytes after the shards")
    return manifest, shards
