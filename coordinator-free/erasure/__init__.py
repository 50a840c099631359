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
Ed25519 key over ``b"fedweave/shardset/v1\x00" + canonical JSON body``; only the
manifest is signed, never the bulk data, whose integrity follows from the signed hashes.

Cost: hashing is what costs next to the code itself, so shards are hashed with
``hashlib.sha256`` on memoryviews (no copies) on a small thread pool while zfec codes
(both release the GIL): on encode the data shards while zfec computes the first parity
shards and those while it computes the next ones; on decode the k shards used while
zfec rebuilds the missing data shards. The decoded object is not hashed again: every
shard it comes from was checked against the manifest, which signs ``size`` too.

Modules, each importing only those listed before it (besides zfec and
``coordinator_free``'s errors, identities and canonical JSON; nothing of ``secure_agg``,
of the networking or of the layers above):

* :mod:`.errors`: ``ShardError`` and its kinds.
* :mod:`.codec`: ``CodeParams``, ``ErasureCodec`` (zfec with hashing on a pool),
  ``EncodedSet``, ``merkle_root``.
* :mod:`.shardset`: ``ShardSetManifest``, ``encode_set`` / ``decode_set``, the shard
  messages.
"""

from coordinator_free.erasure.codec import (
    MAX_SHARDS,
    CodeParams,
    EncodedSet,
    ErasureCodec,
    hashing_threads,
    merkle_root,
    sha256_digest,
)
from coordinator_free.erasure.errors import (
    CorruptShard,
    ManifestInvalid,
    NotEnoughShards,
    ShardError,
)
from coordinator_free.erasure.shardset import (
    FORMAT,
    ShardSetManifest,
    decode_set,
    decode_shards_message,
    encode_set,
    encode_shards_message,
)

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
