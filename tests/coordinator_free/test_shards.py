"""Shard storage, the shard service's access rules, and the owner-side replicator."""

from __future__ import annotations

import asyncio
import hashlib
import json
import stat
from pathlib import Path

import pytest
from coordinator_free.checkpoints import (
    GET,
    GLOBAL_OWNER,
    LIST,
    STAGE,
    CheckpointFailed,
    NotOwner,
    QuotaExceeded,
    ShardNotFound,
    ShardRequestError,
    ShardStore,
    delete_shards,
    get_shards,
    list_shards,
    put_shards,
)
from coordinator_free.endpoint import Endpoint
from coordinator_free.erasure import (
    CodeParams,
    CorruptShard,
    ShardSetManifest,
    decode_set,
    encode_set,
)
from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.membership import EventKind, MembershipEvent
from coordinator_free.sealed import open_sealed

from tests.coordinator_free.shard_support import PARAMS, cluster, signed_set
from tests.coordinator_free.transport_support import FEDERATION, identity

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- store


def test_store_put_get_list_delete(tmp_path: Path) -> None:
    store = ShardStore(tmp_path / "s")
    manifest, encoded = signed_set()
    assert store.put(manifest, {0: encoded.shards[0], 3: encoded.shards[3]}) == [0, 3]
    got_manifest, shards = store.get("a", "state", 1)
    assert got_manifest == manifest and set(shards) == {0, 3}
    assert shards[3] == bytes(encoded.shards[3])
    assert [(s.manifest.version, s.indices) for s in store.list("a")] == [(1, (0, 3))]
    assert store.usage("a") > 2 * manifest.shard_size
    for path in (tmp_path / "s").rglob("*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert store.delete("a", "state", indices=[0]) == 1
    assert [s.indices for s in store.list("a", "state")] == [(3,)]
    assert store.delete("a", "state") == 1
    assert store.list("a") == [] and store.usage("a") == 0
    with pytest.raises(ShardNotFound):
        store.get("a", "state", 1)


def test_store_refuses_corrupt_shards_and_writes_nothing(tmp_path: Path) -> None:
    store = ShardStore(tmp_path)
    manifest, encoded = signed_set()
    bad = bytearray(encoded.shards[1])
    bad[5] ^= 0x40
    with pytest.raises(CorruptShard):
        store.put(manifest, {0: encoded.shards[0], 1: bytes(bad)})
    assert store.list("a") == [] and store.usage("a") == 0


def test_store_quota_per_owner(tmp_path: Path) -> None:
    manifest, encoded = signed_set()
    quota = 2 * (manifest.shard_size + len(manifest.to_json()))
    store = ShardStore(tmp_path, quota_bytes_per_owner=quota)
    store.put(manifest, {0: encoded.shards[0], 1: encoded.shards[1]})
    with pytest.raises(QuotaExceeded, match="quota"):
        store.put(manifest, {2: encoded.shards[2]})
    # Re-storing the same shards does not count twice; another owner has its own quota.
    store.put(manifest, {0: encoded.shards[0]})
    other, other_encoded = signed_set("b")
    store.put(other, {0: other_encoded.shards[0], 1: other_encoded.shards[1]})
    # Usage survives a restart (rescanned from disk).
    again = ShardStore(tmp_path, quota_bytes_per_owner=store.quota)
    assert again.usage("a") == store.usage("a") > 0


def test_store_replaces_a_version_recoded_and_ignores_older_epochs(tmp_path: Path) -> None:
    store = ShardStore(tmp_path)
    first, first_shards = signed_set(data=b"1" * 3000)
    second, second_shards = signed_set(data=b"2" * 3000)
    store.put(first, {0: first_shards.shards[0], 1: first_shards.shards[1]})
    store.put(second, {2: second_shards.shards[2]})
    held, shards = store.get("a", "state", 1)
    assert held.merkle_root == second.merkle_root and set(shards) == {2}
    newer = second.with_holders(["x"] * 5, 3).sign(identity("a"))
    store.put(newer, {})
    assert store.get("a", "state", 1)[0].epoch == 3
    store.put(second, {})  # epoch 0 arrives late: ignored
    assert store.get("a", "state", 1)[0].epoch == 3
    with pytest.raises(ShardNotFound):
        store.put(signed_set(version=9)[0], {})


def test_store_ids_cannot_escape_the_root(tmp_path: Path) -> None:
    store = ShardStore(tmp_path / "root")
    manifest, encoded = signed_set(owner="..")
    store.put(manifest, {0: encoded.shards[0]})
    assert all(p.is_relative_to(tmp_path / "root") for p in tmp_path.rglob("*") if p.is_file())
    assert not (tmp_path / "state").exists()


# --------------------------------------------------------------------------- service


def test_service_access_rules(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 4, quota=20_000) as c:
            a, b, d = c.nodes["o0"], c.nodes["o1"], c.nodes["o3"]
            manifest, encoded = encode_set(
                b"private" * 500,
                params=CodeParams(2, 1),
                owner="o0",
                set_id="state",
                version=1,
                created_at=0,
                identity=a.identity,
            )
            assert await put_shards(a.endpoint, "o1", manifest, {0: encoded.shards[0]}) == [0]
            got, shards = await get_shards(a.endpoint, "o1", "o0", "state", 1)
            assert bytes(shards[0]) == bytes(encoded.shards[0]) and got == manifest
            listed = await list_shards(a.endpoint, "o1", "o0")
            assert [s.indices for s in listed] == [(0,)]
            # Only the owner gets its shards back, lists them or deletes them.
            with pytest.raises(NotOwner):
                await get_shards(d.endpoint, "o1", "o0", "state", 1)
            with pytest.raises(NotOwner):
                await list_shards(d.endpoint, "o1", "o0")
            body = json.dumps({"owner": "o0", "set_id": "state"}).encode()
            reply = await d.endpoint.send("o1", "shard.delete", body, stage=STAGE)
            assert reply[:1] == b"\x01" and b"not_owner" in reply
            # Nobody stores shards in another org's name, even with its signed manifest.
            with pytest.raises(NotOwner):
                await put_shards(d.endpoint, "o1", manifest, {1: encoded.shards[1]})
            # A manifest the owner did not sign is refused.
            forged = manifest.with_holders(["o9", "", ""], 1)
            with pytest.raises(ShardRequestError, match="bad signature"):
                await put_shards(a.endpoint, "o1", forged, {1: encoded.shards[1]})
            # The quota applies across the network.
            big, big_encoded = encode_set(
                b"B" * 60_000,
                params=CodeParams(2, 1),
                owner="o0",
                set_id="state",
                version=2,
                created_at=0,
                identity=a.identity,
            )
            with pytest.raises(QuotaExceeded):
                await put_shards(a.endpoint, "o1", big, {0: big_encoded.shards[0]})
            with pytest.raises(ShardNotFound):
                await get_shards(a.endpoint, "o1", "o0", "state", 7)
            assert await delete_shards(a.endpoint, "o1", "state") == 1
            # Malformed requests are refused by the endpoint, not crashed on.
            with pytest.raises(Refused) as info:
                await a.endpoint.send("o1", GET, b"{not json", stage=STAGE)
            assert info.value.reason is RefusalReason.MALFORMED
            with pytest.raises(Refused):
                await a.endpoint.send("o1", LIST, json.dumps({"owner": 5}).encode())
            with pytest.raises(Refused):
                await a.endpoint.send("o1", "shard.put", b"garbage")
            assert b.store.usage("o0") == 0

    asyncio.run(main())


def test_non_members_are_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 2) as c:
            outsider = identity("mallory")
            transport = c.network.transport("mallory")
            endpoint = Endpoint(outsider, FEDERATION, transport, c.keys)
            with pytest.raises(Refused) as info:
                await list_shards(endpoint, "o1", "mallory")
            assert info.value.reason is RefusalReason.NOT_MEMBER

    asyncio.run(main())


