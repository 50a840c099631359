"""The shard store's per-owner usage: counted at open, then kept up to date by every
put, overwrite and delete, always equal to a walk of the owner's directory."""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from coordinator_free.checkpoints import QuotaExceeded, ShardNotFound, ShardStore
from coordinator_free.erasure import EncodedSet, ShardSetManifest
from coordinator_free.sealed import atomic_write
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.coordinator_free.shard_support import signed_set
from tests.coordinator_free.transport_support import identity

pytestmark = pytest.mark.timeout(120)

OWNERS = ("a", "b")
VERSIONS = (1, 2)
N = 5  # shards per set: CodeParams(3, 2)


@functools.cache
def _set(owner: str, version: int, variant: int, epoch: int) -> tuple[ShardSetManifest, EncodedSet]:
    """A signed set; ``variant`` changes the bytes (another Merkle root), ``epoch``
    re-signs the same set with other holders (a manifest of another size)."""
    manifest, encoded = signed_set(owner, version, bytes([variant + 1]) * (600 + 150 * variant))
    if epoch:
        holders = [f"holder-{epoch}-{i}" for i in range(N)]
        manifest = manifest.with_holders(holders, epoch).sign(identity(owner))
    return manifest, encoded


def _walk(root: Path, owner: str) -> int:
    """Bytes under the owner's directory, counted afresh."""
    owner_dir = root / owner.encode("utf-8").hex()
    return sum(p.stat().st_size for p in owner_dir.rglob("*") if p.is_file())


def _assert_counted(store: ShardStore) -> None:
    for owner in OWNERS:
        assert store.usage(owner) == _walk(store.root, owner), owner
    assert store.total_bytes() == sum(_walk(store.root, o) for o in OWNERS)


_puts = st.tuples(
    st.just("put"),
    st.sampled_from(OWNERS),
    st.sampled_from(VERSIONS),
    st.integers(0, 1),  # variant
    st.sampled_from((0, 2, 5)),  # epoch
    st.frozensets(st.integers(0, N - 1)),  # indices (empty: a manifest-only refresh)
)
_deletes = st.tuples(
    st.just("delete"),
    st.sampled_from(OWNERS),
    st.none() | st.frozensets(st.sampled_from(VERSIONS), min_size=1),
    st.none() | st.frozensets(st.integers(0, N - 1), min_size=1),
)
_reopen = st.tuples(st.just("reopen"))


def _apply(store: ShardStore, op: tuple[Any, ...]) -> ShardStore:
    if op[0] == "reopen":
        return ShardStore(store.root, quota_bytes_per_owner=store.quota)
    if op[0] == "put":
        _, owner, version, variant, epoch, indices = op
        manifest, encoded = _set(owner, version, variant, epoch)
        before = store.usage(owner)
        try:
            store.put(manifest, {i: encoded.shards[i] for i in sorted(indices)})
        except (QuotaExceeded, ShardNotFound):
            assert store.usage(owner) == before  # a refused put writes nothing
        return store
    _, owner, versions, indices = op
    store.delete(owner, "state", versions, indices)
    return store


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    ops=st.lists(st.one_of(_puts, _puts, _deletes, _reopen), max_size=20),
    quota_shards=st.integers(2, 12),
)
def test_usage_equals_a_walk_after_any_puts_and_deletes(
    ops: list[tuple[Any, ...]], quota_shards: int
) -> None:
    manifest, _ = _set("a", 1, 0, 0)
    quota = quota_shards * (manifest.shard_size + len(manifest.to_json()))
    with tempfile.TemporaryDirectory() as tmp:
        store = ShardStore(Path(tmp) / "store", quota_bytes_per_owner=quota)
        for op in ops:
            store = _apply(store, op)
            _assert_counted(store)
        reopened = ShardStore(store.root, quota_bytes_per_owner=quota)
        assert all(reopened.usage(o) == store.usage(o) for o in OWNERS)


