"""An in-memory federation of shard holders, and signed test sets, for the shard,
store and recovery tests."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from coordinator_free.checkpoints import CheckpointReplicator, ShardService, ShardStore
from coordinator_free.endpoint import Endpoint
from coordinator_free.erasure import CodeParams, EncodedSet, ShardSetManifest, encode_set
from coordinator_free.identity import OrgIdentity
from coordinator_free.memory import InMemoryNetwork
from coordinator_free.sealed import RecoverySecret

from tests.coordinator_free.transport_support import FEDERATION, identity


@dataclass
class Node:
    identity: OrgIdentity
    endpoint: Endpoint
    store: ShardStore
    service: ShardService
    secret: RecoverySecret


@dataclass
class Cluster:
    network: InMemoryNetwork
    root: Path
    nodes: dict[str, Node] = field(default_factory=dict)
    dead: set[str] = field(default_factory=set)
    quota: int = 1 << 30

    def keys(self) -> Mapping[str, bytes]:
        return {org: n.identity.public_key for org, n in self.nodes.items()}

    def live(self) -> list[str]:
        return sorted(org for org in self.nodes if org not in self.dead)

    def kill(self, org: str) -> None:
        self.dead.add(org)
        self.network.kill(org)

    def revive(self, org: str) -> None:
        self.dead.discard(org)
        self.network.revive(org)

    def replicator(self, org: str, **kwargs: object) -> CheckpointReplicator:
        node = self.nodes[org]
        return CheckpointReplicator(node.endpoint, node.secret, self.live, **kwargs)  # type: ignore[arg-type]

    async def add(self, org: str, *, store_dir: Path | None = None) -> Node:
        ident = identity(org)
        transport = self.network.transport(org)
        endpoint = Endpoint(ident, FEDERATION, transport, self.keys)
        store = ShardStore(store_dir or self.root / org, quota_bytes_per_owner=self.quota)
        service = ShardService(endpoint, store, self.keys)
        secret = RecoverySecret(ident.public_key)  # deterministic per org, for tests
        node = Node(ident, endpoint, store, service, secret)
        self.nodes[org] = node
        await endpoint.start()
        return node

    async def wipe(self, org: str) -> Node:
        """The org loses its disk and process; a fresh node with the same identity
        (from its backup) and an empty data dir replaces it."""
        old = self.nodes.pop(org)
        await old.endpoint.close()
        shutil.rmtree(old.store.root)
        node = await self.add(org)
        return node


@contextlib.asynccontextmanager
async def cluster(
    root: Path, n: int, *, quota: int = 1 << 30, **network: float
) -> AsyncIterator[Cluster]:
    """``n`` orgs ``o0..o{n-1}`` on one in-memory network, each serving shards."""
    net = InMemoryNetwork(**network)  # type: ignore[arg-type]
    c = Cluster(net, root, quota=quota)
    for i in range(n):
        await c.add(f"o{i}")
    try:
        yield c
    finally:
        for node in c.nodes.values():
            await node.endpoint.close()


PARAMS = CodeParams(k=3, m=2)


def signed_set(
    owner: str = "a", version: int = 1, data: bytes = b"x" * 3000, **kw: object
) -> tuple[ShardSetManifest, EncodedSet]:
    """``data`` coded as set ``state`` with ``CodeParams(3, 2)``, signed by ``owner``."""
    return encode_set(
        data,
        params=CodeParams(3, 2),
        owner=owner,
        set_id="state",
        version=version,
        created_at=0,
        identity=identity(owner),
        **kw,  # type: ignore[arg-type]
    )
