"""The org node: every layer composed into one object that serves the admin API.

:class:`OrgNode` holds the org's identity, the verified federation manifest chain, the
signed :class:`~coordinator_free.endpoint.Endpoint` (over mutual-TLS HTTPS, or an
in-memory transport in tests) with the :class:`~org_node.audit.EgressLog` as its egress
hook, SWIM :class:`~coordinator_free.membership.Membership`, signed
:class:`~coordinator_free.gossip.Gossip`, the leaderless
:class:`~coordinator_free.rounds.RoundEngine`, the shard store and
:class:`~coordinator_free.shards.ShardService` it serves to its peers, the
:class:`~coordinator_free.shards.CheckpointReplicator` of its own private state, the
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
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from coordinator_free.endpoint import Endpoint
from coordinator_free.erasure import CodeParams, ShardError
from coordinator_free.errors import CoordinatorFreeError, ManifestError
from coordinator_free.gossip import Gossip, GossipConfig, SignedRecord
from coordinator_free.identity import OrgIdentity, verify_signature
from coordinator_free.manifest import Manifest, Member, dump_chain, load_chain
from coordinator_free.membership import Membership, MemberState, SwimConfig
from coordinator_free.rounds import (
    ModelHashMismatch,
    RoundConfig,
    RoundEngine,
    endpoint_signer,
    secagg_sessions,
)
from coordinator_free.sealed import RecoverySecret, atomic_write
from coordinator_free.shards import (
    GLOBAL_OWNER,
    GLOBAL_SET,
    CheckpointReplicator,
    GlobalHistoryStore,
    ShardService,
    ShardStore,
    recover,
)
from coordinator_free.tls import TlsTransport
from coordinator_free.transport import Transport
from sqlalchemy import Engine, update
from sqlmodel import Session

from org_node import __version__
from org_node.audit import AuditError, EgressLog, RunFacts
from org_node.audit.facts import node_report, node_run_facts, record_round
from org_node.ckks_rounds import CkksAggregator
from org_node.config import NodeConfig, NodePaths
from org_node.consent import ConsentRefused, RunBinding, binding_of
from org_node.db.engine import default_database_url, make_engine, migrate
from org_node.db.models import Run, RunMetric, utcnow
from org_node.db.repo import append_audit_event, update_versioned
from org_node.engine import (
    ATTEMPTS,
    STATE_FILE,
    EngineError,
    EngineState,
    LocalTrainer,
    RoundReport,
    RunEngine,
    RunFailed,
    RunPlan,
    UpdateRejected,
    model_from_bytes,
    model_to_bytes,
)
from org_node.observability import Observability
from org_node.policy import RunSpec
from org_node.privacy import PrivacyError
from org_node.runs import InvalidTransition, RunAction, RunState, next_state
from org_node.services import (
    CheckpointInfo,
    NodeHealth,
    NodeIdentityInfo,
    RunEventBus,
    ServiceRefused,
    ShardReport,
    UnknownCheckpoint,
)
from org_node.trainers.base import WorkerSpec
from org_node.trainers.catalog import TrainerCatalog
from org_node.trainers.local import TrainerFailed, WorkerLaunch, WorkerTrainer
from org_node.training.spec import LocalJobSpec

__all__ = [
    "HARNESS_EXPORT_ENV",
    "NodeError",
    "OrgNode",
    "TrainerFactory",
    "load_secret",
    "recover_state",
    "save_secret",
]

logger = logging.getLogger(__name__)

HARNESS_EXPORT_ENV = "FEDWEAVE_HARNESS_DEBUG_EXPORT"
"""Test harnesses only: a directory for each round's plaintext update (see
:mod:`org_node.engine`); refused unless the config says ``[debug] harness = true``."""

RESUME_RETRY_S = 2.0
"""How often a run that could not resume (its trainer or dataset missing) is tried again."""

MANIFEST_TOPIC = "manifest"
MODEL_TOPIC = "model"
"""Gossip topic of the global model's content hash per run and round (key ``RUN/ROUND``)."""

TrainerFactory = Callable[[RunPlan, Path, RunBinding], LocalTrainer]
"""``factory(plan, work_dir, binding)``: the local trainer of a run (by default a
:class:`~org_node.trainers.local.WorkerTrainer` over a worker process)."""
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