def test_overwrites_and_refreshes_keep_the_count(tmp_path: Path) -> None:
    store = ShardStore(tmp_path)
    first, first_encoded = _set("a", 1, 0, 0)
    store.put(first, {i: first_encoded.shards[i] for i in range(4)})
    _assert_counted(store)
    full = store.usage("a")
    # The same shards again: nothing more is held.
    store.put(first, {0: first_encoded.shards[0], 3: first_encoded.shards[3]})
    assert store.usage("a") == full
    # A newer placement epoch rewrites the manifest only (another size).
    refreshed, _ = _set("a", 1, 0, 5)
    store.put(refreshed, {})
    assert store.get("a", "state", 1)[0].epoch == 5
    _assert_counted(store)
    assert store.usage("a") - full == len(refreshed.to_json()) - len(first.to_json())
    # The version recoded (another Merkle root): the old shards go, the new count.
    second, second_encoded = _set("a", 1, 1, 0)
    store.put(second, {2: second_encoded.shards[2]})
    _assert_counted(store)
    assert store.usage("a") == second.shard_size + len(second.to_json())
    # Another owner is counted apart.
    other, other_encoded = _set("b", 2, 0, 0)
    store.put(other, {1: other_encoded.shards[1]})
    _assert_counted(store)
    assert store.total_bytes() == store.usage("a") + store.usage("b")


def test_deletes_keep_the_count_and_stray_files_are_counted_once(tmp_path: Path) -> None:
    store = ShardStore(tmp_path)
    for version in VERSIONS:
        manifest, encoded = _set("a", version, 0, 0)
        store.put(manifest, {i: encoded.shards[i] for i in range(3)})
    # A temporary file left by a crash is counted when the store opens again...
    version_dir = next(p for p in tmp_path.rglob("*") if p.name == f"{1:020d}")
    (version_dir / ".0.shard.1.abcd.tmp").write_bytes(b"t" * 777)
    store = ShardStore(tmp_path)
    _assert_counted(store)
    assert store.delete("a", "state", [2], [0, 1]) == 2
    _assert_counted(store)
    # ...and goes with its version.
    assert store.delete("a", "state", [1]) == 3
    _assert_counted(store)
    assert store.delete("a", "state", indices=[2]) == 1  # the last shard takes the version
    assert store.list("a") == [] and store.usage("a") == 0 == store.total_bytes()


def test_a_write_failing_half_way_is_counted_as_far_as_it_went(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ShardStore(tmp_path)
    manifest, encoded = _set("a", 1, 0, 0)
    calls = 0

    def failing(path: Path, data: bytes | bytearray | memoryview, mode: int = 0o600) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError("disk full")
        atomic_write(path, data, mode)

    monkeypatch.setattr("coordinator_free.checkpoints.store.atomic_write", failing)
    with pytest.raises(OSError, match="disk full"):
        store.put(manifest, {i: encoded.shards[i] for i in range(3)})
    _assert_counted(store)
    assert store.usage("a") == manifest.shard_size


def test_put_and_delete_never_walk_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = ShardStore(tmp_path)
    for owner in OWNERS:
        manifest, encoded = _set(owner, 1, 0, 0)
        store.put(manifest, {i: encoded.shards[i] for i in range(N)})
    walked: list[Path] = []
    real_rglob = Path.rglob

    def rglob(self: Path, pattern: str) -> Iterator[Path]:
        walked.append(self)
        return real_rglob(self, pattern)

    monkeypatch.setattr(Path, "rglob", rglob)
    manifest, encoded = _set("a", 2, 0, 0)
    store.put(manifest, {0: encoded.shards[0]})
    recoded, recoded_encoded = _set("a", 1, 1, 0)
    store.put(recoded, {1: recoded_encoded.shards[1]})  # replaces version 1
    store.delete("a", "state", [2], [0])
    store.delete("b", "state")
    # Only the version directories touched are measured, never an owner or the root.
    assert walked and all(len(p.relative_to(tmp_path).parts) == 3 for p in walked)
    monkeypatch.undo()
    _assert_counted(store)
