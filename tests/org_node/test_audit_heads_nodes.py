"""Audit truncation is caught: real nodes (in-memory transport, real gossip, real
databases) sign their log heads every round and, while entries wait, every few
seconds; every member keeps the others' heads and hands each org those of its own log.
A log cut short after the last head its peers hold then fails verification, whether the
heads come from a peer's log file (``--peer-log``) or are fetched from the peers
(``--from-peers``); the whole log passes and says how many entries follow that head."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from coordinator_free.memory import InMemoryNetwork

import org_node.node.heads as node_heads
from org_node.audit import SignedHead, read_log, verify_path
from org_node.node import OrgNode
from tests.org_node.test_node_inprocess import make_federation, start_nodes
from tests.org_node.test_node_proposals import SPEC
from tests.run_flow import admin_clients, apropose_once, await_states


async def _held_by_peers(nodes: dict[str, OrgNode], org: str, at_least: int) -> None:
    """Wait until every other node holds a head of ``org``'s log at index >= ``at_least``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 30.0
    while not all(
        any(h.org == org and h.index >= at_least for h in n.egress.peer_heads)
        for o, n in nodes.items()
        if o != org
    ):
        assert loop.time() < end, "the peers never held the head"
        await asyncio.sleep(0.05)


def test_a_truncated_log_fails_against_the_heads_its_peers_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_heads, "HEAD_PERIOD_S", 0.5)
    dirs = make_federation(tmp_path)

    async def scenario() -> tuple[list[SignedHead], list[SignedHead]]:
        nodes = await start_nodes(dirs, InMemoryNetwork())
        clients = admin_clients(dirs, nodes)
        try:
            # no run yet: membership traffic alone gets a head within the period
            a = nodes["org-a"]
            while not a.egress.entries:
                await asyncio.sleep(0.05)
            await _held_by_peers(nodes, "org-a", 0)
            idle = await asyncio.to_thread(a.peer_heads)
            await apropose_once(clients, "h1", SPEC)
            rows = await await_states(clients, "h1", {"completed", "failed"})
            assert {r["state"] for r in rows.values()} == {"completed"}
            last_round = max(h.index for h in a.egress.heads if h.run)
            await _held_by_peers(nodes, "org-a", last_round)
            return idle, await asyncio.to_thread(a.peer_heads)
        finally:
            for c in clients.values():
                await c.aclose()
            for node in nodes.values():
                await node.stop()

    idle, fetched = asyncio.run(scenario())
    assert idle and all(h.org == "org-a" and h.run == "" for h in idle)
    assert any(h.run and h.round == 2 for h in fetched)  # the last round's head
    log = dirs["org-a"] / "audit" / "egress.jsonl"
    whole = verify_path(log, peer_heads=fetched)
    assert whole.ok, whole.summary
    assert "head(s) held by peers, the last at entry" in whole.summary
    # an admin (or a disk) removes the last entries: the peers' heads reach past the end
    last_held = max(h.index for h in fetched)
    cut = _cut(log, tmp_path / "cut.jsonl", keep_entries=last_held)
    for result in (
        verify_path(cut, peer_heads=fetched),
        verify_path(cut, peer_logs=[dirs["org-b"] / "audit" / "egress.jsonl"]),
    ):
        assert not result.ok
        assert "were removed" in result.summary, result.summary


def _cut(log: Path, out: Path, *, keep_entries: int) -> Path:
    """``log`` with every line from the entry of index ``keep_entries`` on removed."""
    kept: list[bytes] = []
    for line in log.read_bytes().splitlines(keepends=True):
        if b'"type":"entry"' in line and f'"index":{keep_entries},'.encode() in line:
            break
        kept.append(line)
    out.write_bytes(b"".join(kept))
    assert len(read_log(out).entries()) == keep_entries  # cut at a record boundary
    return out
