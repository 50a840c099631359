"""A shard set described and vouched for: :class:`ShardSetManifest`, sets coded and
decoded with it, and the wire form of a manifest with some of its shards.

An owned set's manifest is signed with the owner's Ed25519 key over
``b"fedweave/shardset/v1\\x00" + canonical JSON body``; only the manifest is signed,
never the bulk data, whose integrity follows from the signed hashes.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from coordinator_free.erasure.codec import (
    CodeParams,
    EncodedSet,
    ErasureCodec,
    merkle_root,
    sha256_digest,
)
from coordinator_free.erasure.errors import CorruptShard, ManifestInvalid, NotEnoughShards
from coordinator_free.errors import Refused
from coordinator_free.identity import OrgIdentity, verify_signature
from coordinator_free.manifest import canonical_json
from coordinator_free.peer_json import loads_bounded

__all__ = [
    "FORMAT",
    "SIGNING_DOMAIN",
    "ShardSetManifest",
    "decode_set",
    "decode_shards_message",
    "encode_set",
    "encode_shards_message",
]

FORMAT = "fedweave/shardset/v1"
SIGNING_DOMAIN = b"fedweave/shardset/v1\x00"
_ID = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")
_WIRE_MAGIC = b"FWS\x01"


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
            obj = loads_bounded(data, what="shard-set manifest")
        except Refused as exc:
            raise ManifestInvalid(exc.detail) from None
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
