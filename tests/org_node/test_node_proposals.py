"""A run proposed once, between real nodes (in-memory transport, real gossip, real
databases, the admin API in process): the proposal reaches every participant, a
decline cancels the run everywhere with its reason, a proposal whose run key is not
the hash of its spec is ignored by every receiver, a member away for longer than
gossip keeps a record still receives the proposal, a run started at its quorum runs
with those that consented only, and a run under way says whose message its round
waits for."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from coordinator_free.membership import SwimConfig
from coordinator_free.memory import InMemoryNetwork

import org_node.node.proposals as node_proposals
from org_node.engine import EngineState
from org_node.node import OrgNode
from org_node.proposals import PROPOSAL_TOPIC, Proposal
from org_node.training.exchange import LocalResult
from tests.org_node.test_node_inprocess import ORGS, TinyTrainer, make_federation, start_nodes
from tests.run_flow import START_DELAY_S, admin_clients, await_states, seen

SPEC = {"trainer": "breast_cancer", "rounds": 2, "participants": list(ORGS), "threshold": 2}


def test_a_decline_cancels_the_run_at_every_participant_with_its_reason(tmp_path: Path) -> None:
    dirs = make_federation(tmp_path)

    async def scenario() -> dict[str, dict[str, Any]]:
        nodes = await start_nodes(dirs, InMemoryNetwork())
        clients = admin_clients(dirs, nodes)
        try:
            r = await clients["org-a"].post("/v1/runs", json={"name": "c1", "spec": SPEC})
            assert r.status_code == 201, r.text
            key = r.json()["run_key"]
            for org in ORGS:  # proposed once, known everywhere by the same key
                row = await seen(clients[org], "c1")
                assert row["run_key"] == key and row["state"] == "proposed"
                assert row["origin"] == "org-a"
            assert (await clients["org-a"].post("/v1/runs/c1/accept", json={})).status_code == 200
            no = {"reason": "our ethics board has not approved it"}
            assert (await clients["org-b"].post(f"/v1/runs/{key}/decline", json=no)).is_success
            return await await_states(clients, key, {"cancelled", "declined"}, timeout=30)
        finally:
            for c in clients.values():
                await c.aclose()
            for node in nodes.values():
                await node.stop()

    rows = asyncio.run(scenario())
    assert {o: r["state"] for o, r in rows.items()} == {
        "org-a": "cancelled",
        "org-b": "declined",
        "org-c": "cancelled",
    }
    for org in ("org-a", "org-c"):
        assert rows[org]["state_reason"] == "org-b declined: our ethics board has not approved it"
        decided = {c["org_id"]: c["decision"] for c in rows[org]["consents"]}
        assert decided["org-b"] == "decline"
    assert rows["org-a"]["waiting"] is None


def test_a_proposal_whose_key_is_not_its_specs_hash_is_ignored(tmp_path: Path) -> None:
    dirs = make_federation(tmp_path)

    async def scenario() -> tuple[int, int]:
        nodes = await start_nodes(dirs, InMemoryNetwork())
        clients = admin_clients(dirs, nodes)
        try:
            good = Proposal.make("c2", SPEC, "org-b", 1_700_000_000_000, 3600, 5)
            body = json.loads(good.to_record())
            body["spec"] = dict(body["spec"]) | {"rounds": 50}  # signed, but not what the key says
            gossip = nodes["org-b"].gossip
            assert gossip is not None
            gossip.publish(PROPOSAL_TOPIC, good.run_key, json.dumps(body).encode())
            honest = Proposal.make("c3", SPEC, "org-b", 1_700_000_000_000, 3600, 5)
            gossip.publish(PROPOSAL_TOPIC, honest.run_key, honest.to_record())
            await seen(clients["org-a"], "c3")  # the honest one, sent after, has arrived
            await seen(clients["org-c"], "c3")
            a = await clients["org-a"].get("/v1/runs/c2")
            c = await clients["org-c"].get("/v1/runs/c2")
            return a.status_code, c.status_code
        finally:
            for cl in clients.values():
                await cl.aclose()
            for node in nodes.values():
                await node.stop()

    assert asyncio.run(scenario()) == (404, 404)


class GatedTrainer(TinyTrainer):
    """:class:`TinyTrainer` whose round-1 training waits until ``gate`` is set."""

    def __init__(self, value: float, gate: threading.Event) -> None:
        super().__init__(value)
        self.gate = gate

    def train(
        self, global_state: Mapping[str, np.ndarray], round: int, options: Mapping[str, Any]
    ) -> LocalResult:
        if round == 0:
            assert self.gate.wait(60.0), "the test never opened the gate"
        return super().train(global_state, round, options)


async def _start(
    dirs: Mapping[str, Path],
    network: InMemoryNetwork,
    orgs: tuple[str, ...],
    gates: Mapping[str, threading.Event] | None = None,
) -> dict[str, OrgNode]:
    nodes = {}
    for i, org in enumerate(orgs):
        gate = (gates or {}).get(org)

        def factory(plan: Any, work: Any, binding: Any, i: int = i, gate: Any = gate) -> Any:
            value = 0.1 * (i + 1)
            return TinyTrainer(value) if gate is None else GatedTrainer(value, gate)

        node = OrgNode.open(
            dirs[org],
            transport=network.transport(org),
            trainer_factory=factory,
            swim=SwimConfig(period_s=0.2, ping_timeout_s=0.08),
        )
        await node.start()
        nodes[org] = node
    return nodes


def test_a_member_away_longer_than_gossip_keeps_a_record_still_gets_the_proposal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """org-c is down while org-a proposes and org-b accepts, and stays down until both
    have forgotten the gossip records; each org spreads its own records again, so org-c
    sees the proposal, and org-b's consent, when it is back."""
    monkeypatch.setattr(node_proposals, "RESPREAD_PERIOD_S", 0.3)
    dirs = make_federation(tmp_path)

    async def scenario() -> dict[str, Any]:
        network = InMemoryNetwork()
        nodes = await _start(dirs, network, ("org-a", "org-b"))
        for node in nodes.values():
            assert node.gossip is not None
            node.gossip.config = dataclasses.replace(node.gossip.config, ttl_s=1.0)
        clients = admin_clients(dirs, nodes)
        try:
            body = {"name": "c4", "spec": SPEC}
            assert (await clients["org-a"].post("/v1/runs", json=body)).status_code == 201
            await seen(clients["org-b"], "c4")
            assert (await clients["org-b"].post("/v1/runs/c4/accept", json={})).is_success
            gossip_a = nodes["org-a"].gossip
            assert gossip_a is not None
            forgotten = gossip_a.counters["expired"]
            while gossip_a.counters["expired"] < forgotten + 2:  # both records expired
                await asyncio.sleep(0.1)
            nodes |= await _start(dirs, network, ("org-c",))
            clients = admin_clients(dirs, nodes) | {o: clients[o] for o in ("org-a", "org-b")}
            row = await seen(clients["org-c"], "c4", timeout=30.0)
            end = asyncio.get_running_loop().time() + 30.0
            while not any(c["org_id"] == "org-b" for c in row["consents"]):
                assert asyncio.get_running_loop().time() < end, row
                await asyncio.sleep(0.1)
                row = await seen(clients["org-c"], "c4")
            return row
        finally:
            for c in clients.values():
                await c.aclose()
            for node in nodes.values():
                await node.stop()

    row = asyncio.run(scenario())
    assert row["state"] == "proposed" and row["origin"] == "org-a"
    assert {c["org_id"]: c["decision"] for c in row["consents"]}["org-b"] == "accept"


