"""A wiped org rebuilds its state from its peers; the global-model history is coded."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from pathlib import Path

import pytest
from coordinator_free.checkpoints import (
    GLOBAL_OWNER,
    GLOBAL_SET,
    CheckpointReplicator,
    GlobalHistoryStore,
    NoCheckpoint,
    NotOwner,
    put_shards,
    recover,
)
from coordinator_free.endpoint import Endpoint
from coordinator_free.erasure import CodeParams, ManifestInvalid, NotEnoughShards, encode_set
from coordinator_free.sealed import RecoveryBackup, RecoverySecret, WrongRecoverySecret

from tests.coordinator_free.shard_support import PARAMS, Cluster, cluster
from tests.coordinator_free.transport_support import FEDERATION

pytestmark = pytest.mark.timeout(60)


async def _checkpointed(c: Cluster, owner: str, versions: int = 1) -> list[bytes]:
    rep = c.replicator(owner, params=PARAMS)
    states = []
    for version in range(1, versions + 1):
        state = os.urandom(20_000 + version)
        await rep.checkpoint(state, version)
        states.append(state)
    return states


def test_wiped_org_recovers_latest_state(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 6) as c:
            states = await _checkpointed(c, "o0", versions=3)
            node = await c.wipe("o0")
            assert not any(node.store.root.iterdir())
            got = await recover(node.endpoint, node.secret, c.live())
            assert got.version == 3 and got.state == states[-1]
            older = await recover(node.endpoint, node.secret, c.live(), version=2)
            assert older.state == states[1]
            out = tmp_path / "recovered.bin"
            got.write(out)
            assert out.read_bytes() == states[-1]

    asyncio.run(main())


def test_m_simultaneous_losses_are_survived(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 7) as c:
            (state,) = await _checkpointed(c, "o0")
            manifest = c.replicator("o0")  # a fresh view: placement comes from peers
            del manifest
            holders = c.nodes["o1"].store.list("o0") or c.nodes["o2"].store.list("o0")
            placed = holders[0].manifest.holders
            for lost in placed[:2]:  # m = 2 holders at once
                c.kill(lost)
            node = await c.wipe("o0")
            got = await recover(node.endpoint, node.secret, c.nodes)
            assert got.state == state

    asyncio.run(main())


def test_more_than_m_losses_name_missing_shards_and_holders(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 7) as c:
            await _checkpointed(c, "o0")
            placed = next(s.manifest.holders for n in c.nodes.values() for s in n.store.list("o0"))
            for lost in placed[:3]:
                c.kill(lost)
            node = await c.wipe("o0")
            with pytest.raises(NotEnoughShards) as info:
                await recover(node.endpoint, node.secret, c.nodes)
            err = info.value
            assert err.needed == 3 and err.have == 2
            assert set(err.missing) == {0, 1, 2}
            for index in (0, 1, 2):
                assert err.holders[index] == placed[index]
                assert f"#{index} on {placed[index]}" in str(err)
            assert "unreachable" in str(err)

    asyncio.run(main())


def test_not_enough_shards_of_the_newest_version_points_to_older_ones(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 6) as c:
            states = await _checkpointed(c, "o0", versions=2)
            node = await c.wipe("o0")
            newest = next(
                s.manifest
                for n in c.nodes.values()
                for s in n.store.list("o0")
                if s.manifest.version == 2
            )
            for holder in newest.holders[:3]:  # three of five shards of version 2 vanish
                c.nodes[holder].store.delete("o0", "state", [2])
            with pytest.raises(NotEnoughShards) as info:
                await recover(node.endpoint, node.secret, c.nodes)
            assert "older versions [1]" in "".join(getattr(info.value, "__notes__", []))
            got = await recover(node.endpoint, node.secret, c.nodes, version=1)
            assert got.state == states[0]

    asyncio.run(main())


def test_a_corrupt_shard_is_detected_and_others_are_used(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 6) as c:
            (state,) = await _checkpointed(c, "o0")
            placed = next(s.manifest.holders for n in c.nodes.values() for s in n.store.list("o0"))
            victim = c.nodes[placed[0]].store
            (shard_file,) = victim.root.rglob("0.shard")
            data = bytearray(shard_file.read_bytes())
            data[100] ^= 0xFF
            shard_file.write_bytes(bytes(data))
            node = await c.wipe("o0")
            got = await recover(node.endpoint, node.secret, c.nodes)
            assert got.state == state
            # With that holder and two more gone, the corruption is named.
            for lost in placed[1:3]:
                c.kill(lost)
            with pytest.raises(NotEnoughShards) as info:
                await recover(node.endpoint, node.secret, c.nodes)
            assert "corrupt" in str(info.value)

    asyncio.run(main())


def test_wrong_recovery_secret_is_a_clear_error(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 6) as c:
            await _checkpointed(c, "o0")
            node = await c.wipe("o0")
            wrong = RecoverySecret(b"\x07" * 32)
            with pytest.raises(WrongRecoverySecret, match="recovery secret does not match"):
                await recover(node.endpoint, wrong, c.nodes)

    asyncio.run(main())


def test_no_checkpoint_anywhere(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 4) as c:
            c.kill("o3")
            node = c.nodes["o0"]
            with pytest.raises(NoCheckpoint, match="o3 \\(unreachable"):
                await recover(node.endpoint, node.secret, c.nodes)

    asyncio.run(main())


def test_a_manifest_not_signed_by_us_is_ignored(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 6) as c:
            (state,) = await _checkpointed(c, "o0")
            # o1 plants a newer "version" of o0's state, signed by o1's own key.
            forged, encoded = encode_set(
                b"evil" * 100,
                params=PARAMS,
                owner="o0",
                set_id="state",
                version=99,
                created_at=0,
            )
            forged = forged.__class__.from_json(forged.to_json())
            c.nodes["o1"].store.put(forged, {0: encoded.shards[0]})
            node = await c.wipe("o0")
            got = await recover(node.endpoint, node.secret, c.nodes)
            assert got.version == 1 and got.state == state

    asyncio.run(main())


def test_recovery_from_the_backup_file_then_repair(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 7) as c:
            (state,) = await _checkpointed(c, "o0")
            original = c.nodes["o0"]
            backup = RecoveryBackup.create(original.identity, FEDERATION, original.secret)
            backup.save(tmp_path / "o0.backup", b"pw", scrypt_n=1 << 10)
            await original.endpoint.close()  # the process and its disk are gone
            shutil.rmtree(original.store.root)
            # A new process: only the backup file is left.
            loaded = RecoveryBackup.load(tmp_path / "o0.backup", b"pw")
            ident = loaded.identity(b"pw")
            endpoint = Endpoint(ident, FEDERATION, c.network.transport("o0"), c.keys)
            await endpoint.start()
            got = await recover(endpoint, loaded.secret, c.nodes)
            assert got.state == state
            # It takes the set over and repairs it when a holder dies.
            rep = CheckpointReplicator(endpoint, loaded.secret, c.live, params=PARAMS)
            rep.adopt(got.manifest)
            c.kill(got.manifest.holders[4])
            (report,) = await rep.repair()
            assert set(report.moved) == {4} and report.tolerated_losses == PARAMS.m
            await endpoint.close()

    asyncio.run(main())


def test_recovery_fetches_in_parallel_from_k_peers(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 6, bandwidth_bps=8e6) as c:
            (state,) = await _checkpointed(c, "o0")
            node = await c.wipe("o0")
            before = dict(c.network.bytes_sent)
            got = await recover(node.endpoint, node.secret, c.nodes)
            assert got.state == state
            senders = {
                org
                for org, sent in c.network.bytes_sent.items()
                if sent - before.get(org, 0) > len(state) // PARAMS.k // 2
            }
            # Exactly k holders sent a shard each: no full copy came from anyone.
            assert len(senders) == PARAMS.k
            for org in senders:
                assert c.network.bytes_sent[org] - before.get(org, 0) < len(state) // 2

    asyncio.run(main())


# --------------------------------------------------------------------------- global history


def _history(c: Cluster, params: CodeParams, retention: int = 3) -> dict[str, GlobalHistoryStore]:
    return {
        org: GlobalHistoryStore(n.endpoint, n.store, c.live, params=params, retention=retention)
        for org, n in c.nodes.items()
    }


def test_global_history_is_coded_across_members(tmp_path: Path) -> None:
    async def main() -> None:
        params = CodeParams(4, 2)
        async with cluster(tmp_path, 8) as c:
            stores = _history(c, params, retention=2)
            models = {v: os.urandom(40_000) for v in (1, 2, 3)}
            for version, model in models.items():
                digest = hashlib.sha256(model).hexdigest()
                manifests = {g.add_version(version, model, digest) for g in stores.values()}
                assert len({m.digest for m in manifests}) == 1  # every node agrees
            # Retention: only versions 2 and 3 are kept anywhere.
            assert {v for g in stores.values() for v in g.versions()} == {2, 3}
            # Each node stores about (k+m)/(k n) of a version, not a full copy.
            shard_bytes = sum(
                sum(len(x) for x in n.store.get(GLOBAL_OWNER, GLOBAL_SET, 3)[1].values())
                for n in c.nodes.values()
                if any(s.manifest.version == 3 for s in n.store.list(GLOBAL_OWNER))
            )
            assert shard_bytes == params.n * -(-len(models[3]) // params.k)
            for node in c.nodes.values():
                held = sum(
                    len(x)
                    for s in node.store.list(GLOBAL_OWNER)
                    if s.manifest.version == 3
                    for x in node.store.get(GLOBAL_OWNER, GLOBAL_SET, 3)[1].values()
                )
                assert held <= len(models[3]) // params.k + 1
            # Any node rebuilds a version from any k shards, even with m holders gone.
            digest = hashlib.sha256(models[2]).hexdigest()
            placed = c.nodes["o0"].store.list(GLOBAL_OWNER) or c.nodes["o1"].store.list(
                GLOBAL_OWNER
            )
            holders = placed[0].manifest.holders
            for lost in [h for h in holders if h != "o7"][:2]:
                c.kill(lost)
            assert await stores["o7"].rebuild(2, digest, c.nodes) == models[2]
            with pytest.raises(NoCheckpoint):
                await stores["o7"].rebuild(2, "00" * 32, c.live())

    asyncio.run(main())


def test_global_history_repair_after_loss(tmp_path: Path) -> None:
    async def main() -> None:
        params = CodeParams(2, 2)
        async with cluster(tmp_path, 6) as c:
            stores = _history(c, params)
            model = os.urandom(9_000)
            digest = hashlib.sha256(model).hexdigest()
            manifest = None
            for g in stores.values():
                manifest = g.add_version(1, model, digest)
            assert manifest is not None
            lost = [h for h in manifest.holders if h != "o0"][:2]
            for org in lost:
                c.kill(org)
            # Survivors whose share changed under the new placement repair it.
            repaired = set()
            for org in c.live():
                if await stores[org].repair():
                    repaired.add(org)
            assert repaired
            for org in lost:  # the lost holders' shards are no longer needed
                c.nodes[org].store.delete(GLOBAL_OWNER, GLOBAL_SET)
            live_holders = [o for o in c.live() if c.nodes[o].store.list(GLOBAL_OWNER)]
            assert len(live_holders) == params.n
            # A node that lost its disk rebuilds from the others.
            node = await c.wipe("o0")
            fresh = GlobalHistoryStore(node.endpoint, node.store, c.live, params=params)
            assert await fresh.rebuild(1, digest, c.live()) == model

    asyncio.run(main())


def test_global_history_is_placed_on_the_rounds_survivors_only(tmp_path: Path) -> None:
    """A live member that missed the round holds no shard of it, yet rebuilds it (its
    catch-up) from the survivors' shards even with m of them gone."""

    async def main() -> None:
        params = CodeParams(2, 2)
        async with cluster(tmp_path, 6) as c:
            stores = _history(c, params)
            survivors = ("o1", "o2", "o3", "o4", "o5")  # o0 is live but missed the round
            model = os.urandom(12_000)
            digest = hashlib.sha256(model).hexdigest()
            manifests = {
                stores[o].add_version(4, model, digest, members=survivors) for o in survivors
            }
            (manifest,) = manifests
            assert set(manifest.holders) <= set(survivors)
            held = {o for o in survivors if c.nodes[o].store.list(GLOBAL_OWNER)}
            assert held == set(manifest.holders) and len(held) == params.n
            assert c.nodes["o0"].store.list(GLOBAL_OWNER) == []
            for lost in sorted(held)[: params.m]:
                c.kill(lost)
            assert await stores["o0"].rebuild(4, digest, c.live()) == model

    asyncio.run(main())


def test_put_of_a_global_set_from_a_member_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 3) as c:
            model = b"m" * 1000
            manifest, encoded = encode_set(
                model,
                params=CodeParams(2, 1),
                owner=GLOBAL_OWNER,
                set_id=GLOBAL_SET,
                version=1,
                created_at=0,
                content_sha256=hashlib.sha256(model).hexdigest(),
            )
            with pytest.raises(NotOwner):
                await put_shards(c.nodes["o0"].endpoint, "o1", manifest, {0: encoded.shards[0]})
            assert c.nodes["o1"].store.list(GLOBAL_OWNER) == []

    asyncio.run(main())


def test_add_version_refuses_bytes_that_do_not_match_the_hash(tmp_path: Path) -> None:
    async def main() -> None:
        async with cluster(tmp_path, 3) as c:
            (store,) = list(_history(c, CodeParams(2, 1)).values())[:1]
            with pytest.raises(ManifestInvalid):
                store.add_version(1, b"model", "00" * 32)

    asyncio.run(main())
