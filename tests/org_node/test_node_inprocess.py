"""Three org nodes in one process: init'ed data dirs, a founded federation, the admin API
driving a run over an in-memory network, then a wiped node recovering its state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from coordinator_free.endpoint import Endpoint
from coordinator_free.membership import SwimConfig
from coordinator_free.memory import InMemoryNetwork

from api.app import create_app
from api.settings import Settings
from org_node.engine import EngineState, RunPlan, model_hash
from org_node.initialize import (
    InitError,
    found_manifest,
    initialize,
    install_manifest,
    prepare_recovery,
    sign_manifest,
)
from org_node.node import OrgNode, load_secret, read_chain, recover_state
from org_node.services import NodeServices
from org_node.trainers.code import code_hash
from org_node.training.exchange import LocalResult
from tests.run_flow import apropose_once

ORGS = ("org-a", "org-b", "org-c")
MODEL_SHAPES = {"w": (3, 2), "b": (2,)}


class TinyTrainer:
    """A deterministic local job: each org moves every weight by its own constant.

    Its round-0 model is a two-tensor linear model (the same at every org)."""

    def __init__(self, value: float, seconds: float = 0.0) -> None:
        self.value = value
        self.seconds = seconds

    def initial_model(self) -> dict[str, np.ndarray]:
        return {"weight": np.zeros((2, 3), np.float32), "bias": np.zeros(2, np.float32)}

    def train(
        self, global_state: Mapping[str, np.ndarray], round: int, options: Mapping[str, Any]
    ) -> LocalResult:
        if self.seconds:
            time.sleep(self.seconds)
        update = {k: np.full(np.shape(v), self.value, np.float32) for k, v in global_state.items()}
        return LocalResult(update, 8, 2, {"train_loss": 0.5})


def make_federation(tmp_path: Path) -> dict[str, Path]:
    dirs = {o: tmp_path / o for o in ORGS}
    for i, (org, d) in enumerate(dirs.items()):
        initialize(d, org, peer_port=9100 + 2 * i, admin_port=9101 + 2 * i)
    unsigned = tmp_path / "manifest.json"
    found_manifest("fed-test", [d / "member.json" for d in dirs.values()], unsigned, created_at=1)
    for d in dirs.values():
        sign_manifest(d, unsigned)
    for d in dirs.values():
        install_manifest(d, unsigned)
    return dirs


async def start_nodes(
    dirs: Mapping[str, Path],
    network: InMemoryNetwork,
    orgs: tuple[str, ...] = ORGS,
    seconds: float = 0.0,
) -> dict[str, OrgNode]:
    nodes = {}
    for i, org in enumerate(orgs):
        node = OrgNode.open(
            dirs[org],
            transport=network.transport(org),
            trainer_factory=lambda plan, work, binding, i=i: TinyTrainer(0.1 * (i + 1), seconds),
            swim=SwimConfig(period_s=0.2, ping_timeout_s=0.08),
        )
        await node.start()
        nodes[org] = node
    return nodes


def test_init_refuses_a_non_empty_dir_and_a_manifest_without_every_founder(tmp_path: Path) -> None:
    initialize(tmp_path / "a", "org-a", peer_port=9000, admin_port=9001)
    with pytest.raises(InitError, match="not empty"):
        initialize(tmp_path / "a", "org-a", peer_port=9000, admin_port=9001)
    initialize(tmp_path / "b", "org-b", peer_port=9002, admin_port=9003)
    out = tmp_path / "m.json"
    found_manifest("f", [tmp_path / "a" / "member.json", tmp_path / "b" / "member.json"], out)
    sign_manifest(tmp_path / "a", out)
    with pytest.raises(InitError, match=r"did not sign"):
        install_manifest(tmp_path / "a", out)


@pytest.mark.parametrize("backend", ["masked", "ckks"])
def test_three_nodes_run_through_the_admin_api_and_a_wiped_node_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    dirs = make_federation(tmp_path)
    tokens = {}
    for org in ORGS:
        # init showed the admin token once; make a fresh one for the test clients
        from sqlmodel import Session

        from org_node.db.engine import default_database_url, make_engine
        from org_node.db.models import Role
        from org_node.db.repo import create_token

        with Session(make_engine(default_database_url(dirs[org]))) as s:
            _, tokens[org] = create_token(s, "test", Role.ADMIN)
            s.commit()
    spec = {
        "trainer": "breast_cancer",
        "rounds": 2,
        "participants": list(ORGS),
        "threshold": 2,
        "backend": backend,
    }

    async def scenario() -> tuple[dict[str, Any], dict[str, OrgNode], bytes, bytes]:
        network = InMemoryNetwork()
        nodes = await start_nodes(dirs, network)
        clients = {}
        for org, node in nodes.items():
            assert isinstance(node, NodeServices)
            app = create_app(Settings(data_dir=dirs[org]), node, engine=node.db)
            clients[org] = httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app),
                base_url="http://admin",
                headers={"Authorization": f"Bearer {tokens[org]}"},
            )
        results: dict[str, Any] = {}
        try:
            run_ids = await apropose_once(clients, "demo", spec)
            for _ in range(300):
                states = {}
                for org, c in clients.items():
                    states[org] = (await c.get(f"/v1/runs/{run_ids[org]}")).json()["state"]
                if set(states.values()) == {"completed"}:
                    break
                await asyncio.sleep(0.05)
            results["states"] = states
            results["metrics"] = (
                await clients["org-a"].get(f"/v1/runs/{run_ids['org-a']}/metrics")
            ).json()
            results["run"] = (await clients["org-b"].get(f"/v1/runs/{run_ids['org-b']}")).json()
            results["hashes"] = {
                org: n.runs.active.engine.state.model for org, n in nodes.items() if n.runs.active
            }
            results["checkpoints"] = await asyncio.to_thread(nodes["org-c"].checkpoints)
            state_c = (
                nodes["org-c"].runs.active.engine.state_path.read_bytes()  # type: ignore[union-attr]
            )
            # org-c loses its disk: a new data dir from its backup and the chain
            fresh = tmp_path / "org-c-new"
            backup = dirs["org-c"] / "org-c-recovery-backup.json"
            paths, token = prepare_recovery(
                fresh, backup, dirs["org-a"] / "federation" / "chain.json"
            )
            assert token.startswith("fw_")
            await nodes["org-c"].stop()
            recovering = OrgNode.open(fresh, transport=None)
            endpoint = Endpoint(
                recovering.org_identity,
                "fed-test",
                _Revived(network, "org-c"),
                lambda: read_chain(paths.chain)[-1].public_keys(),
            )
            path = await recover_state(
                endpoint, load_secret(paths.secret), list(ORGS), paths, timeout=10
            )
            recovered = path.read_bytes()
        finally:
            for c in clients.values():
                await c.aclose()
            for org, node in nodes.items():
                if org != "org-c":
                    await node.stop()
        return results, nodes, recovered, state_c

    results, _nodes, recovered, held = asyncio.run(scenario())
    assert results["states"] == {o: "completed" for o in ORGS}
    models = list(results["hashes"].values())
    assert len(models) == 3
    for m in models[1:]:
        for k in m:
            np.testing.assert_array_equal(m[k], models[0][k])
    assert results["run"]["current_round"] == 2
    names = {(m["round"], m["name"]) for m in results["metrics"]["data"]}
    assert {(1, "survivors"), (2, "survivors"), (2, "train_loss")} <= names
    assert [c.round for c in results["checkpoints"]] == [1, 2]
    got, had = EngineState.from_bytes(recovered), EngineState.from_bytes(held)
    # checkpointed after its last round: recovery knows the run ended
    assert (got.round, got.status, had.status) == (2, "completed", "completed")
    assert model_hash(got.model) == model_hash(had.model)
    assert got.plan == had.plan
    assert got.plan["name"] == "demo" and got.plan["spec"]["trainer"] == "breast_cancer"
    # the binding travels with the state, so a rebuilt node finds its trainer again
    assert got.plan["binding"]["trainer_hash"] == code_hash("bundled", "breast_cancer")
    key = RunPlan.from_spec("demo", spec).run_key
    assert (tmp_path / "org-c-new" / "runs" / key / "engine-state.bin").exists()
    log = (dirs["org-a"] / "audit" / "egress.jsonl").read_text()
    first = '"round.ready"' if backend == "masked" else '"ckks.partial"'
    assert first in log and '"shard.put"' in log


def _rounds_recorded(node: OrgNode, run_id: str) -> list[tuple[int]]:
    from sqlmodel import Session, select

    from org_node.db.models import RunMetric

    with Session(node.db) as s:
        return [
            (m.round,)
            for m in s.exec(select(RunMetric).where(RunMetric.run_id == run_id)).all()
            if m.name == "survivors"
        ]


class _Revived:
    """org-c's transport on the same network after its old node closed."""

    def __init__(self, network: InMemoryNetwork, org: str) -> None:
        from coordinator_free.memory import InMemoryTransport

        self.inner = InMemoryTransport(network, org)
        self.org_id = org

    async def start(self, handler: Any) -> None:
        await self.inner.start(handler)

    async def request(self, peer: str, data: bytes, *, timeout: float) -> bytes:
        return await self.inner.request(peer, data, timeout=timeout)

    async def close(self) -> None:
        await self.inner.close()