@dataclass
class _ActiveRun:
    run_id: str
    engine: RunEngine
    paused: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class OrgNode:
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
        self._waiting: dict[str, tuple[str, Mapping[str, Any]]] = {}
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

    def _node_config(self, binding: RunBinding) -> dict[str, Any]:
        """This org's Flower ``node_config``: its partition (demos) and bound dataset."""
        training = self.config.training
        out: dict[str, Any] = {}
        if training.num_partitions > 1:
            out |= {
                "partition-id": training.partition_index,
                "num-partitions": training.num_partitions,
            }
        d = binding.dataset
        if d is not None:
            out |= {
                "dataset-name": d.name,
                "dataset-path": d.path,
                "dataset-kind": d.kind,
                "dataset-rows": d.rows,
                "dataset-sha256": d.sha256,
                "dataset-columns": json.dumps(dict(d.columns), sort_keys=True),
            }
        return out | dict(training.node_config)

    def _worker_trainer(self, plan: RunPlan, work_dir: Path, binding: RunBinding) -> LocalTrainer:
        """The run's trainer, in a worker process of its own (never in this one)."""
        training = self.config.training
        spec = RunSpec.from_dict(plan.spec)
        trainer = binding.trainer.reference
        job = training.job_fields()
        worker = WorkerSpec(
            session="",
            node_pid=os.getpid(),
            org_id=self.org_identity.org_id,
            run_key=plan.run_key,
            trainer=trainer,
            run_config=dict(spec.config),
            node_config=self._node_config(binding),
            data=spec.data,
            dataset=binding.dataset,
            job=job,
            model_seed=self.config.engine.model_seed,
            participants=len(plan.participants),
        )
        task_kind = trainer.kind in ("bundled", "task")
        world = LocalJobSpec(task=trainer.name, **job).world_size if task_kind else 1
        launch = WorkerLaunch(
            world_size=world,
            persistent=training.worker == "persistent",
            start_timeout_s=training.start_timeout_s,
            round_timeout_s=training.round_timeout_s,
        )
        return WorkerTrainer(worker, work_dir, launch)

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
        self.ckks = CkksAggregator(endpoint, timeout=self.round_config.stage_timeout * 3)
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

    async def stop(self) -> None:
        """Abandon the current round cleanly (state stays at the last finished round), leave."""
        active = self._active
        if active is not None and active.task is not None:
            active.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await active.task
        for task in (self._follow, self._retry):
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

    def propose_add(self, member: Member, note: str) -> Manifest:
        m = self._require_manifest()
        try:
            proposal = m.propose_add(member, created_at=int(time.time()), note=note)
        except ManifestError as exc:
            raise ServiceRefused(str(exc)) from None
        return self._on_loop(self._sign_and_spread(proposal))

    def propose_remove(self, org_id: str, note: str) -> Manifest:
        m = self._require_manifest()
        try:
            proposal = m.propose_remove(org_id, created_at=int(time.time()), note=note)
        except ManifestError as exc:
            raise ServiceRefused(str(exc)) from None
        return self._on_loop(self._sign_and_spread(proposal))

    def sign_proposal(self, digest: str) -> Manifest:
        proposal = self._proposals.get(digest)
        if proposal is None:
            raise ServiceRefused(f"no pending proposal {digest}")
        return self._on_loop(self._sign_and_spread(proposal))

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

    # -- federation proposals over gossip -------------------------------------------

    async def _sign_and_spread(self, proposal: Manifest) -> Manifest:
        mine = proposal.sign(self.org_identity)
        own = dict(mine.signatures)[self.org_identity.org_id]
        merged = self._merge(mine.with_signatures({self.org_identity.org_id: own}))
        if self.gossip is not None:
            single = replace(mine, signatures=((self.org_identity.org_id, own),))
            self.gossip.publish(MANIFEST_TOPIC, mine.digest, single.to_json())
        return merged

    def _merge(self, candidate: Manifest) -> Manifest:
        """Add a proposal's signatures to the pending one; install it at quorum."""
        current = self._require_manifest()
        if candidate.previous != current.digest:
            raise ServiceRefused("the proposal does not follow the current manifest version")
        keys = current.public_keys()
        if candidate.proposal.action == "add":
            with contextlib.suppress(KeyError):
                keys[candidate.proposal.org_id] = candidate.member(
                    candidate.proposal.org_id
                ).public_key
        message = candidate.signing_bytes()
        valid = {
            org: sig
            for org, sig in candidate.signatures
            if org in keys and verify_signature(keys[org], message, sig)
        }
        if not valid:
            raise ServiceRefused("the proposal carries no valid member signature")
        pending = self._proposals.get(candidate.digest)
        base = pending if pending is not None else replace(candidate, signatures=())
        merged = base.with_signatures(valid)
        try:
            current.verify_successor(merged)
        except ManifestError:
            self._proposals[merged.digest] = merged
            return merged
        self._install(merged)
        return merged

    def _install(self, version: Manifest) -> None:
        self.chain.append(version)
        write_chain(self.paths.chain, self.chain)
        self._proposals = {d: p for d, p in self._proposals.items() if p.version > version.version}
        if self.membership is not None:
            self.membership.update_members(version.member_ids)
        logger.info("%s: installed manifest version %d", self.org_identity.org_id, version.version)

    async def _follow_proposals(self) -> None:
        assert self.gossip is not None
        queue: asyncio.Queue[SignedRecord] = self.gossip.subscribe(MANIFEST_TOPIC)
        while True:
            record = await queue.get()
            try:
                candidate = Manifest.from_json(record.record)
                self._merge(candidate)
            except (ManifestError, ServiceRefused, ValueError) as exc:
                logger.warning("%s: ignored a manifest proposal: %s", self.org_identity.org_id, exc)

    # -- runs -------------------------------------------------------------------------

    def _check_spec(self, spec: Mapping[str, Any]) -> RunPlan:
        m = self._require_manifest()
        name = "check"
        try:
            plan = RunPlan.from_spec(name, spec)
        except (KeyError, TypeError, ValueError) as exc:
            raise ServiceRefused(f"unreadable run spec: {exc}") from None
        me = self.org_identity.org_id
        if me not in plan.participants:
            raise ServiceRefused(f"{me} is not among the run's participants")
        strangers = sorted(set(plan.participants) - set(m.member_ids))
        if strangers:
            raise ServiceRefused(f"participants {strangers} are not federation members")
        if plan.backend == "ckks" and plan.epsilon is not None:
            raise ServiceRefused("DP (epsilon) needs the masked backend, not ckks")
        if plan.threshold < 2:
            raise ServiceRefused("threshold must be at least 2 for a secure sum")
        return plan

    def on_run_accepted(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._check_spec(spec)

    def on_run_declined(self, run_id: str, spec: Mapping[str, Any]) -> None:
        del run_id, spec

    def on_run_started(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._check_spec(spec)
        name = self._run_name(run_id)
        self._on_loop(self._launch(run_id, name, spec))

    def on_run_paused(self, run_id: str, spec: Mapping[str, Any]) -> None:
        active = self._require_active(run_id)
        self._call_soon(active.paused.set)

    def on_run_resumed(self, run_id: str, spec: Mapping[str, Any]) -> None:
        active = self._require_active(run_id)
        self._call_soon(active.paused.clear)

    def on_run_aborted(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._waiting.pop(run_id, None)
        active = self._active
        if active is not None and active.run_id == run_id and active.task is not None:
            self._call_soon(active.task.cancel)

    def _call_soon(self, fn: Callable[[], Any]) -> None:
        if self._loop is None:
            raise ServiceRefused("the node is not running")
        self._loop.call_soon_threadsafe(fn)

    def _require_active(self, run_id: str) -> _ActiveRun:
        active = self._active
        if active is None or active.run_id != run_id:
            raise ServiceRefused("the run is not active on this node")
        return active

    def _run_name(self, run_id: str) -> str:
        with Session(self.db) as session:
            row = session.get(Run, run_id)
            if row is None:
                raise ServiceRefused(f"no run {run_id}")
            return row.name

    async def _launch(self, run_id: str, name: str, spec: Mapping[str, Any]) -> None:
        if self.rounds is None:
            raise ServiceRefused("the node has not joined a federation")
        if self._active is not None and self._active.task and not self._active.task.done():
            raise ServiceRefused(f"run {self._active.run_id} is still active on this node")
        plan = RunPlan.from_spec(name, spec)
        run_dir = self.paths.run_dir(plan.run_key)
        rounds = self.rounds
        if self._history_run != plan.run_key and self.store is not None:
            # the history store numbers versions by round: start each run afresh
            old = [s.manifest.version for s in self.store.list(GLOBAL_OWNER, GLOBAL_SET)]
            if old:
                self.store.delete(GLOBAL_OWNER, GLOBAL_SET, sorted(set(old)))
            if self.endpoint is not None and self.membership is not None:
                self.history = GlobalHistoryStore(
                    self.endpoint,
                    self.store,
                    self.membership.live,
                    params=CodeParams(self.config.checkpoint.k, self.config.checkpoint.m),
                )
            self._history_run = plan.run_key

        binding = await asyncio.to_thread(self._binding, run_id)

        def build() -> RunEngine:
            engine = RunEngine(
                plan,
                self.config.engine,
                rounds=rounds,
                trainer=self.trainer_factory(plan, run_dir / "worker", binding),
                state_dir=run_dir,
                checkpoint=self._checkpoint,
                on_round=lambda report: self._on_round(run_id, report),
                debug_export=self.debug_export,
                catch_up=self._catch_up,
                ckks=self.ckks,
            )
            if engine.resume():
                logger.info(
                    "%s: resuming %s at round %d", rounds.org_id, run_id, engine.state.round
                )
            engine.state.plan["binding"] = _portable(binding)
            return engine

        try:
            engine = await asyncio.to_thread(build)
        except EngineError as exc:
            raise ServiceRefused(str(exc)) from None
        self._participants = plan.participants
        active = _ActiveRun(run_id, engine)
        active.task = asyncio.create_task(self._drive(active), name=f"run:{run_id}")
        self._active = active
        self._events.publish(
            run_id, "engine", {"run_key": plan.run_key, "round": engine.state.round}
        )

    def _binding(self, run_id: str) -> RunBinding:
        """The trainer and dataset this org bound to the run, checked again now."""
        with Session(self.db) as session:
            row = session.get(Run, run_id)
            if row is None:
                raise ServiceRefused(f"no run {run_id}")
            try:
                return binding_of(session, self.catalog, row)
            except ConsentRefused as exc:
                raise ServiceRefused(str(exc)) from None

    async def _drive(self, active: _ActiveRun) -> None:
        try:
            await self._drive_engine(active)
        finally:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(active.engine.close)

    async def _drive_engine(self, active: _ActiveRun) -> None:
        run_id = active.run_id
        me = self.org_identity.org_id
        try:
            outcome = await active.engine.run(paused=active.paused)
        except asyncio.CancelledError:
            logger.info("%s: run %s stopped between stages", me, run_id)
            raise
        except (
            RunFailed,
            UpdateRejected,
            ModelHashMismatch,
            EngineError,
            PrivacyError,
            TrainerFailed,
        ) as exc:
            reason = f"round {active.engine.state.round + 1} at {me}: {exc}"
            logger.warning("%s: run %s failed: %s", me, run_id, reason)
            self.finished[run_id] = f"failed: {reason}"
            self._events.publish(run_id, "error", {"message": reason})
            await asyncio.to_thread(self._set_state, run_id, RunAction.FAIL, reason)
            return
        except Exception as exc:  # any other failure fails the run loudly, never silently
            logger.exception("%s: run %s failed", self.org_identity.org_id, run_id)
            self.finished[run_id] = f"failed: {type(exc).__name__}: {exc}"
            await asyncio.to_thread(self._set_state, run_id, RunAction.FAIL, str(exc))
            return
        self.finished[run_id] = outcome.status
        self._events.publish(
            run_id,
            "outcome",
            {
                "status": outcome.status,
                "rounds": outcome.rounds_done,
                "model_hash": outcome.model_hash,
            },
        )
        await asyncio.to_thread(self._set_state, run_id, RunAction.COMPLETE, outcome.reason)

    def _set_state(self, run_id: str, action: RunAction, reason: str = "") -> None:
        """Apply an engine outcome to the run's row (waits for the API's own commit)."""
        deadline = time.monotonic() + 30.0
        while True:
            with Session(self.db) as session:
                row = session.get(Run, run_id)
                if row is None:
                    return
                try:
                    new = next_state(row.state, action)
                except InvalidTransition:
                    if row.state == RunState.ACCEPTED and time.monotonic() < deadline:
                        time.sleep(0.05)  # the start is not committed yet
                        continue
                    return
                values = {"state": new.value, "updated_at": utcnow()}
                if reason:
                    values["state_reason"] = reason[:2000]
                if update_versioned(
                    session, Run, run_id, row.version, values, where={"state": row.state}
                ):
                    append_audit_event(
                        session,
                        stage="control",
                        kind=f"run.{action.value}",
                        run=run_id,
                        privacy_class="internal",
                    )
                    session.commit()
                    version = row.version + 1
                    break
                session.rollback()
        self._events.publish(
            run_id, "state", {"state": new.value, "version": version, "reason": reason}
        )

    def _on_round(self, run_id: str, report: RoundReport) -> None:
        values: dict[str, float] = dict(report.metrics)
        values |= {
            "examples": float(report.examples),
            "local_steps": float(report.local_steps),
            "survivors": float(len(report.survivors)),
            "attempts": float(report.attempts),
            "bytes_sent": float(report.bytes_sent),
        }
        if report.epsilon_spent is not None:
            values["epsilon_spent"] = report.epsilon_spent
        with Session(self.db) as session:
            for name, value in sorted(values.items()):
                session.add(
                    RunMetric(run_id=run_id, round=report.round, name=name[:100], value=value)
                )
            session.execute(
                update(Run).where(Run.id == run_id).values(current_round=report.round)  # type: ignore[arg-type]
            )
            session.commit()
        with contextlib.suppress(Exception):
            self.egress.sign_head(report.run_key, report.round)
        try:
            record_round(self.paths.run_dir(report.run_key), report, self._participants)
        except (OSError, AuditError) as exc:
            logger.warning("%s: round %d not added to the round log: %s", run_id, report.round, exc)
        self._share_model(report)
        self._events.publish(
            run_id,
            "round",
            {
                "round": report.round,
                "model_hash": report.model_hash,
                "survivors": list(report.survivors),
                "dropped": list(report.dropped),
            },
        )
        self._events.publish(run_id, "metric", {"round": report.round, **values})

    def _share_model(self, report: RoundReport) -> None:
        """Keep this node's shards of the new global model and gossip its content hash,
        so that a node back from a crash can rebuild it and rejoin."""
        active = self._active
        if active is None or self.history is None or self.gossip is None:
            return
        data = model_to_bytes(active.engine.state.model)
        sha = hashlib.sha256(data).hexdigest()
        try:
            self.history.add_version(report.round, data, sha, members=report.survivors)
        except (ShardError, OSError) as exc:
            logger.warning("%s: global model history: %s", self.org_identity.org_id, exc)
        self.gossip.publish(MODEL_TOPIC, f"{report.run_key}/{report.round}", sha.encode())

    async def _catch_up(self, run_key: str, round: int) -> tuple[int, dict[str, Any]] | None:
        """The newest model of ``run_key`` past ``round`` that two other members agree on,
        rebuilt from the global-model history shards and checked against its hash."""
        if self.gossip is None or self.history is None or self.membership is None:
            return None
        me = self.org_identity.org_id
        votes: dict[tuple[int, str], set[str]] = {}
        for record in self.gossip.records(MODEL_TOPIC):
            key, _, num = record.key.rpartition("/")
            if key != run_key or not num.isdigit() or record.origin == me:
                continue
            votes.setdefault((int(num), record.record.decode("ascii", "replace")), set()).add(
                record.origin
            )
        agreed = sorted((r, sha) for (r, sha), who in votes.items() if r > round and len(who) >= 2)
        if not agreed:
            return None
        newest, sha = agreed[-1]
        try:
            data = await self.history.rebuild(newest, sha, self.membership.live())
            return newest, model_from_bytes(data)
        except (ShardError, EngineError) as exc:
            logger.warning("%s: cannot rebuild round %d yet: %s", me, newest, exc)
            return None

    async def _checkpoint(self, state: bytes, version: int) -> None:
        if self.replicator is None:
            return
        await self.replicator.checkpoint(state, version)

    async def _resume_runs(self) -> None:
        """Restart the engine of every run left running (a restart, or a recovered disk)."""
        if not self.paths.runs.exists():
            return
        for state_file in sorted(self.paths.runs.glob(f"*/{STATE_FILE}")):
            try:
                state = EngineState.from_bytes(state_file.read_bytes())
            except EngineError as exc:
                logger.warning("%s: unreadable %s: %s", self.org_identity.org_id, state_file, exc)
                continue
            if state.status != "running" or not state.plan:
                continue
            run_id = self._running_row(state)
            if run_id is None:
                continue
            self._waiting[run_id] = (state.plan["name"], state.plan["spec"])
        await self._resume_waiting()
        self._retry = asyncio.create_task(self._retry_waiting(), name="resume-waiting-runs")

    async def _resume_waiting(self) -> None:
        """Resume each run left running whose trainer and data are in place; note on the
        run's row why the others wait (e.g. a wiped node's dataset is not registered yet:
        its admin registers it again, and the run resumes)."""
        for run_id, (name, spec) in list(self._waiting.items()):
            try:
                await self._launch(run_id, name, spec)
            except ServiceRefused as exc:
                reason = f"waiting to resume at {self.org_identity.org_id}: {exc}"
                if self._reasons.get(run_id) != reason:
                    logger.warning("%s: run %s %s", self.org_identity.org_id, run_id, reason)
                    self._reasons[run_id] = reason
                    await asyncio.to_thread(self._note_reason, run_id, reason)
                continue
            del self._waiting[run_id]
            if self._reasons.pop(run_id, None) is not None:
                await asyncio.to_thread(self._note_reason, run_id, None)

    async def _retry_waiting(self) -> None:
        while True:
            await asyncio.sleep(RESUME_RETRY_S)
            if self._waiting:
                await self._resume_waiting()

    def _note_reason(self, run_id: str, reason: str | None) -> None:
        with Session(self.db) as session:
            session.execute(
                update(Run).where(Run.id == run_id).values(state_reason=reason)  # type: ignore[arg-type]
            )
            session.commit()

    def _running_row(self, state: EngineState) -> str | None:
        """The local run row of a saved state: the running one, or a new row after recovery."""
        from sqlmodel import select

        name, spec = state.plan["name"], state.plan["spec"]
        with Session(self.db) as session:
            rows = session.exec(select(Run).where(Run.name == name)).all()
            for row in rows:
                if RunPlan.from_spec(row.name, row.spec).run_key == state.run_key:
                    return row.id if row.state == RunState.RUNNING else None
            bound = dict(state.plan.get("binding") or {})
            row = Run(
                id=uuid.uuid4().hex,
                name=name,
                spec=dict(spec),
                state=RunState.RUNNING.value,
                current_round=state.round,
                proposed_by="recovery",
                decided_by="recovery",
                trainer_hash=bound.get("trainer_hash"),
                dataset_name=bound.get("dataset_name"),
                dataset_hash=bound.get("dataset_hash"),
                dataset_rows=bound.get("dataset_rows"),
            )
            session.add(row)
            append_audit_event(
                session, stage="control", kind="run.recover", run=row.id, privacy_class="internal"
            )
            session.commit()
            return row.id

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


def _portable(binding: RunBinding) -> dict[str, Any]:
    """What a rebuilt node needs to find its binding again (no local path or row id)."""
    values = binding.row_values()
    values.pop("dataset_id")
    return values


def read_chain(path: Path) -> list[Manifest]:
    """Read and verify a manifest chain file."""
    try:
        versions = load_chain(path.read_bytes())
        Manifest.verify_chain(versions)
    except (OSError, ManifestError) as exc:
        raise NodeError(f"cannot use the federation manifest {path}: {exc}") from None
    return versions


def write_chain(path: Path, versions: list[Manifest]) -> None:
    atomic_write(path, dump_chain(versions), mode=0o644)


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