def test_a_run_started_at_its_quorum_runs_with_those_that_consented(tmp_path: Path) -> None:
    """org-c is up but never answers; at the consent deadline the run starts with org-a
    and org-b (the quorum), whose rounds hold those two only: no round waits for org-c,
    which leaves the run saying why."""
    dirs = make_federation(tmp_path)
    spec = dict(SPEC) | {"quorum": 2}

    async def scenario() -> tuple[dict[str, dict[str, Any]], list[Any], Any]:
        nodes = await start_nodes(dirs, InMemoryNetwork())
        clients = admin_clients(dirs, nodes)
        try:
            body = {"name": "q1", "spec": spec, "consent_timeout_s": 10, "start_delay_s": 1}
            assert (await clients["org-a"].post("/v1/runs", json=body)).status_code == 201
            for org in ("org-a", "org-b"):
                await seen(clients[org], "q1")
                assert (await clients[org].post("/v1/runs/q1/accept", json={})).is_success
            # 10 s to the deadline, then two rounds: well inside 40 s unless a round
            # waits out org-c's ready (30 s a round)
            rows = await await_states(clients, "q1", {"completed", "cancelled"}, timeout=40)
            active = nodes["org-a"].runs.active
            assert active is not None
            state = EngineState.from_bytes(active.engine.state_path.read_bytes())
            metrics = (await clients["org-a"].get("/v1/runs/q1/metrics")).json()["data"]
            return rows, metrics, state
        finally:
            for c in clients.values():
                await c.aclose()
            for node in nodes.values():
                await node.stop()

    rows, metrics, state = asyncio.run(scenario())
    assert {o: r["state"] for o, r in rows.items()} == {
        "org-a": "completed",
        "org-b": "completed",
        "org-c": "cancelled",
    }
    assert "did not consent in time" in rows["org-c"]["state_reason"]
    assert state.plan["members"] == ["org-a", "org-b"]
    survivors = [m["value"] for m in metrics if m["name"] == "survivors"]
    assert survivors == [2.0, 2.0]


