"""A run proposed once, between real nodes (in-memory transport, real gossip, real
databases, the admin API in process): the proposal reaches every participant, a
decline cancels the run everywhere with its reason, and a proposal whose run key is
not the hash of its spec is ignored by every receiver."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
from coordinator_free.memory import InMemoryNetwork
from sqlmodel import Session

from api.app import create_app
from api.settings import Settings
from org_node.db.engine import default_database_url, make_engine
from org_node.db.models import Role
from org_node.db.repo import create_token
from org_node.node import OrgNode
from org_node.proposals import PROPOSAL_TOPIC, Proposal
from tests.org_node.test_node_inprocess import ORGS, make_federation, start_nodes
from tests.run_flow import await_states

SPEC = {"trainer": "breast_cancer", "rounds": 2, "participants": list(ORGS), "threshold": 2}


def _clients(dirs: dict[str, Path], nodes: dict[str, OrgNode]) -> dict[str, httpx.AsyncClient]:
    out = {}
    for org, node in nodes.items():
        with Session(make_engine(default_database_url(dirs[org]))) as s:
            _, token = create_token(s, "test", Role.ADMIN)
            s.commit()
        out[org] = httpx.AsyncClient(
            transport=httpx.ASGITransport(
                app=create_app(Settings(data_dir=dirs[org]), node, engine=node.db)
            ),
            base_url="http://admin",
            headers={"Authorization": f"Bearer {token}"},
        )
    return out


async def _seen(c: httpx.AsyncClient, ref: str, timeout: float = 20.0) -> dict[str, Any]:
    end = asyncio.get_running_loop().time() + timeout
    while True:
        r = await c.get(f"/v1/runs/{ref}")
        if r.status_code == 200:
            body: dict[str, Any] = r.json()
            return body
        assert asyncio.get_running_loop().time() < end, r.text
        await asyncio.sleep(0.05)


def test_a_decline_cancels_the_run_at_every_participant_with_its_reason(tmp_path: Path) -> None:
    dirs = make_federation(tmp_path)

    async def scenario() -> dict[str, dict[str, Any]]:
        nodes = await start_nodes(dirs, InMemoryNetwork())
        clients = _clients(dirs, nodes)
        try:
            r = await clients["org-a"].post("/v1/runs", json={"name": "c1", "spec": SPEC})
            assert r.status_code == 201, r.text
            key = r.json()["run_key"]
            for org in ORGS:  # proposed once, known everywhere by the same key
                row = await _seen(clients[org], "c1")
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
        clients = _clients(dirs, nodes)
        try:
            good = Proposal.make("c2", SPEC, "org-b", 1_700_000_000_000, 3600, 5)
            body = json.loads(good.to_record())
            body["spec"] = dict(body["spec"]) | {"rounds": 50}  # signed, but not what the key says
            gossip = nodes["org-b"].gossip
            assert gossip is not None
            gossip.publish(PROPOSAL_TOPIC, good.run_key, json.dumps(body).encode())
            honest = Proposal.make("c3", SPEC, "org-b", 1_700_000_000_000, 3600, 5)
            gossip.publish(PROPOSAL_TOPIC, honest.run_key, honest.to_record())
            await _seen(clients["org-a"], "c3")  # the honest one, sent after, has arrived
            await _seen(clients["org-c"], "c3")
            a = await clients["org-a"].get("/v1/runs/c2")
            c = await clients["org-c"].get("/v1/runs/c2")
            return a.status_code, c.status_code
        finally:
            for cl in clients.values():
                await cl.aclose()
            for node in nodes.values():
                await node.stop()

    assert asyncio.run(scenario()) == (404, 404)