# --------------------------------------------------------------------------- replicator


def test_checkpoint_places_distinct_holders_peers_cannot_read(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 7) as c:
            rep = c.replicator("o0", params=PARAMS)
            state = b"optimizer+local layers+accountant" * 300
            manifest = await rep.checkpoint(state, 3)
            assert len(set(manifest.holders)) == PARAMS.n and "o0" not in manifest.holders
            manifest.verify(c.nodes["o0"].identity.public_key)
            for index, holder in enumerate(manifest.holders):
                held, shards = c.nodes[holder].store.get("o0", "state", 3)
                assert list(shards) == [index] and held == manifest
                assert b"optimizer" not in shards[index]
            # The sealed blob only opens with the owner's secret.
            shards = {
                i: c.nodes[h].store.get("o0", "state", 3)[1][i]
                for i, h in enumerate(manifest.holders)
            }
            sealed = decode_set(manifest, shards)
            assert open_sealed(c.nodes["o0"].secret, "o0", "state", 3, sealed) == state

    asyncio.run(main())


def test_retention_drops_old_versions_from_holders(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 6) as c:
            rep = c.replicator("o0", params=PARAMS, retention=2)
            for version in (1, 2, 3):
                await rep.checkpoint(bytes([version]) * 1000, version)
            assert rep.versions == [2, 3]
            held = {s.manifest.version for n in c.nodes.values() for s in n.store.list("o0")}
            assert held == {2, 3}

    asyncio.run(main())


