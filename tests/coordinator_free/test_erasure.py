"""Reed-Solomon shard sets: any k of k+m decode, every byte flip is caught, manifests."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import zfec
from coordinator_free.erasure import (
    CodeParams,
    CorruptShard,
    ErasureCodec,
    ManifestInvalid,
    NotEnoughShards,
    ShardSetManifest,
    decode_set,
    decode_shards_message,
    encode_set,
    encode_shards_message,
    merkle_root,
)
from coordinator_free.erasure import codec as erasure
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.coordinator_free.transport_support import identity

VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "checkpoint_shards.json"


def _bytes(label: str, n: int) -> bytes:
    out = b""
    counter = 0
    while len(out) < n:
        out += hashlib.sha256(f"{label}/{counter}".encode()).digest()
        counter += 1
    return out[:n]


params_strategy = st.tuples(st.integers(1, 6), st.integers(0, 4)).map(lambda t: CodeParams(*t))


@settings(max_examples=60, deadline=None)
@given(params=params_strategy, data=st.binary(min_size=0, max_size=3000), pick=st.randoms())
def test_any_k_of_k_plus_m_shards_decode(params: CodeParams, data: bytes, pick: Any) -> None:
    owner = identity("a")
    manifest, encoded = encode_set(
        data, params=params, owner="a", set_id="state", version=1, created_at=0, identity=owner
    )
    assert len(encoded.shards) == params.n
    subset = sorted(pick.sample(range(params.n), params.k))
    shards = {i: encoded.shards[i] for i in subset}
    assert decode_set(manifest, shards, owner_public_key=owner.public_key) == data


@settings(max_examples=60, deadline=None)
@given(
    params=params_strategy.filter(lambda p: p.m >= 1),
    data=st.binary(min_size=1, max_size=2000),
    where=st.integers(0, 10**9),
    bit=st.integers(0, 7),
)
def test_any_byte_flip_is_detected_and_others_are_used(
    params: CodeParams, data: bytes, where: int, bit: int
) -> None:
    manifest, encoded = encode_set(
        data, params=params, owner="a", set_id="state", version=1, created_at=0
    )
    victim = where % params.n
    flipped = bytearray(encoded.shards[victim])
    flipped[where % len(flipped)] ^= 1 << bit
    with pytest.raises(CorruptShard):
        manifest.check_shard(victim, flipped)
    everything = {i: bytes(s) for i, s in enumerate(encoded.shards)}
    everything[victim] = bytes(flipped)
    # k+m shards, one corrupt: the decode sets it aside and uses another.
    assert decode_set(manifest, everything) == data
    # Exactly k shards, one corrupt: a clear error naming the corrupt shard.
    others = [i for i in range(params.n) if i != victim][: params.k - 1]
    exactly_k = {i: everything[i] for i in [victim, *others]}
    with pytest.raises(NotEnoughShards) as info:
        decode_set(manifest, exactly_k)
    assert victim in info.value.corrupt
    assert victim in info.value.missing


def test_exhaustive_subsets_for_4_plus_2() -> None:
    data = _bytes("exhaustive", 10_001)
    manifest, encoded = encode_set(
        data, params=CodeParams(4, 2), owner="a", set_id="state", version=2, created_at=0
    )
    for subset in itertools.combinations(range(6), 4):
        assert decode_set(manifest, {i: encoded.shards[i] for i in subset}) == data
    for few in itertools.combinations(range(6), 3):
        with pytest.raises(NotEnoughShards):
            decode_set(manifest, {i: encoded.shards[i] for i in few})


def test_shards_are_plain_zfec_shards() -> None:
    data = _bytes("zfec", 4 * 1000)
    codec = ErasureCodec(CodeParams(4, 3))
    encoded = codec.encode(data)
    raw = zfec.Encoder(4, 7).encode([data[i * 1000 : (i + 1) * 1000] for i in range(4)])
    assert [bytes(s) for s in encoded.shards] == [bytes(r) for r in raw]
    assert encoded.hashes == tuple(hashlib.sha256(bytes(s)).digest() for s in raw)


@pytest.mark.parametrize("parallel", [True, False])
def test_large_input_hashes_on_the_pool_match_inline_hashes(parallel: bool) -> None:
    data = os.urandom((3 << 20) + 7)
    codec = ErasureCodec(CodeParams(4, 2), parallel=parallel)
    encoded = codec.encode(data)
    assert encoded.hashes == tuple(hashlib.sha256(bytes(s)).digest() for s in encoded.shards)
    shards = {i: encoded.shards[i] for i in (1, 2, 4, 5)}
    assert codec.decode(shards, len(data), encoded.hashes) == data
    corrupt = dict(shards)
    corrupt[4] = bytes(len(encoded.shards[4]))
    corrupt[0] = encoded.shards[0]
    assert codec.decode(corrupt, len(data), encoded.hashes) == data


def _reference_mth(leaves: list[bytes]) -> bytes:
    """RFC 6962 §2.1, written independently (iterative split)."""
    if not leaves:
        return hashlib.sha256().digest()
    if len(leaves) == 1:
        return hashlib.sha256(b"\0" + leaves[0]).digest()
    k = 1
    while k * 2 < len(leaves):
        k *= 2
    left, right = _reference_mth(leaves[:k]), _reference_mth(leaves[k:])
    return hashlib.sha256(b"\1" + left + right).digest()


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 6, 7, 8, 9, 16, 17])
def test_merkle_root_follows_rfc6962(n: int) -> None:
    leaves = [hashlib.sha256(bytes([i])).digest() for i in range(n)]
    assert merkle_root(leaves) == _reference_mth(leaves)


def test_merkle_root_of_one_leaf_is_domain_separated() -> None:
    leaf = b"\x11" * 32
    assert merkle_root([leaf]) == hashlib.sha256(b"\x00" + leaf).digest() != leaf


def _signed_manifest() -> tuple[ShardSetManifest, Any]:
    owner = identity("org-a")
    data = _bytes("manifest", 5000)
    manifest, encoded = encode_set(
        data,
        params=CodeParams(3, 2),
        owner="org-a",
        set_id="state",
        version=7,
        created_at=1_700_000_000,
        holders=["b", "c", "d", "e", "f"],
        identity=owner,
    )
    return manifest, encoded


def test_manifest_signature_json_roundtrip_and_tampering() -> None:
    manifest, _ = _signed_manifest()
    key = identity("org-a").public_key
    manifest.verify(key)
    again = ShardSetManifest.from_json(manifest.to_json())
    assert again == manifest and again.signature == manifest.signature
    again.verify(key)
    with pytest.raises(ManifestInvalid):
        manifest.verify(identity("org-b").public_key)
    moved = manifest.with_holders(["x", "c", "d", "e", "f"], epoch=1)
    with pytest.raises(ManifestInvalid):
        moved.verify(key)  # a new placement must be signed again
    moved.sign(identity("org-a")).verify(key)
    obj = json.loads(manifest.to_json())
    obj["version"] = 8
    with pytest.raises(ManifestInvalid):
        ShardSetManifest.from_json(json.dumps(obj)).verify(key)
    with pytest.raises(ManifestInvalid):
        manifest.sign(identity("org-b"))


@pytest.mark.parametrize(
    "change",
    [
        {"merkle_root": "00" * 32},
        {"shard_hashes": ["00" * 32] * 4},
        {"holders": ["b"]},
        {"shard_size": 1},
        {"k": 0},
        {"k": 200, "m": 100},
        {"owner": "../etc"},
        {"owner": ""},
        {"version": -1},
        {"version": True},
        {"format": "other/v9"},
        {"extra": 1},
        {"content_sha256": "xyz"},
        {"signature": "zz"},
    ],
    ids=lambda c: ",".join(c),
)
def test_malformed_manifests_are_refused(change: dict[str, Any]) -> None:
    manifest, _ = _signed_manifest()
    obj = json.loads(manifest.to_json())
    obj.update(change)
    with pytest.raises(ManifestInvalid):
        ShardSetManifest.from_json(json.dumps(obj))


@pytest.mark.parametrize("junk", [b"", b"{", b"[]", b"null", "\u00e9".encode("latin-1")])
def test_manifest_junk_is_refused(junk: bytes) -> None:
    with pytest.raises(ManifestInvalid):
        ShardSetManifest.from_json(junk)


def test_shard_message_roundtrip_and_truncation() -> None:
    manifest, encoded = _signed_manifest()
    shards = {0: encoded.shards[0], 3: encoded.shards[3]}
    wire = encode_shards_message(manifest, shards)
    parsed, got = decode_shards_message(wire)
    assert parsed == manifest and {i: bytes(v) for i, v in got.items()} == {
        i: bytes(v) for i, v in shards.items()
    }
    for cut in range(0, len(wire), 97):
        with pytest.raises(ManifestInvalid):
            decode_shards_message(wire[:cut])
    with pytest.raises(ManifestInvalid):
        decode_shards_message(wire + b"\0")


@pytest.mark.parametrize(("k", "m"), [(0, 1), (1, -1), (200, 57), (True, 1)])
def test_code_params_are_validated(k: Any, m: Any) -> None:
    with pytest.raises((ValueError, TypeError)):
        CodeParams(k, m)


def test_storage_is_k_plus_m_over_k() -> None:
    data = _bytes("storage", 1 << 16)
    encoded = ErasureCodec(CodeParams(4, 2)).encode(data)
    assert sum(len(s) for s in encoded.shards) == len(data) * 6 // 4


def vectors() -> dict[str, Any]:
    """The fixed shard-set vectors (regenerate: FEDWEAVE_WRITE_VECTORS=1 pytest ...)."""
    cases = []
    for k, m, size in [(1, 0, 0), (2, 1, 5), (3, 2, 1000), (4, 2, 4096), (4, 6, 333)]:
        data = _bytes(f"vector/{k}/{m}/{size}", size)
        manifest, encoded = encode_set(
            data,
            params=CodeParams(k, m),
            owner="org-a",
            set_id="state",
            version=3,
            created_at=1_700_000_000,
            holders=[f"h{i}" for i in range(k + m)],
            identity=identity("org-a"),
        )
        cases.append(
            {
                "k": k,
                "m": m,
                "data_sha256": hashlib.sha256(data).hexdigest(),
                "size": size,
                "shard_sha256": [h.hex() for h in encoded.hashes],
                "merkle_root": encoded.root.hex(),
                "manifest": json.loads(manifest.to_json()),
            }
        )
    return {
        "description": "fedweave shard sets (zfec RS + SHA-256 + RFC 6962 root)",
        "cases": cases,
    }


def test_fixed_vectors() -> None:
    expected = vectors()
    if os.environ.get("FEDWEAVE_WRITE_VECTORS"):
        current = json.loads(VECTORS.read_text()) if VECTORS.exists() else {}
        current["shard_sets"] = expected
        VECTORS.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
    stored = json.loads(VECTORS.read_text())["shard_sets"]
    assert stored == expected
    for case in stored["cases"]:
        manifest = ShardSetManifest.from_json(json.dumps(case["manifest"]))
        manifest.verify(identity("org-a").public_key)
        assert manifest.merkle_root.hex() == case["merkle_root"]


@settings(max_examples=40, deadline=None)
@given(
    params=params_strategy,
    data=st.binary(min_size=0, max_size=500),
    pick=st.randoms(),
    flip=st.integers(0, 10_000),
)
def test_threaded_hashing_equals_sequential_and_catches_corruption(
    params: CodeParams, data: bytes, pick: Any, flip: int
) -> None:
    sequential = ErasureCodec(params, parallel=False).encode(data)
    threaded = ErasureCodec(params, parallel=True, parallel_min_bytes=0)
    encoded = threaded.encode(data)
    assert [bytes(s) for s in encoded.shards] == [bytes(s) for s in sequential.shards]
    assert encoded.hashes == sequential.hashes
    assert encoded.hashes == tuple(hashlib.sha256(bytes(s)).digest() for s in encoded.shards)
    subset = pick.sample(range(params.n), params.k)
    shards = {i: encoded.shards[i] for i in subset}
    assert threaded.decode(shards, len(data), encoded.hashes) == data
    # one flipped byte in a used shard: caught on the threaded path too
    victim = subset[flip % params.k]
    broken = bytearray(encoded.shards[victim])
    broken[flip % len(broken)] ^= 0x01
    damaged = shards | {victim: bytes(broken)}
    if params.m == 0:
        with pytest.raises(NotEnoughShards) as info:
            threaded.decode(damaged, len(data), encoded.hashes)
        assert info.value.corrupt == (victim,)
    else:
        spare = next(i for i in range(params.n) if i not in subset)
        damaged[spare] = encoded.shards[spare]
        assert threaded.decode(damaged, len(data), encoded.hashes) == data


@pytest.mark.timeout(30)
def test_the_caller_hashes_shards_no_pool_thread_has_started() -> None:
    """With every pool thread busy elsewhere, encode and decode finish on their own."""
    pool = erasure._pool()
    release = threading.Event()
    blockers = [pool.submit(release.wait) for _ in range(pool._max_workers)]
    try:
        data = os.urandom(3 << 20)
        codec = ErasureCodec(CodeParams(4, 2), parallel=True)
        encoded = codec.encode(data)
        assert encoded.hashes == tuple(hashlib.sha256(bytes(s)).digest() for s in encoded.shards)
        shards = {i: encoded.shards[i] for i in (0, 3, 4, 5)}
        assert codec.decode(shards, len(data), encoded.hashes) == data
        assert not any(b.done() for b in blockers)
    finally:
        release.set()


@pytest.mark.parametrize(("k", "m"), [(1, 0), (1, 4), (2, 10), (3, 2), (4, 2), (4, 6), (16, 240)])
def test_parity_groups_cover_each_parity_shard_once_the_last_alone(k: int, m: int) -> None:
    groups = erasure._parity_groups(k, k + m)
    assert [i for g in groups for i in g] == list(range(k, k + m))
    if m:
        assert len(groups[-1]) == 1
        assert all(len(a) <= k * len(b) for a, b in itertools.pairwise(groups))
