"""The org node's composition root: every layer and part composed into one object that
serves the admin API.

:class:`OrgNode` builds the node's shared :class:`~org_node.node.context.NodeContext`
(identity, recovery secret, config, database, egress log, trainer catalog, run event
bus, the verified manifest chain) and, when it starts, the layers on it in order: the
signed :class:`~coordinator_free.endpoint.Endpoint` (over mutual-TLS HTTPS, or an
in-memory transport in tests) with the egress log as its egress hook, the shard store
and the :class:`~coordinator_free.checkpoints.ShardService` it serves to its peers, the
leaderless :class:`~coordinator_free.rounds.RoundEngine` and the CKKS aggregator, SWIM
:class:`~coordinator_free.membership.Membership`, signed
:class:`~coordinator_free.gossip.Gossip`, the
:class:`~coordinator_free.checkpoints.CheckpointReplicator` of its own private state and
the global-model history. Its parts each own one concern:

* :class:`~org_node.node.federation.Federation` — membership changes and the installed
  manifest (and so whom the peer port trusts);
* :class:`~org_node.node.proposals.RunProposals` — runs proposed once, consented to by
  each participant, started at the agreed time;
* :class:`~org_node.node.runs.Runs` — the active run's engine, its hooks, resuming;
* :class:`~org_node.node.checkpoints.Checkpoints` — this org's checkpoints at its peers.

It implements :class:`~org_node.services.NodeServices` by handing each call to the part
that owns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coordinator_free.checkpoints import (
    CheckpointReplicator,
    GlobalHistoryStore,
    ShardService,
    ShardStore,
)
from coordinator_free.endpoint import Endpoint
from coordinator_free.erasure import CodeParams
from coordinator_free.errors import CoordinatorFreeError
from coordinator_free.gossip import Gossip, GossipConfig
from coordinator_free.identity import OrgIdentity
from coordinator_free.manifest import Manifest, Member
from coordinator_free.membership import Membership, MemberState, SwimConfig
from coordinator_free.rounds import (
    RoundConfig,
    RoundEngine,
    endpoint_signer,
    secagg_sessions,
)
from coordinator_free.rounds.ckks import CkksAggregator
from coordinator_free.sealed import (
    RecoverySecret,
)
from coordinator_free.tls import TlsTransport
from coordinator_free.transport import Transport
from sqlalchemy import Engine

from org_node import __version__
from org_node.audit import AuditError, EgressLog, RunFacts, SignedHead
from org_node.audit.facts import node_report, node_run_facts
from org_node.config import NodeConfig, NodePaths
from org_node.db.engine import default_database_url, make_engine, migrate
from org_node.engine import ATTEMPTS
from org_node.node.checkpoints import Checkpoints
from org_node.node.context import NodeContext
from org_node.node.federation import Federation
from org_node.node.files import NodeError, load_secret, read_chain, save_secret
from org_node.node.heads import AuditHeads, lost_entries
from org_node.node.leftovers import clean_leftovers
from org_node.node.proposals import RunProposals
from org_node.node.runs import Runs, TrainerFactory
from org_node.observability import Observability
from org_node.passphrase import with_hint
from org_node.proposals import Proposal
from org_node.services import (
    CheckpointInfo,
    NodeHealth,
    NodeIdentityInfo,
    RunActivity,
    RunEventBus,
    ShardReport,
)
from org_node.trainers.catalog import TrainerCatalog

__all__ = [
    "HARNESS_EXPORT_ENV",
    "NodeError",
    "OrgNode",
    "load_secret",
    "read_chain",
    "save_secret",
]

logger = logging.getLogger("org_node.node")

EGRESS_COMMIT_S = 0.005
"""Group commit of the egress log: a record is fsynced at most this long after it is
written, by one fsync for every record written meanwhile (``docs/SECURITY.md``)."""

HARNESS_EXPORT_ENV = "FEDWEAVE_HARNESS_DEBUG_EXPORT"
"""Test harnesses only: a directory for each round's plaintext update (see
:mod:`org_node.engine`); refused unless the config says ``[debug] harness = true``."""


class OrgNode(NodeContext):
    """One org's running node (see the module docstring). It is the context its parts
    share, so the layers are its attributes (``node.gossip``, ``node.rounds`` …)."""

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
        paths = NodePaths(Path(data_dir))
        super().__init__(
            paths=paths,
            config=config,
            org_identity=identity,
            secret=secret,
            db=db or make_engine(default_database_url(paths.root)),
            egress=_egress_log(identity, paths),
            catalog=TrainerCatalog(config.trainers),
            events=events or RunEventBus(),
            chain=list(chain or []),
        )
        self._transport = transport
        self.swim = swim or _swim_config(config)
        self.round_config = round_config or RoundConfig(
            ready_timeout=config.engine.ready_timeout_s,
            lookahead_rounds=2 * ATTEMPTS,
            max_open_rounds=34,
            attempts_per_round=ATTEMPTS,
            owner_unmask_from=config.engine.owner_unmask_from or None,
            mask_helper=config.engine.mask_helper,
            prepared_masks_bytes=(config.engine.prepared_masks_mb << 20) or None,
            ring_first=config.engine.ring_first,
        )
        self.observability = Observability(
            identity.org_id,
            self.chain[-1].federation if self.chain else "",
            attempts_per_round=ATTEMPTS,
        )
        """Stage metrics, peer fault scores and the round timeline (dashboard, /metrics)."""
        self.federation = Federation(self)
        self.runs = Runs(self, trainer_factory, _debug_export(config))
        self.run_proposals = RunProposals(self, self.runs.launch)
        self.stored_checkpoints = Checkpoints(self, self.runs)
        self.audit_heads = AuditHeads(self)
        self.runs.on_round_done = self.audit_heads.after_round
        self.runs.settle_heads = self.audit_heads.settle
        self.federation.on_install = self.runs.on_manifest

    # ------------------------------------------------------------------ construction

    @classmethod
    def open(cls, data_dir: Path, *, passphrase: bytes | None = None, **kw: Any) -> OrgNode:
        """A node from an initialized data directory (``fedweave init``); ``passphrase``
        opens an encrypted identity key and recovery secret (``init --passphrase-file``)."""
        paths = NodePaths(Path(data_dir))
        if not paths.config.exists():
            raise NodeError(f"{data_dir} is not a node data directory: run `fedweave init`")
        config = NodeConfig.load(paths.config)
        try:
            identity = OrgIdentity.load(paths.identity_dir, passphrase)
        except CoordinatorFreeError as exc:
            raise NodeError(with_hint(str(exc))) from None
        secret = load_secret(paths.secret, passphrase)
        chain = read_chain(paths.chain) if paths.chain.exists() else []
        return cls(paths.root, config, identity, secret, chain=chain, **kw)

    def _live(self) -> list[str]:
        """Members the SWIM view believes alive (all of them before it is running)."""
        if self.membership is None:
            return list(self._peers_for_rounds())
        return self.membership.live()

    def _peers_for_rounds(self) -> tuple[str, ...]:
        """The active run's participants that are still members (or every member)."""
        m = self.current_manifest
        members = m.member_ids if m is not None else ()
        return tuple(p for p in self.runs.participants if p in members) or members

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Migrate the database, join the federation's overlay, resume a running run."""
        self.loop = asyncio.get_running_loop()
        await asyncio.to_thread(clean_leftovers, self.paths, self.config.datasets.roots)
        await asyncio.to_thread(migrate, self.db)
        await asyncio.to_thread(self.runs.admission.load, self.db)
        manifest = self.current_manifest
        if manifest is None:
            logger.info("%s: no federation installed yet", self.me)
            return
        endpoint = self._build_endpoint(manifest)
        self._build_rounds(endpoint)
        await endpoint.start()
        self.membership = await Membership.create(endpoint, manifest.member_ids, self.swim)
        self.gossip = await Gossip.create(
            endpoint,
            self.membership,
            GossipConfig(period_s=min(GossipConfig().period_s, self.swim.period_s)),
        )
        self._build_checkpoints(endpoint, self.membership)
        self.audit_heads.start()
        self.federation.start()
        await self.runs.resume()
        await self.run_proposals.start()

    def _build_endpoint(self, manifest: Manifest) -> Endpoint:
        """The signed endpoint over mutual TLS (or the given transport), and the shard
        store and service it carries."""
        transport = self._transport
        if transport is None:
            self.tls = TlsTransport(
                self.org_identity,
                lambda: self.current_manifest.peer_addresses() if self.current_manifest else {},
            )
            transport = self.tls
        endpoint = Endpoint(
            self.org_identity,
            manifest.federation,
            transport,
            self.member_keys,
            on_egress=self.egress,
        )
        self.endpoint = endpoint
        self.store = ShardStore(
            self.paths.shards, quota_bytes_per_owner=self.config.checkpoint.quota_mb << 20
        )
        ShardService(endpoint, self.store, self.member_keys)
        return endpoint

    def _build_rounds(self, endpoint: Endpoint) -> None:
        """The round engine (watched by the observability) and the CKKS aggregator."""
        self.rounds = RoundEngine(
            endpoint,
            self._peers_for_rounds,
            secagg_sessions(*endpoint_signer(endpoint)),
            self.round_config,
            live=self._live,
            admit=self.runs.admission.for_backend("masked"),
        )
        self.observability.attach(self.rounds)
        self.ckks = CkksAggregator(
            endpoint,
            model_hashes=self.rounds.model_hashes,
            timeout=self.round_config.stage_timeout * 3,
            admit=self.runs.admission.for_backend("ckks"),
        )

    def _build_checkpoints(self, endpoint: Endpoint, membership: Membership) -> None:
        """This org's checkpoint replicator and the federation's global-model history."""
        assert self.store is not None
        params = CodeParams(self.config.checkpoint.k, self.config.checkpoint.m)
        self.replicator = CheckpointReplicator(
            endpoint,
            self.secret,
            membership.live,
            params=params,
            retention=self.config.checkpoint.retention,
        )
        self.history = GlobalHistoryStore(endpoint, self.store, membership.live, params=params)

    async def stop(self) -> None:
        """Abandon the current round cleanly (state stays at the last finished round), leave."""
        await self.runs.stop()
        await self.audit_heads.stop()
        await self.federation.stop()
        await self.run_proposals.stop()
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

    # ------------------------------------------------------------------ NodeServices

    def identity(self) -> NodeIdentityInfo:
        return NodeIdentityInfo(
            org_id=self.me,
            display_name=self.config.node.display_name or self.me,
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
        status = self.runs.engine_status() if self.loop is not None else "idle"
        checks["engine"] = "stopped" if status == "stopped" else "ok"
        failure = self.egress.failure
        checks["egress log"] = failure or "ok"
        ready = self.current_manifest is not None and failure is None
        return NodeHealth(ready=ready, checks=checks)

    def manifest(self) -> Manifest | None:
        return self.current_manifest

    def proposals(self) -> list[Manifest]:
        if self.loop is None:
            return []
        return self.federation.proposals()

    def propose_add(self, member: Member, note: str) -> Manifest:
        return self.federation.propose_add(member, note)

    def propose_remove(self, org_id: str, note: str) -> Manifest:
        return self.federation.propose_remove(org_id, note)

    def sign_proposal(self, digest: str) -> Manifest:
        return self.federation.sign_proposal(digest)

    def trusted_certificates(self) -> list[bytes]:
        """Whom the peer port admits now: the current members' certificates."""
        return self.federation.trusted()

    def peers(self) -> list[MemberState]:
        membership = self.membership
        if membership is None:
            return []
        view = self.read(membership.view)
        return [s for org, s in sorted(view.items()) if org != self.me]

    def identity_record(self) -> Member:
        """This org's member record (what ``fedweave init`` writes to ``member.json``)."""
        return Member.from_identity(
            self.org_identity,
            self.config.node.display_name or self.me,
            self.config.network.peer_url,
        )

    def propose_run(
        self, name: str, spec: Mapping[str, Any], consent_timeout_s: int, start_delay_s: int
    ) -> Proposal:
        return self.run_proposals.propose_run(name, spec, consent_timeout_s, start_delay_s)

    def announce_run(self, run_id: str) -> None:
        self.run_proposals.announce_run(run_id)

    def on_run_accepted(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self.runs.on_run_accepted(run_id, spec)

    def on_run_declined(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self.runs.on_run_declined(run_id, spec)

    def on_run_started(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self.runs.on_run_started(run_id, spec)

    def on_run_paused(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self.runs.on_run_paused(run_id, spec)

    def active_run_id(self) -> str:
        """The local id of the run whose engine runs here ("" when none does)."""
        return self.runs.active_run_id()

    def on_run_resumed(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self.runs.on_run_resumed(run_id, spec)

    def on_run_aborted(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self.runs.on_run_aborted(run_id, spec)

    def run_activity(self, run_id: str) -> RunActivity | None:
        return self.runs.run_activity(run_id)

    def checkpoints(self) -> list[CheckpointInfo]:
        return self.stored_checkpoints.checkpoints()

    def verify_checkpoint(self, checkpoint_id: str) -> ShardReport:
        return self.stored_checkpoints.verify(checkpoint_id)

    def restore_checkpoint(self, checkpoint_id: str) -> CheckpointInfo:
        return self.stored_checkpoints.restore(checkpoint_id)

    def peer_heads(self) -> list[SignedHead]:
        """The heads of this org's log its live members hold (asked now)."""
        heads, missed = self.on_loop(self.audit_heads.from_peers(), timeout=30.0)
        for peer, why in sorted(missed.items()):
            logger.warning("%s: no heads from %s: %s", self.me, peer, why)
        return heads

    def run_facts(self, run_id: str) -> RunFacts:
        """The facts of run ``run_id``'s privacy report, from this node's database, round
        log and engine config (:func:`org_node.audit.facts.node_run_facts`)."""
        return node_run_facts(
            self.db, self.paths.root, run_id, org_id=self.me, config=self.config.engine
        )

    def run_report(self, run_id: str) -> Mapping[str, Any]:
        """The signed privacy report of run ``run_id`` (:class:`~org_node.services.RunReports`),
        stating what the heads the peers hold prove this org's log lost (a wipe)."""
        lost: list[str] = []
        key = self.runs.run_key_of(run_id)
        if self.loop is not None and self.endpoint is not None and key:
            try:
                lost = lost_entries(self.egress, self.peer_heads(), key)
            except Exception as exc:  # the report says so rather than claim nothing is lost
                lost = [f"the peers' heads of this org's log could not be fetched: {exc}"]
        return node_report(
            self.db,
            self.paths.root,
            run_id,
            identity=self.org_identity,
            config=self.config.engine,
            log=self.egress,
            anomalies=lost,
        )


def _egress_log(identity: OrgIdentity, paths: NodePaths) -> EgressLog:
    """The node's egress log, continued (a torn last record is cut and the repair
    recorded); :class:`NodeError` in one line when the file cannot be continued."""
    try:
        return EgressLog(identity, paths.egress_log, commit_within_s=EGRESS_COMMIT_S)
    except (AuditError, OSError) as exc:
        raise NodeError(
            f"the egress log {paths.egress_log} cannot be continued: {exc} (`fedweave audit "
            "verify` on it shows the first bad record; move the file aside to start a new log)"
        ) from None


def _swim_config(config: NodeConfig) -> SwimConfig:
    """The ``[membership]`` table; with ``[debug] fast_membership`` (nodes on one host)
    a 0.2 s period and an 80 ms ping floor, timeouts still growing with the measured
    round trips up to 2 s."""
    if not config.debug.fast_membership:
        return config.membership
    return dataclasses.replace(
        config.membership, period_s=0.2, ping_timeout_s=0.08, max_ping_timeout_s=2.0
    )


def _debug_export(config: NodeConfig) -> Path | None:
    target = os.environ.get(HARNESS_EXPORT_ENV)
    if not target:
        return None
    if not config.debug.harness:
        raise NodeError(
            f"{HARNESS_EXPORT_ENV} is set but the config does not say "
            "[debug] harness = true; refusing to write plaintext updates"
        )
    logger.warning("harness debug export is ON: plaintext updates go to %s", target)
    return Path(target)