def test_checkpoint_replaces_shards_a_holder_refuses(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 7) as c:
            c.network.kill("o3")  # unreachable, though not yet known dead
            rep = c.replicator("o0", params=PARAMS)
            manifest = await rep.checkpoint(b"s" * 5000, 1)
            assert "o3" not in manifest.holders and manifest.epoch >= 1
            assert len(set(manifest.holders)) == PARAMS.n
            for holder in manifest.holders:  # everyone holds the final manifest
                assert c.nodes[holder].store.get("o0", "state", 1)[0].epoch == manifest.epoch

    asyncio.run(main())


def test_checkpoint_fails_clearly_without_k_holders(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 3) as c:
            for org in ("o1", "o2"):
                c.network.kill(org)
            rep = c.replicator("o0", params=PARAMS)
            with pytest.raises(CheckpointFailed, match="need 3"):
                await rep.checkpoint(b"s" * 100, 1)

    asyncio.run(main())


def test_repair_after_a_member_leaves_keeps_m_losses_survivable(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 8) as c:
            rep = c.replicator("o0", params=PARAMS, cache_shards=False)
            state = b"state" * 1000
            before = await rep.checkpoint(state, 4)
            lost = before.holders[1]
            c.kill(lost)
            (report,) = await rep.repair()
            assert set(report.moved) == {1} and report.tolerated_losses == PARAMS.m
            after = rep.manifest(4)
            assert lost not in after.holders and after.epoch == before.epoch + 1
            new_holder = after.holders[1]
            assert c.nodes[new_holder].store.get("o0", "state", 4)[1].keys() == {1}
            assert (await rep.repair())[0].moved == {}

    asyncio.run(main())


def test_audit_repair_pushes_back_a_lost_shard(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 6) as c:
            rep = c.replicator("o0", params=PARAMS)
            manifest = await rep.checkpoint(b"q" * 4000, 1)
            holder = manifest.holders[2]
            c.nodes[holder].store.delete("o0", "state")
            assert (await rep.repair())[0].moved == {}  # membership alone sees nothing
            (report,) = await rep.repair(audit=True)
            assert report.moved == {2: (holder, holder)}
            assert 2 in c.nodes[holder].store.get("o0", "state", 1)[1]

    asyncio.run(main())


