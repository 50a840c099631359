"""What every part of the org node shares: :class:`NodeContext`.

The node's parts (:mod:`~org_node.node.federation`, :mod:`~org_node.node.proposals`,
:mod:`~org_node.node.runs`, :mod:`~org_node.node.checkpoints`) each hold the one
context of their node: who it is (identity, recovery secret), where its files are, its
config, database, egress log, trainer catalog and run event bus, the verified manifest
chain, and, once :meth:`~org_node.node.assembly.OrgNode.start` has built them, the
layers below (endpoint, membership, gossip, round engine, shard store, replicator,
global-model history). The layers and every piece of run state belong to the node's
event loop: code on another thread (the admin API's worker threads) reaches them only
through :meth:`NodeContext.on_loop` or :meth:`NodeContext.read`, which run the work on
the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from coordinator_free.checkpoints import CheckpointReplicator, GlobalHistoryStore, ShardStore
from coordinator_free.endpoint import Endpoint
from coordinator_free.gossip import Gossip
from coordinator_free.identity import OrgIdentity
from coordinator_free.manifest import Manifest
from coordinator_free.membership import Membership
from coordinator_free.rounds import RoundEngine
from coordinator_free.rounds.ckks import CkksAggregator
from coordinator_free.sealed import RecoverySecret
from coordinator_free.tls import TlsTransport
from sqlalchemy import Engine

from org_node.audit import EgressLog
from org_node.config import NodeConfig, NodePaths
from org_node.services import RunEventBus, ServiceRefused
from org_node.trainers.catalog import TrainerCatalog

__all__ = ["NodeContext"]

T = TypeVar("T")


@dataclass(eq=False)
class NodeContext:
    """The state the parts of one node share (see the module docstring)."""

    paths: NodePaths
    config: NodeConfig
    org_identity: OrgIdentity
    secret: RecoverySecret
    db: Engine
    egress: EgressLog
    catalog: TrainerCatalog
    """The trainers this org installed (bundled, config, admin API)."""
    events: RunEventBus
    chain: list[Manifest] = field(default_factory=list)
    loop: asyncio.AbstractEventLoop | None = None
    endpoint: Endpoint | None = None
    tls: TlsTransport | None = None
    membership: Membership | None = None
    gossip: Gossip | None = None
    rounds: RoundEngine | None = None
    ckks: CkksAggregator | None = None
    store: ShardStore | None = None
    replicator: CheckpointReplicator | None = None
    history: GlobalHistoryStore | None = None

    @property
    def me(self) -> str:
        return str(self.org_identity.org_id)

    @property
    def current_manifest(self) -> Manifest | None:
        return self.chain[-1] if self.chain else None

    def require_manifest(self) -> Manifest:
        m = self.current_manifest
        if m is None:
            raise ServiceRefused("this org has not joined a federation")
        return m

    def member_keys(self) -> dict[str, bytes]:
        """The current members' Ed25519 public keys (what every signature is checked by)."""
        m = self.current_manifest
        return m.public_keys() if m is not None else {}

    def on_loop(self, coro: Awaitable[T], timeout: float = 120.0) -> T:
        """Run ``coro`` on the node's loop from another thread; wait for it."""
        loop = self._loop_or_refuse()
        if self._on_loop_thread(loop):
            raise RuntimeError("a node service was called from the node's own event loop")
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, loop)  # type: ignore[arg-type]
        return future.result(timeout)

    def read(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """``fn()`` run on the node's loop (at once when already there): how code on any
        thread reads state the loop owns without racing it."""
        loop = self._loop_or_refuse()
        if self._on_loop_thread(loop):
            return fn()
        future: Future[T] = Future()

        def call() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the caller's thread
                future.set_exception(exc)

        loop.call_soon_threadsafe(call)
        return future.result(timeout)

    def _loop_or_refuse(self) -> asyncio.AbstractEventLoop:
        if self.loop is None or self.loop.is_closed():
            raise ServiceRefused("the node is not running")
        return self.loop

    @staticmethod
    def _on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
        try:
            return asyncio.get_running_loop() is loop
        except RuntimeError:  # no loop runs in this thread: an API worker thread
            return False
