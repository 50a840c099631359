"""Fixtures for the admin API tests: a fake node, an app on SQLite in tmp_path, and one
token per role."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from coordinator_free.identity import OrgIdentity
from coordinator_free.manifest import Manifest, Member
from coordinator_free.membership import MemberState, MemberStatus
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Engine
from sqlmodel import Session

from api.app import create_app
from api.security import AuthFailureLimiter
from api.settings import Settings
from org_node.db.engine import DB_FILENAME, make_engine, migrate
from org_node.db.models import Role
from org_node.db.repo import create_token
from org_node.dp_spec import with_own_dp
from org_node.engine import EngineConfig
from org_node.proposals import Consent, Proposal, consent_signing_bytes
from org_node.run_store import store_consent
from org_node.services import (
    CheckpointInfo,
    NodeHealth,
    NodeIdentityInfo,
    RunActivity,
    RunEventBus,
    ServiceError,
    ServiceRefused,
    ShardReport,
    UnknownCheckpoint,
    make_proposal,
)

ORG = "org-a"


def identity(org_id: str) -> OrgIdentity:
    seed = org_id.encode().ljust(32, b"\x00")[:32]
    return OrgIdentity.generate(org_id, seed)


def member(org_id: str, port: int = 9000) -> Member:
    return Member.from_identity(identity(org_id), org_id.upper(), f"https://127.0.0.1:{port}")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeNode:
    """A node double: a real three-member manifest, a fixed peer view, recorded hooks,
    one checkpoint, and a switch that makes the next hook refuse."""

    events: RunEventBus = field(default_factory=RunEventBus)
    calls: list[tuple[str, str]] = field(default_factory=list)
    refuse_next: ServiceError | None = None
    ready: bool = True
    activity: RunActivity | None = None  # what every running run does now
    held_heads: list[Any] = field(default_factory=list)  # heads of its log peers hold
    _manifest: Manifest | None = None
    _pending: list[Manifest] = field(default_factory=list)

    def __post_init__(self) -> None:
        me, other, third = identity(ORG), identity("org-b"), identity("org-c")
        founders = [member(ORG, 9001), member("org-b", 9002), member("org-c", 9003)]
        m0 = Manifest.found("fed", founders, created_at=1)
        self._manifest = m0.sign(me).sign(other).sign(third)
        self._me = me

    def identity(self) -> NodeIdentityInfo:
        return NodeIdentityInfo(ORG, "Org A", self._me.fingerprint, "https://127.0.0.1:9001", "9")

    def health(self) -> NodeHealth:
        return NodeHealth(ready=self.ready, checks={"engine": "ok" if self.ready else "down"})

    def manifest(self) -> Manifest | None:
        return self._manifest

    def proposals(self) -> list[Manifest]:
        return list(self._pending)

    def propose_add(self, member: Member, note: str) -> Manifest:
        assert self._manifest is not None
        p = self._manifest.propose_add(member, created_at=2, note=note).sign(self._me)
        self._pending.append(p)
        return p

    def propose_remove(self, org_id: str, note: str) -> Manifest:
        assert self._manifest is not None
        p = self._manifest.propose_remove(org_id, created_at=2, note=note)
        self._pending.append(p)
        return p

    def sign_proposal(self, digest: str) -> Manifest:
        for i, p in enumerate(self._pending):
            if p.digest == digest:
                self._pending[i] = p.sign(self._me)
                return self._pending[i]
        raise ServiceRefused("no such proposal")

    def peers(self) -> list[MemberState]:
        return [MemberState("org-b", MemberStatus.ALIVE, 3, last_seen=None, rtt=0.004, since=0.0)]

    def _hook(self, name: str, run_id: str) -> None:
        if self.refuse_next is not None:
            exc, self.refuse_next = self.refuse_next, None
            raise exc
        self.calls.append((name, run_id))

    def propose_run(
        self, name: str, spec: Mapping[str, Any], consent_timeout_s: int, start_delay_s: int
    ) -> Proposal:
        if self.refuse_next is not None:
            exc, self.refuse_next = self.refuse_next, None
            raise exc
        # as the node does: a run with an epsilon gets this org's DP mechanism
        spec = with_own_dp(spec, EngineConfig())
        return make_proposal(ORG, self._manifest, name, spec, consent_timeout_s, start_delay_s)

    def announce_run(self, run_id: str) -> None:
        self.calls.append(("announced", run_id))

    def on_run_accepted(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._hook("accepted", run_id)

    def on_run_declined(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._hook("declined", run_id)

    def on_run_started(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._hook("started", run_id)

    def on_run_paused(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._hook("paused", run_id)

    def on_run_resumed(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._hook("resumed", run_id)

    def on_run_aborted(self, run_id: str, spec: Mapping[str, Any]) -> None:
        self._hook("aborted", run_id)

    def run_activity(self, run_id: str) -> RunActivity | None:
        return self.activity

    def peer_heads(self) -> list[Any]:
        return list(self.held_heads)

    def checkpoints(self) -> list[CheckpointInfo]:
        return [CheckpointInfo("ck-1", "run-1", 4, 1.5, 3, 2, "ab" * 32)]

    def verify_checkpoint(self, checkpoint_id: str) -> ShardReport:
        if checkpoint_id != "ck-1":
            raise UnknownCheckpoint(checkpoint_id)
        return ShardReport("ck-1", 4, ("org-c",), (), True)

    def restore_checkpoint(self, checkpoint_id: str) -> CheckpointInfo:
        if checkpoint_id != "ck-1":
            raise UnknownCheckpoint(checkpoint_id)
        return self.checkpoints()[0]


@dataclass
class Api:
    """The app under test, its client, its engine, its node, and a token per role."""

    app: FastAPI
    client: TestClient
    engine: Engine
    node: FakeNode
    tokens: dict[Role, str]
    data_root: Path
    clock: FakeClock

    def h(self, role: Role = Role.ADMIN, **extra: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}", **extra}


def make_api(
    tmp_path: Path, url: str | None = None, template: Path | None = None, **settings: Any
) -> Iterator[Api]:
    """An app on ``url`` (default: SQLite in ``tmp_path``, copied from ``template``)."""
    if url is None and template is not None:
        (tmp_path / "node").mkdir(exist_ok=True)
        shutil.copyfile(template, tmp_path / "node" / DB_FILENAME)
    data_root = tmp_path / "datasets"
    data_root.mkdir(exist_ok=True)
    config = Settings(
        data_dir=tmp_path / "node",
        database_url=url,
        dataset_roots=(data_root,),
        **settings,
    )
    engine = make_engine(config.resolved_database_url)
    clock = FakeClock()
    limiter = AuthFailureLimiter(
        config.auth_failure_limit, config.auth_failure_window_s, clock=clock
    )
    node = FakeNode()
    app = create_app(config, node, engine=engine, limiter=limiter)
    tokens: dict[Role, str] = {}
    with Session(engine) as session:
        for role in Role:
            _, tokens[role] = create_token(session, f"{role.value}-token", role)
        session.commit()
    with TestClient(app) as client:
        yield Api(app, client, engine, node, tokens, data_root, clock)
    engine.dispose()


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated once per session; each test gets a copy."""
    path = tmp_path_factory.mktemp("template") / DB_FILENAME
    engine = make_engine(f"sqlite:///{path}")
    migrate(engine)
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    engine.dispose()
    return path