def test_watch_repairs_on_membership_events(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 7) as c:
            rep = c.replicator("o0", params=PARAMS)
            manifest = await rep.checkpoint(b"w" * 2000, 1)
            events: asyncio.Queue[MembershipEvent] = asyncio.Queue()
            rep.watch(events, settle_s=0.01)
            victim = manifest.holders[0]
            c.kill(victim)
            events.put_nowait(MembershipEvent(EventKind.DEAD, victim, 0, 0.0))
            for _ in range(200):
                if victim not in rep.manifest(1).holders:
                    break
                await asyncio.sleep(0.01)
            await rep.close()
            assert victim not in rep.manifest(1).holders

    asyncio.run(main())


def test_global_sets_are_readable_by_members_but_not_writable(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 3) as c:
            model = b"model" * 100
            manifest, encoded = encode_set(
                model,
                params=CodeParams(2, 1),
                owner=GLOBAL_OWNER,
                set_id="global",
                version=1,
                created_at=0,
                content_sha256=hashlib.sha256(model).hexdigest(),
            )
            c.nodes["o1"].store.put(manifest, {0: encoded.shards[0]})
            got, shards = await get_shards(c.nodes["o2"].endpoint, "o1", GLOBAL_OWNER, "global", 1)
            assert bytes(shards[0]) == bytes(encoded.shards[0])
            with pytest.raises(NotOwner):
                await put_shards(c.nodes["o2"].endpoint, "o1", manifest, {1: encoded.shards[1]})
            assert isinstance(ShardSetManifest.from_json(got.to_json()), ShardSetManifest)

    asyncio.run(main())


def test_watch_audits_a_member_that_comes_back_empty(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 6) as c:
            rep = c.replicator("o0", params=PARAMS)
            manifest = await rep.checkpoint(b"j" * 3000, 1)
            back = manifest.holders[3]
            c.nodes[back].store.delete("o0", "state")  # it restarted with an empty disk
            events: asyncio.Queue[MembershipEvent] = asyncio.Queue()
            rep.watch(events, settle_s=0.01)
            events.put_nowait(MembershipEvent(EventKind.JOIN, back, 1, 0.0))
            for _ in range(300):
                if c.nodes[back].store.list("o0"):
                    break
                await asyncio.sleep(0.01)
            await rep.close()
            assert c.nodes[back].store.get("o0", "state", 1)[1].keys() == {3}

    asyncio.run(main())


def test_checkpoint_refuses_shards_larger_than_a_message(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 3) as c:
            endpoint = c.nodes["o0"].endpoint
            endpoint.guard.max_size = 200_000
            rep = c.replicator("o0", params=CodeParams(1, 1))
            with pytest.raises(CheckpointFailed, match="message limit"):
                await rep.checkpoint(b"z" * 300_000, 1)
            assert all(not n.store.list("o0") for n in c.nodes.values())

    asyncio.run(main())


def test_shards_moved_onto_one_holder_go_in_messages_that_fit(tmp_path: Path) -> None:
    """Two holders unreachable, one left: the two shards it takes over exceed one
    message together, so each goes in a message of its own and every shard is placed."""

    async def main() -> None:
        async with cluster(tmp_path, 4) as c:
            for node in c.nodes.values():
                node.endpoint.guard.max_size = 400_000  # one ~300 kB shard fits, two do not
            for org in ("o1", "o2"):
                c.network.kill(org)  # unreachable, though not yet known dead
            rep = c.replicator("o0", params=CodeParams(1, 2))
            manifest = await rep.checkpoint(b"z" * 300_000, 1)
            assert manifest.holders == ("o3", "o3", "o3")
            held = c.nodes["o3"].store.get("o0", "state", 1)
            assert held[0].epoch == manifest.epoch and len(held[1]) == 3

    asyncio.run(main())


def test_store_ignores_foreign_entries_in_its_root(tmp_path: Path) -> None:
    (tmp_path / "lost+found").mkdir()
    (tmp_path / "notes.txt").write_text("operator notes")
    store = ShardStore(tmp_path)
    manifest, encoded = signed_set()
    store.put(manifest, {0: encoded.shards[0]})
    assert ShardStore(tmp_path).usage("a") == store.usage("a") > 0