def test_a_node_that_crashed_rejoins_at_the_current_round(tmp_path: Path) -> None:
    from org_node.config import NodeConfig
    from org_node.engine import EngineConfig

    dirs = make_federation(tmp_path)
    for d in dirs.values():
        config = NodeConfig.load(d / "fedweave.toml")
        config.replace(engine=EngineConfig(ready_timeout_s=3.0, model_hash_timeout_s=3)).save(
            d / "fedweave.toml"
        )
    spec = {"trainer": "breast_cancer", "rounds": 12, "participants": list(ORGS), "threshold": 2}
    run_ids: dict[str, str] = {}
    for org, d in dirs.items():
        from sqlmodel import Session

        from org_node.db.engine import default_database_url, make_engine
        from org_node.db.models import Run

        with Session(make_engine(default_database_url(d))) as s:
            row = Run(
                name="long",
                spec=spec | {"backend": "masked", "epsilon": None},
                state="running",
                proposed_by="test",
                id=f"{org}-run".replace("-", ""),
            )
            s.add(row)
            s.commit()
            run_ids[org] = row.id

    async def wait_for(cond: Any, timeout: float = 60) -> None:
        end = asyncio.get_running_loop().time() + timeout
        while not cond():
            assert asyncio.get_running_loop().time() < end, "timed out"
            await asyncio.sleep(0.05)

    async def scenario() -> dict[str, bytes]:
        network = InMemoryNetwork()
        nodes = await start_nodes(dirs, network, seconds=0.4)
        for org, node in nodes.items():
            await asyncio.to_thread(
                node.on_run_started, run_ids[org], spec | {"backend": "masked", "epsilon": None}
            )
        c = nodes["org-c"]
        await wait_for(lambda: c.runs.active is not None and c.runs.active.engine.state.round >= 1)
        await c.stop()
        a = nodes["org-a"]
        await wait_for(lambda: a.runs.active is not None and a.runs.active.engine.state.round >= 3)
        revived = OrgNode.open(
            dirs["org-c"],
            transport=_Revived(network, "org-c"),
            trainer_factory=lambda plan, work, binding: TinyTrainer(0.3, 0.4),
            swim=SwimConfig(period_s=0.2, ping_timeout_s=0.08),
        )
        await revived.start()
        nodes["org-c"] = revived
        try:
            await wait_for(lambda: all(run_ids[o] in n.runs.finished for o, n in nodes.items()), 40)
        finally:
            for node in nodes.values():
                await node.stop()
        assert {n.runs.finished[run_ids[o]] for o, n in nodes.items()} == {"completed"}
        rejoined = {r for (r,) in _rounds_recorded(revived, run_ids["org-c"])}
        # it caught up (skipping rounds it never trained), then trained rounds again
        assert max(rejoined) > 1 and len(rejoined) < 12
        return {
            o: model_hash(n.runs.active.engine.state.model)  # type: ignore[union-attr]
            for o, n in nodes.items()
        }

    hashes = asyncio.run(scenario())
    assert len(set(hashes.values())) == 1