@pytest.fixture
def api(tmp_path: Path, migrated_sqlite: Path) -> Iterator[Api]:
    yield from make_api(tmp_path, template=migrated_sqlite)


RUN_SPEC: dict[str, Any] = {
    "trainer": "breast_cancer",
    "rounds": 3,
    "participants": [ORG, "org-b", "org-c"],
    "backend": "masked",
    "threshold": 2,
    "epsilon": 4.0,
}


def propose_run(api: Api, *, peers_accept: bool = True, **spec: Any) -> dict[str, Any]:
    """Propose a run here; with ``peers_accept`` the other participants' signed consents
    are recorded as if they had arrived over gossip (so that this org's accept is the
    last one and the run may start)."""
    r = api.client.post("/v1/runs", json={"name": "r1", "spec": RUN_SPEC | spec}, headers=api.h())
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    if peers_accept:
        peer_consents(api, body["run_key"], *(p for p in body["spec"]["participants"] if p != ORG))
    return body


FEDERATION = "fed"
"""The fake node's federation (its manifest's id)."""


def peer_consents(api: Api, run_key: str, *orgs: str, decision: str = "accept") -> None:
    """Record ``orgs``' consent (or decline) of ``run_key`` as the node does on receipt:
    signed by each org in the fake federation."""
    with Session(api.engine) as s:
        for org in orgs:
            reason = "" if decision == "accept" else f"{org} says no"
            consent = Consent(run_key, org, decision, reason, int(time.time() * 1000))  # type: ignore[arg-type]
            signed = identity(org).sign(consent_signing_bytes(FEDERATION, consent))
            assert store_consent(s, consent, signed.hex())
        s.commit()
