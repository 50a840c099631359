"""The org node: every layer composed into one object that serves the admin API.

:class:`OrgNode` holds the org's identity, the verified federation manifest chain, the
signed :class:`~coordinator_free.endpoint.Endpoint` (over mutual-TLS HTTPS, or an
in-memory transport in tests) with the :class:`~org_node.audit.EgressLog` as its egress
hook, SWIM :class:`~coordinator_free.membership.Membership`, signed
:class:`~coordinator_free.gossip.Gossip`, the leaderless
:class:`~coordinator_free.rounds.RoundEngine`, the shard store and
:class:`~coordinator_free.checkpoints.ShardService` it serves to its peers, the
:class:`~coordinator_free.checkpoints.CheckpointReplicator` of its own private state, the
database, and at most one active :class:`~org_node.engine.RunEngine`.

It implements :class:`~org_node.services.NodeServices`, so the admin API drives it:
``on_run_accepted`` checks that the run can be run here, ``on_run_started`` starts the
engine, pause/resume/abort act between rounds, and the engine's outcome is written
back to the run's row (``complete`` or ``fail``) with per-round metrics. The API calls
the hooks from its worker threads; they hand work to the node's event loop.

Federation changes: a proposal (``propose_add``/``propose_remove``) is signed by this
org and spread by gossip (topic ``manifest``); each org that signs spreads its
signature the same way, and when a quorum of the current members has signed, every
node verifies the successor and installs it (chain file, membership).

Recovery: :func:`recover_state` is what ``fedweave recover`` and the checkpoint
restore call run: fetch any ``k`` shards of this org's private state from its peers,
verify, decode, decrypt, and write the engine state where :meth:`OrgNode.start` resumes
it (rejoining the run at the round it had reached).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from coordinator_free.checkpoints import (
    CheckpointReplicator,
    GlobalHistoryStore,
    ShardService,
    ShardStore,
    recover,
)
from coordinator_free.endpoint import Endpoint
from coordinator_free.erasure import CodeParams
from coordinator_free.errors import CoordinatorFreeError, ManifestError
from coordinator_free.gossip import Gossip, GossipConfig
from coordinator_free.identity import OrgIdentity
from coordinator_free.manifest import Manifest, Member, load_chain
from coordinator_free.membership import Membership, MemberState, SwimConfig
from coordinator_free.rounds import (
    RoundConfig,
    RoundEngine,
    endpoint_signer,
    secagg_sessions,
)
from coordinator_free.rounds.ckks import CkksAggregator
from coordinator_free.sealed import RecoverySecret, atomic_write
from coordinator_free.tls import TlsTransport
from coordinator_free.transport import Transport
from sqlalchemy import Engine

from org_node import __version__
from org_node.audit import EgressLog, RunFacts
from org_node.audit.facts import node_report, node_run_facts
from org_node.config import NodeConfig, NodePaths
from org_node.db.engine import default_database_url, make_engine, migrate
from org_node.engine import (
    ATTEMPTS,
    STATE_FILE,
    EngineState,
)
from org_node.node_federation import FederationHost, write_chain
from org_node.node_proposals import ProposalHost
from org_node.node_runs import RunHost, TrainerFactory, _ActiveRun
from org_node.observability import Observability
from org_node.services import (
    CheckpointInfo,
    NodeHealth,
    NodeIdentityInfo,
    RunEventBus,
    ServiceRefused,
    ShardReport,
    UnknownCheckpoint,
)
from org_node.trainers.catalog import TrainerCatalog

__all__ = [
    "HARNESS_EXPORT_ENV",
    "NodeError",
    "OrgNode",
    "TrainerFactory",
    "load_secret",
    "read_chain",
    "recover_state",
    "save_secret",
    "write_chain",
]

logger = logging.getLogger(__name__)

HARNESS_EXPORT_ENV = "FEDWEAVE_HARNESS_DEBUG_EXPORT"
"""Test harnesses only: a directory for each round's plaintext update (see
:mod:`org_node.engine`); refused unless the config says ``[debug] harness = true``."""

T = TypeVar("T")


class NodeError(Exception):
    """The node cannot start or act as asked (the message says why)."""


def save_secret(path: Path, secret: RecoverySecret) -> None:
    """Write the recovery secret (hex) with mode 0600."""
    atomic_write(path, secret.hex().encode() + b"\n", mode=0o600)


def load_secret(path: Path) -> RecoverySecret:
    try:
        return RecoverySecret.from_hex(path.read_text().strip())
    except (OSError, ValueError) as exc:
        raise NodeError(f"cannot read the recovery secret {path}: {exc}") from None


class OrgNode(FederationHost, RunHost, ProposalHost):
    """One org's running node (see the module docstring)."""

    def __init__(
        self,
        data_dir: Path,
        config: NodeConfig,
        identity: OrgIdentity,
        secret: RecoverySecret,
        *,
        chain: list[Manifest] | None = None,
        db: Engine | None = None,
        transport: Transport | None = None,
        trainer_factory: TrainerFactory | None = None,
        swim: SwimConfig | None = None,
        round_config: RoundConfig | None = None,
        events: RunEventBus | None = None,
    ) -> None:
        if identity.org_id != config.node.org_id:
            raise NodeError(
                f"the identity is {identity.org_id!r} but the config says {config.node.org_id!r}"
            )
        self.paths = NodePaths(Path(data_dir))
        self.config = config
        self.org_identity = identity
        self.secret = secret
        self.chain: list[Manifest] = list(chain or [])
        self.db = db or make_engine(default_database_url(self.paths.root))
        self._transport = transport
        self.catalog = TrainerCatalog(config.trainers)
        """The trainers this org installed (bundled, config, admin API)."""
        self.trainer_factory = trainer_factory or self._worker_trainer
        fast = config.debug.fast_membership
        self.swim = swim or (
            SwimConfig(period_s=0.2, ping_timeout_s=0.08) if fast else SwimConfig()
        )
        self.round_config = round_config or RoundConfig(
            ready_timeout=config.engine.ready_timeout_s,
            lookahead_rounds=2 * ATTEMPTS,
            owner_unmask_from=config.engine.owner_unmask_from or None,
        )
        self._events = events or RunEventBus()
        self.observability = Observability(
            identity.org_id,
            self.chain[-1].federation if self.chain else "",
            attempts_per_round=ATTEMPTS,
        )
        """Stage metrics, peer fault scores and the round timeline (dashboard, /metrics)."""
        self.debug_export = self._debug_export()
        self.egress = EgressLog(identity, self.paths.egress_log)
        self.endpoint: Endpoint | None = None
        self.tls: TlsTransport | None = None
        self.membership: Membership | None = None
        self.gossip: Gossip | None = None
        self.rounds: RoundEngine | None = None
        self.replicator: CheckpointReplicator | None = None
        self.history: GlobalHistoryStore | None = None
        self.ckks: CkksAggregator | None = None
        self.store: ShardStore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._active: _ActiveRun | None = None
        self._participants: tuple[str, ...] = ()
        self._proposals: dict[str, Manifest] = {}
        self._follow: asyncio.Task[None] | None = None
        self._retry: asyncio.Task[None] | None = None
        self._settle: asyncio.Task[None] | None = None
        self._starting: set[str] = set()
        """Runs whose agreed start is in progress (not started twice)."""
        self._waiting: dict[str, tuple[str, Mapping[str, Any], tuple[str, ...] | None]] = {}
        """Runs left running that cannot resume yet (run id -> name, spec)."""
        self._reasons: dict[str, str] = {}
        self._history_run = ""
        self.finished: dict[str, str] = {}
        """Run id -> how it ended here (``completed``, ``failed: ...``)."""

    # ------------------------------------------------------------------ construction

    @classmethod
    def open(cls, data_dir: Path, **kw: Any) -> OrgNode:
        """A node from an initialized data directory (``fedweave init``)."""
        paths = NodePaths(Path(data_dir))
        if not paths.config.exists():
            raise NodeError(f"{data_dir} is not a node data directory: run `fedweave init`")
        config = NodeConfig.load(paths.config)
        try:
            identity = OrgIdentity.load(paths.identity_dir)
        except CoordinatorFreeError as exc:
            raise NodeError(str(exc)) from None
        secret = load_secret(paths.secret)
        chain = read_chain(paths.chain) if paths.chain.exists() else []
        return cls(paths.root, config, identity, secret, chain=chain, **kw)

    def _debug_export(self) -> Path | None:
        target = os.environ.get(HARNESS_EXPORT_ENV)
        if not target:
            return None
        if not self.config.debug.harness:
            raise NodeError(
                f"{HARNESS_EXPORT_ENV} is set but the config does not say "
                "[debug] harness = true; refusing to write plaintext updates"
            )
        logger.warning("harness debug export is ON: plaintext updates go to %s", target)
        return Path(target)

    @property
    def current_manifest(self) -> Manifest | None:
        return self.chain[-1] if self.chain else None

    def _members(self) -> dict[str, bytes]:
        m = self.current_manifest
        return m.public_keys() if m is not None else {}

    def _live(self) -> list[str]:
        """Members the SWIM view believes alive (all of them before it is running)."""
        if self.membership is None:
            return list(self._peers_for_rounds())
        return self.membership.live()

    def _peers_for_rounds(self) -> tuple[str, ...]:
        m = self.current_manifest
        return self._participants or (m.member_ids if m is not None else ())

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Migrate the database, join the federation's overlay, resume a running run."""
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(migrate, self.db)
        manifest = self.current_manifest
        if manifest is None:
            logger.info("%s: no federation installed yet", self.org_identity.org_id)
            return
        transport = self._transport
        if transport is None:
            self.tls = TlsTransport(
                self.org_identity,
                lambda: self.current_manifest.peer_addresses() if self.current_manifest else {},
            )
            transport = self.tls
        endpoint = Endpoint(
            self.org_identity, manifest.federation, transport, self._members, on_egress=self.egress
        )
        self.endpoint = endpoint
        self.store = ShardStore(
            self.paths.shards, quota_bytes_per_owner=self.config.checkpoint.quota_mb << 20
        )
        ShardService(endpoint, self.store, self._members)
        self.rounds = RoundEngine(
            endpoint,
            self._peers_for_rounds,
            secagg_sessions(*endpoint_signer(endpoint)),
            self.round_config,
            live=self._live,
        )
        self.observability.attach(self.rounds)
        self.ckks = CkksAggregator(
            endpoint,
            model_hashes=self.rounds.model_hashes,
            timeout=self.round_config.stage_timeout * 3,
        )
        await endpoint.start()
        self.membership = await Membership.create(endpoint, manifest.member_ids, self.swim)
        self.gossip = await Gossip.create(
            endpoint,
            self.membership,
            GossipConfig(period_s=min(GossipConfig().period_s, self.swim.period_s)),
        )
        live = self.membership.live
        self.replicator = CheckpointReplicator(
            endpoint,
            self.secret,
            live,
            params=CodeParams(self.config.checkpoint.k, self.config.checkpoint.m),
            retention=self.config.checkpoint.retention,
        )
        self.history = GlobalHistoryStore(
            endpoint,
            self.store,
            live,
            params=CodeParams(self.config.checkpoint.k, self.config.checkpoint.m),
        )
        self._follow = asyncio.create_task(self._follow_proposals(), name="manifest-proposals")
        await self._resume_runs()
        await self._start_proposals()

    async def stop(self) -> None:
        """Abandon the current round cleanly (state stays at the last finished round), leave."""
        active = self._active
        if active is not None and active.task is not None:
            active.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await active.task
        for task in (self._follow, self._retry, self._settle):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.replicator is not None:
            await self.replicator.close()
        if self.gossip is not None:
            await self.gossip.stop()
        if self.membership is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.membership.leave(), 2.0)
            await self.membership.stop()
        if self.endpoint is not None:
            await self.endpoint.close()
        self.egress.close()

    def _on_loop(self, coro: Awaitable[T], timeout: float = 120.0) -> T:
        """Run ``coro`` on the node's loop from an API worker thread; wait for it."""
        if self._loop is None:
            raise ServiceRefused("the node is not running")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            raise RuntimeError("a node service was called from the node's own event loop")
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        return future.result(timeout)

    # ------------------------------------------------------------------ NodeServices

    @property
    def events(self) -> RunEventBus:
        return self._events

    def identity(self) -> NodeIdentityInfo:
        return NodeIdentityInfo(
            org_id=self.org_identity.org_id,
            display_name=self.config.node.display_name or self.org_identity.org_id,
            fingerprint=self.org_identity.fingerprint,
            endpoint=self.config.network.peer_url,
            version=__version__,
        )

    def health(self) -> NodeHealth:
        checks: dict[str, str] = {}
        checks["federation"] = "ok" if self.current_manifest else "no federation installed"
        if self.membership is not None:
            alive = len(self.membership.live()) - 1
            checks["peers"] = f"ok ({alive} live)"
        active = self._active
        checks["engine"] = (
            "ok" if active is None or not active.task or not active.task.done() else "stopped"
        )
        return NodeHealth(ready=self.current_manifest is not None, checks=checks)

    def manifest(self) -> Manifest | None:
        return self.current_manifest

    def proposals(self) -> list[Manifest]:
        return sorted(self._proposals.values(), key=lambda m: m.digest)

    def _require_manifest(self) -> Manifest:
        m = self.current_manifest
        if m is None:
            raise ServiceRefused("this org has not joined a federation")
        return m

    def peers(self) -> list[MemberState]:
        if self.membership is None:
            return []
        return [
            s
            for org, s in sorted(self.membership.view().items())
            if org != self.org_identity.org_id
        ]

    def identity_record(self) -> Member:
        """This org's member record (what ``fedweave init`` writes to ``member.json``)."""
        return Member.from_identity(
            self.org_identity,
            self.config.node.display_name or self.org_identity.org_id,
            self.config.network.peer_url,
        )

    # -- checkpoints -----------------------------------------------------------------

    def run_facts(self, run_id: str) -> RunFacts:
        """The facts of run ``run_id``'s privacy report, from this node's database, round
        log and engine config (:func:`org_node.audit.facts.node_run_facts`)."""
        return node_run_facts(
            self.db,
            self.paths.root,
            run_id,
            org_id=self.org_identity.org_id,
            config=self.config.engine,
        )

    def run_report(self, run_id: str) -> Mapping[str, Any]:
        """The signed privacy report of run ``run_id`` (:class:`~org_node.services.RunReports`)."""
        return node_report(
            self.db,
            self.paths.root,
            run_id,
            identity=self.org_identity,
            config=self.config.engine,
            log=self.egress,
        )

    def checkpoints(self) -> list[CheckpointInfo]:
        rep = self.replicator
        if rep is None:
            return []
        run_id = self._active.run_id if self._active else ""
        out = []
        for v in rep.versions:
            m = rep.manifest(v)
            out.append(
                CheckpointInfo(
                    checkpoint_id=f"state-{v}",
                    run_id=run_id,
                    round=v,
                    created_at=float(m.created_at),
                    data_shards=m.k,
                    parity_shards=m.m,
                    sha256=m.merkle_root.hex(),
                )
            )
        return out

    def _version(self, checkpoint_id: str) -> int:
        prefix, _, num = checkpoint_id.partition("-")
        rep = self.replicator
        if prefix != "state" or not num.isdigit() or rep is None or int(num) not in rep.versions:
            raise UnknownCheckpoint(f"no checkpoint {checkpoint_id!r}")
        return int(num)

    def verify_checkpoint(self, checkpoint_id: str) -> ShardReport:
        version = self._version(checkpoint_id)
        rep = self.replicator
        assert rep is not None and self.membership is not None
        self._on_loop(rep.repair(audit=True))
        m = rep.manifest(version)
        live = set(self.membership.live())
        missing = tuple(sorted({h for h in m.holders if h and h not in live}))
        healthy = sum(1 for h in m.holders if h and h in live)
        return ShardReport(checkpoint_id, healthy, missing, (), healthy >= m.k)

    def restore_checkpoint(self, checkpoint_id: str) -> CheckpointInfo:
        version = self._version(checkpoint_id)
        if self._active is not None and self._active.task and not self._active.task.done():
            raise ServiceRefused("pause and abort the active run before restoring its state")
        assert self.endpoint is not None
        manifest = self._require_manifest()
        path = self._on_loop(
            recover_state(
                self.endpoint, self.secret, manifest.member_ids, self.paths, version=version
            )
        )
        logger.info("%s: restored %s into %s", self.org_identity.org_id, checkpoint_id, path)
        return next(c for c in self.checkpoints() if c.checkpoint_id == checkpoint_id)


def read_chain(path: Path) -> list[Manifest]:
    """Read and verify a manifest chain file."""
    try:
        versions = load_chain(path.read_bytes())
        Manifest.verify_chain(versions)
    except (OSError, ManifestError) as exc:
        raise NodeError(f"cannot use the federation manifest {path}: {exc}") from None
    return versions


async def recover_state(
    endpoint: Endpoint,
    secret: RecoverySecret,
    peers: tuple[str, ...] | list[str],
    paths: NodePaths,
    *,
    version: int | None = None,
    timeout: float = 60.0,
) -> Path:
    """Fetch any ``k`` shards of this org's private state, verify, decode, decrypt, and
    write it as the engine state of its run; returns that file."""
    recovered = await recover(endpoint, secret, peers, version=version, timeout=timeout)
    state = EngineState.from_bytes(recovered.state)
    path = paths.run_dir(state.run_key) / STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, recovered.state)
    return path