def test_harness_debug_export_is_refused_unless_the_config_allows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from org_node.config import DebugSection, NodeConfig
    from org_node.node import HARNESS_EXPORT_ENV, NodeError

    initialize(tmp_path / "n", "org-n", peer_port=9200, admin_port=9201)
    assert OrgNode.open(tmp_path / "n").runs.debug_export is None
    monkeypatch.setenv(HARNESS_EXPORT_ENV, str(tmp_path / "export"))
    with pytest.raises(NodeError, match="harness = true"):
        OrgNode.open(tmp_path / "n")
    path = tmp_path / "n" / "fedweave.toml"
    NodeConfig.load(path).replace(debug=DebugSection(harness=True)).save(path)
    assert OrgNode.open(tmp_path / "n").runs.debug_export == tmp_path / "export"


def test_a_removal_signed_by_a_quorum_is_installed_on_every_node(tmp_path: Path) -> None:
    dirs = make_federation(tmp_path)

    async def scenario() -> dict[str, tuple[int, tuple[str, ...]]]:
        nodes = await start_nodes(dirs, InMemoryNetwork())
        try:
            proposal = await asyncio.to_thread(nodes["org-a"].propose_remove, "org-c", "bye")
            assert [o for o, _ in proposal.signatures] == ["org-a"]
            assert nodes["org-a"].current_manifest.version == 0  # type: ignore[union-attr]
            loop = asyncio.get_running_loop()
            end = loop.time() + 20
            while proposal.digest not in {p.digest for p in nodes["org-b"].proposals()}:
                assert loop.time() < end, "the proposal did not reach org-b"
                await asyncio.sleep(0.05)
            await asyncio.to_thread(nodes["org-b"].sign_proposal, proposal.digest)
            stay = [nodes["org-a"], nodes["org-b"]]
            while any(n.current_manifest.version != 1 for n in stay):  # type: ignore[union-attr]
                assert loop.time() < end, "the new version was not installed by the quorum"
                await asyncio.sleep(0.05)
            return {
                o: (n.current_manifest.version, n.current_manifest.member_ids)  # type: ignore[union-attr]
                for o, n in nodes.items()
                if o != "org-c"  # the removed org stops hearing the federation's gossip
            }
        finally:
            for node in nodes.values():
                await node.stop()

    views = asyncio.run(scenario())
    assert set(views.values()) == {(1, ("org-a", "org-b"))}
    assert len(read_chain(dirs["org-b"] / "federation" / "chain.json")) == 2


def test_forged_proposal_signatures_are_dropped(tmp_path: Path) -> None:
    from coordinator_free.identity import OrgIdentity

    from org_node.services import ServiceRefused

    dirs = make_federation(tmp_path)
    node = OrgNode.open(dirs["org-a"])
    manifest = node.current_manifest
    assert manifest is not None
    proposal = manifest.propose_remove("org-c", created_at=1)
    with pytest.raises(ServiceRefused, match="no valid member signature"):
        node.federation._merge(proposal.with_signatures({"org-b": b"\x00" * 64}))
    signed_b = proposal.sign(OrgIdentity.load(dirs["org-b"] / "identity"))
    mixed = signed_b.with_signatures({"org-c": b"\x01" * 64})
    pending = node.federation._merge(mixed)
    assert [o for o, _ in pending.signatures] == ["org-b"]
    assert node.current_manifest is manifest  # one of two required signatures