def test_a_round_under_way_says_whose_message_it_waits_for(tmp_path: Path) -> None:
    """org-c trains slowly: meanwhile org-a's run says its round 1 is in the secure sum's
    ready stage waiting for org-c (API and dashboard), and org-c's says it trains."""
    dirs = make_federation(tmp_path)
    gate = threading.Event()

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], str]:
        nodes = await _start(dirs, InMemoryNetwork(), ORGS, {"org-c": gate})
        clients = admin_clients(dirs, nodes)
        try:
            body = {"name": "w1", "spec": SPEC, "start_delay_s": START_DELAY_S}
            assert (await clients["org-a"].post("/v1/runs", json=body)).status_code == 201
            for org in ORGS:
                await seen(clients[org], "w1")
                assert (await clients[org].post("/v1/runs/w1/accept", json={})).is_success
            loop = asyncio.get_running_loop()
            end = loop.time() + 30.0
            while True:
                row = (await clients["org-a"].get("/v1/runs/w1")).json()
                waiting = row.get("waiting") or {}
                if waiting.get("what") == "round" and waiting.get("orgs") == ["org-c"]:
                    break
                assert loop.time() < end, row
                await asyncio.sleep(0.05)
            while True:  # org-c starts the run at the same agreed time, maybe a moment late
                slow = (await clients["org-c"].get("/v1/runs/w1")).json()
                if (slow.get("waiting") or {}).get("stage") == "training":
                    break
                assert loop.time() < end, slow
                await asyncio.sleep(0.05)
            board = (await clients["org-a"].get("/v1/dashboard")).json()
            gate.set()
            rows = await await_states(clients, "w1", {"completed", "failed"}, timeout=60)
            return row, slow, board, rows["org-a"]["state"]
        finally:
            gate.set()
            for c in clients.values():
                await c.aclose()
            for node in nodes.values():
                await node.stop()

    row, slow, board, final = asyncio.run(scenario())
    waiting = row["waiting"]
    assert (waiting["what"], waiting["round"], waiting["stage"]) == ("round", 1, "ready")
    assert waiting["since"] is not None
    assert "round 1: secure sum, ready, waiting for org-c" in waiting["detail"]
    assert slow["waiting"]["stage"] == "training"
    assert slow["waiting"]["detail"] == "round 1: training on this org's data"
    shown = board["run"]
    assert shown["waiting"]["orgs"] == ["org-c"] and "waiting for org-c" in shown["headline"]
    assert final == "completed"
