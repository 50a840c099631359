"""Erasure-coded checkpoints across peers: storage, the shard service, replication,
recovery and the global-model history.

The package owns everything that keeps shard sets on the members' disks and gets them
back. Peer side: :class:`ShardStore` (:mod:`.store`) keeps the shards an org holds for
others, per owner under a byte quota; :class:`ShardService` (:mod:`.service`) serves
them over the endpoint (``shard.put``, ``shard.get``, ``shard.list``,
``shard.delete``), with the client calls :func:`put_shards`, :func:`get_shards`,
:func:`list_shards` and :func:`delete_shards`. Owner side:
:class:`CheckpointReplicator` (:mod:`.replicator`) seals, codes, places, pushes and
repairs the org's private state; :func:`recover` (:mod:`.recovery`) rebuilds it on a
node with an empty disk, fetching any ``k`` shards in parallel (:mod:`.fetch`).
:class:`GlobalHistoryStore` (:mod:`.history`) keeps each node's share of the coded
global-model history. The errors live in :mod:`.errors`.

Inside the package, a module imports only those listed before it: ``errors``,
``store``, ``service``, ``fetch``, then ``recovery`` and ``replicator`` (neither imports
the other), then ``history``. The package is part of the ``coordinator_free`` layer:
it imports ``secure_agg`` and other ``coordinator_free`` modules (endpoint, erasure,
placement, sealed, membership), never ``org_node``, ``api`` or torch.
"""

from coordinator_free.checkpoints.errors import (
    CheckpointFailed,
    NoCheckpoint,
    NotOwner,
    QuotaExceeded,
    ShardNotFound,
    ShardRequestError,
)
from coordinator_free.checkpoints.history import GLOBAL_SET, GlobalHistoryStore
from coordinator_free.checkpoints.recovery import RecoveredCheckpoint, recover, recover_sets
from coordinator_free.checkpoints.replicator import CheckpointReplicator, RepairReport
from coordinator_free.checkpoints.service import (
    DELETE,
    GET,
    GLOBAL_OWNER,
    LIST,
    PUT,
    STAGE,
    ShardService,
    delete_shards,
    get_shards,
    list_shards,
    put_shards,
)
from coordinator_free.checkpoints.store import ShardStore, StoredSet

__all__ = [
    "DELETE",
    "GET",
    "GLOBAL_OWNER",
    "GLOBAL_SET",
    "LIST",
    "PUT",
    "STAGE",
    "CheckpointFailed",
    "CheckpointReplicator",
    "GlobalHistoryStore",
    "NoCheckpoint",
    "NotOwner",
    "QuotaExceeded",
    "RecoveredCheckpoint",
    "RepairReport",
    "ShardNotFound",
    "ShardRequestError",
    "ShardService",
    "ShardStore",
    "StoredSet",
    "delete_shards",
    "get_shards",
    "list_shards",
    "put_shards",
    "recover",
    "recover_sets",
]
