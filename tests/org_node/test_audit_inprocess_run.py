"""Three orgs run real secure rounds in process; each report lists exactly what was sent.

Every org's endpoint carries its :class:`EgressLog` as the egress hook. Two rounds of
the leaderless round engine (secure_agg sessions, ring reduce, model-hash check) run
over the in-memory network, and the orgs gossip their signed heads (``audit.head``).
The report of each org must count the same messages and bytes as the network's own
counters, in total and per peer; the logs, reports and held heads must all verify.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from coordinator_free.endpoint import Endpoint
from coordinator_free.identity import OrgIdentity
from coordinator_free.memory import InMemoryNetwork, InMemoryTransport
from coordinator_free.rounds import RoundConfig, RoundEngine, endpoint_signer, secagg_sessions
from coordinator_free.transport import RawHandler
from coordinator_free.wire import Envelope

from org_node.audit import (
    ConsentRecord,
    EgressLog,
    ForbiddenClass,
    PrivacyClass,
    RoundFacts,
    RunFacts,
    SecAggFacts,
    SignedHead,
    UnclassifiedKind,
    build_report,
    read_log,
    render_html,
    report_to_bytes,
    verify_log,
    verify_path,
    verify_report,
)
from org_node.audit.heads import publish_head, serve_heads
from org_node.policy import Policy, RunSpec

ORGS = ("clinic-a", "clinic-b", "clinic-c")
RUN = "run-7"
FAST = RoundConfig(ready_timeout=1.0, stage_timeout=4.0, step_timeout=2.0, send_timeout=4.0)


class CountingTransport:
    """Counts the messages and bytes handed to the network, per recipient."""

    def __init__(self, inner: InMemoryTransport) -> None:
        self.inner = inner
        self.org_id = inner.org_id
        self.messages: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    async def start(self, handler: RawHandler) -> None:
        async def counted(data: bytes) -> bytes:
            reply = await handler(data)
            peer = Envelope.from_wire(reply, 1 << 30).recipient
            self.messages[peer] += 1
            self.bytes[peer] += len(reply)
            return reply

        await self.inner.start(counted)

    async def request(self, peer: str, data: bytes, *, timeout: float) -> bytes:
        self.messages[peer] += 1
        self.bytes[peer] += len(data)
        return await self.inner.request(peer, data, timeout=timeout)

    async def close(self) -> None:
        await self.inner.close()


def _identity(org: str) -> OrgIdentity:
    return OrgIdentity.generate(org, hashlib.sha256(org.encode()).digest())


def _facts(results: Mapping[int, Any]) -> RunFacts:
    spec = RunSpec(trainer="breast_cancer", rounds=2, participants=ORGS, threshold=2)
    return RunFacts(
        run=RUN,
        spec=spec,
        policies={"default": Policy(min_participants=3)},
        consents=tuple(
            ConsentRecord(o, "accepted", "2026-01-01T00:00:00Z", f"admin@{o}") for o in ORGS
        ),
        secure_aggregation=SecAggFacts("masked", 3, 2, 32, None),
        rounds=tuple(
            RoundFacts(
                round=r,
                participants=res.participants,
                survivors=res.survivors,
                dropped=res.dropped,
                model_hash=hashlib.sha256(res.sum.tobytes()).hexdigest(),
                agreeing_peers=tuple(sorted(set(ORGS))),
            )
            for r, res in results.items()
        ),
    )


async def _federation(tmp: Path) -> dict[str, Any]:
    net = InMemoryNetwork()
    ids = {o: _identity(o) for o in ORGS}
    keys = {o: i.public_key for o, i in ids.items()}
    logs = {o: EgressLog(ids[o], tmp / f"{o}.log") for o in ORGS}
    transports = {o: CountingTransport(net.transport(o)) for o in ORGS}
    eps = {o: Endpoint(ids[o], "fed", transports[o], lambda: keys, on_egress=logs[o]) for o in ORGS}
    engines = {
        o: RoundEngine(
            eps[o], lambda: ORGS, secagg_sessions(*endpoint_signer(eps[o]), seed=5), FAST
        )
        for o in ORGS
    }
    for o in ORGS:
        serve_heads(eps[o], logs[o], lambda: keys)
        await eps[o].start()
    return {
        "net": net,
        "keys": keys,
        "logs": logs,
        "eps": eps,
        "engines": engines,
        "transports": transports,
    }


async def _run(fed: dict[str, Any]) -> dict[int, Any]:
    logs, eps, engines = fed["logs"], fed["eps"], fed["engines"]
    rng = np.random.default_rng(0)
    results: dict[int, Any] = {}
    for rnd in (1, 2):
        vectors = {o: rng.integers(0, 2**32, 256, dtype=np.uint32) for o in ORGS}
        outs = await asyncio.gather(*(engines[o].run_round(RUN, rnd, vectors[o]) for o in ORGS))
        expected = np.zeros(256, dtype=np.uint64)
        for v in vectors.values():
            expected += v.astype(np.uint64)
        for out in outs:
            np.testing.assert_array_equal(out.sum, (expected % 2**32).astype(np.uint32))
        results[rnd] = outs[0]
        digest = hashlib.sha256(outs[0].sum.tobytes()).digest()
        await asyncio.gather(
            *(engines[o].check_model_hash(RUN, rnd, digest, ORGS, timeout=4.0) for o in ORGS)
        )
        published = await asyncio.gather(
            *(publish_head(eps[o], logs[o], RUN, rnd, ORGS) for o in ORGS)
        )
        assert all(failed == set() for _, failed in published)
    for o in ORGS:
        logs[o].sign_head(RUN, 2)
    return results


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("audit-run")

    async def main() -> dict[str, Any]:
        fed = await _federation(tmp)
        fed["results"] = await _run(fed)
        for ep in fed["eps"].values():
            await ep.close()
        return fed

    fed = asyncio.run(main())
    fed["tmp"] = tmp
    fed["reports"] = {o: build_report(fed["logs"][o], _facts(fed["results"])) for o in ORGS}
    for log in fed["logs"].values():
        log.close()
    return fed


@pytest.mark.parametrize("org", ORGS)
def test_report_counts_exactly_what_the_network_carried(
    federation: dict[str, Any], org: str
) -> None:
    report = federation["reports"][org]
    net: InMemoryNetwork = federation["net"]
    counted: CountingTransport = federation["transports"][org]
    traffic = report["traffic"]
    assert traffic["total"] == {"messages": net.messages_sent[org], "bytes": net.bytes_sent[org]}
    per_peer = {p["peer"]: (p["messages"], p["bytes"]) for p in traffic["per_peer"]}
    assert per_peer == {p: (counted.messages[p], counted.bytes[p]) for p in counted.messages}
    assert set(per_peer) == set(ORGS) - {org}
    classes = {c["class"] for c in traffic["per_class"]}
    # the readies carry the public keys and the shares sealed ahead: encrypted_share
    assert {
        "encrypted_share",
        "released_share",
        "masked_vector_chunk",
        "model_hash",
        "audit_head",
        "control",
    } <= classes
    assert traffic["forbidden_messages"] == 0
    assert [r["round"] for r in report["rounds"]] == [1, 2]
    assert all(r["model_hash_agreed"] for r in report["rounds"])


@pytest.mark.parametrize("org", ORGS)
def test_logs_and_reports_verify_and_agree_with_the_heads_peers_hold(
    federation: dict[str, Any], org: str
) -> None:
    tmp: Path = federation["tmp"]
    keys = federation["keys"]
    peers = [tmp / f"{p}.log" for p in ORGS if p != org]
    held = [h for p in peers for h in read_log(p).peer_heads() if h.org == org]
    assert len(held) == 2 * 2  # two rounds, two peers
    result = verify_log(tmp / f"{org}.log", trusted_keys=keys, peer_heads=held)
    assert result.ok, result.summary
    assert result.peer_heads == 4 and result.heads == 3  # rounds 1, 2 and the closing head
    report = federation["reports"][org]
    assert verify_report(report, trusted_keys=keys, peer_heads=held).ok
    path = tmp / f"{org}.report.json"
    path.write_bytes(report_to_bytes(report))
    by_path = verify_path(path, trusted_keys=keys, peer_logs=peers)
    assert by_path.ok and by_path.peer_heads == 4, by_path.summary
    page = render_html(report, verification=by_path.summary)
    assert "<svg" in page and org in page


def test_a_rewritten_log_disagrees_with_the_heads_peers_hold(
    federation: dict[str, Any], tmp_path: Path
) -> None:
    """The org re-creates its log without the last round: its own file verifies, the peers' heads do not."""
    src: Path = federation["tmp"] / "clinic-a.log"
    lines = src.read_bytes().split(b"\n")
    cut = max(i for i, line in enumerate(lines) if b'"round":1,' in line and b'"entry"' in line)
    short = tmp_path / "short.log"
    short.write_bytes(b"\n".join(lines[: cut + 1]) + b"\n")
    assert verify_log(short).ok
    peers = [federation["tmp"] / f"{p}.log" for p in ORGS if p != "clinic-a"]
    result = verify_path(short, peer_logs=peers)
    assert not result.ok
    assert "removed" in result.summary or "rewritten" in result.summary


def test_the_hook_fails_closed_so_nothing_is_sent(tmp_path: Path) -> None:
    async def main() -> tuple[InMemoryNetwork, EgressLog]:
        net = InMemoryNetwork()
        ids = {o: _identity(o) for o in ORGS[:2]}
        keys = {o: i.public_key for o, i in ids.items()}
        log = EgressLog(ids[ORGS[0]], tmp_path / "a.log")
        a = Endpoint(ids[ORGS[0]], "fed", net.transport(ORGS[0]), lambda: keys, on_egress=log)
        b = Endpoint(ids[ORGS[1]], "fed", net.transport(ORGS[1]), lambda: keys)

        async def sink(env: Envelope) -> bytes:
            return b""

        for kind in ("data.rows", "labels.batch", "update.plain", "mystery.kind"):
            b.on(kind, sink)
        await a.start()
        await b.start()
        with pytest.raises(ForbiddenClass):
            await a.send(ORGS[1], "data.rows", b"x" * 100)
        with pytest.raises(ForbiddenClass):
            await a.send(ORGS[1], "labels.batch", b"y")
        with pytest.raises(ForbiddenClass):
            await a.send(ORGS[1], "update.plain", b"z")
        with pytest.raises(UnclassifiedKind):
            await a.send(ORGS[1], "mystery.kind", b"?")
        return net, log

    net, log = asyncio.run(main())
    assert net.messages_sent[ORGS[0]] == 0 and net.bytes_sent[ORGS[0]] == 0
    assert log.entries == [] and len(log.refusals) == 4
    assert verify_log(tmp_path / "a.log").ok


def test_a_reply_the_hook_refuses_is_not_sent() -> None:
    from coordinator_free.errors import RemoteError

    seen: list[str] = []

    def refuse_replies(env: Envelope, wire: bytes) -> None:
        seen.append(env.kind)
        if env.kind.endswith(".reply"):
            raise ForbiddenClass(env.kind, PrivacyClass.UNMASKED_UPDATE)

    async def main() -> InMemoryNetwork:
        net = InMemoryNetwork()
        ids = {o: _identity(o) for o in ORGS[:2]}
        keys = {o: i.public_key for o, i in ids.items()}
        a = Endpoint(ids[ORGS[0]], "fed", net.transport(ORGS[0]), lambda: keys)
        b = Endpoint(
            ids[ORGS[1]], "fed", net.transport(ORGS[1]), lambda: keys, on_egress=refuse_replies
        )

        async def answer(env: Envelope) -> bytes:
            return b"the answer"

        b.on("round.ready", answer)
        await a.start()
        await b.start()
        with pytest.raises(RemoteError):
            await a.send(ORGS[1], "round.ready", b"k")
        return net

    net = asyncio.run(main())
    assert seen == ["round.ready.reply"]
    assert net.messages_sent[ORGS[1]] == 0 and net.messages_sent[ORGS[0]] == 1


def test_heads_from_strangers_forgers_or_for_others_are_refused(tmp_path: Path) -> None:
    from coordinator_free.errors import Refused

    async def main() -> EgressLog:
        net = InMemoryNetwork()
        ids = {o: _identity(o) for o in ORGS}
        keys = {o: i.public_key for o, i in ids.items() if o != ORGS[2]}
        members = {o: i.public_key for o, i in ids.items()}
        holder = EgressLog(ids[ORGS[0]], tmp_path / "holder.log")
        a = Endpoint(ids[ORGS[0]], "fed", net.transport(ORGS[0]), lambda: members)
        b = Endpoint(ids[ORGS[1]], "fed", net.transport(ORGS[1]), lambda: members)
        serve_heads(a, holder, lambda: keys)
        await a.start()
        await b.start()
        b_head = EgressLog(ids[ORGS[1]]).sign_head("r", 1)
        c_head = EgressLog(ids[ORGS[2]]).sign_head("r", 1)
        forged = SignedHead(**{**b_head.to_dict(), "round": 2})
        for payload in (c_head.to_bytes(), forged.to_bytes(), b"{}"):
            with pytest.raises(Refused):
                await b.send(ORGS[0], "audit.head", payload)
        await b.send(ORGS[0], "audit.head", b_head.to_bytes())
        return holder

    holder = asyncio.run(main())
    assert holder.peer_heads and [h.org for h in holder.peer_heads] == [ORGS[1]]


def test_a_member_fetches_only_the_heads_of_its_own_log(federation: dict[str, Any]) -> None:
    """``audit.heads``: each org gets back exactly the heads of its own log that a peer
    holds (each checked against its key), never another org's; a stranger gets none."""
    from coordinator_free.errors import Refused

    from org_node.audit.heads import fetch_heads

    a, b, c = ORGS

    async def main() -> tuple[list[SignedHead], dict[str, str], list[SignedHead]]:
        net = InMemoryNetwork()
        ids = {o: _identity(o) for o in ORGS}
        keys = {o: i.public_key for o, i in ids.items()}
        holder = EgressLog(ids[b], federation["tmp"] / f"{b}.log")  # holds a's and c's heads
        eps = {o: Endpoint(ids[o], "fed", net.transport(o), lambda: keys) for o in (a, b)}
        serve_heads(eps[b], holder, lambda: keys)
        for ep in eps.values():
            await ep.start()
        got, missed = await fetch_heads(eps[a], [b], keys[a])
        stranger = _identity("org-x")
        x = Endpoint(stranger, "fed", net.transport("org-x"), lambda: keys | {"org-x": b"\0" * 32})
        await x.start()
        with pytest.raises(Refused):
            await x.send(b, "audit.heads", b"")
        return got, missed, holder.peer_heads

    got, missed, held = asyncio.run(main())
    assert missed == {}
    assert got and {h.org for h in got} == {a}
    assert [h.index for h in got] == sorted(h.index for h in held if h.org == a)
    assert any(h.org == c for h in held)  # b holds c's heads too, and kept them to itself


def test_large_messages_are_logged_from_worker_threads_and_the_log_verifies(
    tmp_path: Path,
) -> None:
    """Messages of ``OFF_LOOP_BYTES`` and more reach the log from worker threads, four at
    once, with the node's group commit: one entry each, chained, and a forbidden one is
    still refused before a byte leaves."""
    from coordinator_free.endpoint import OFF_LOOP_BYTES

    payloads = [bytes([i]) * (OFF_LOOP_BYTES + i) for i in range(4)]

    async def main() -> tuple[InMemoryNetwork, EgressLog]:
        net = InMemoryNetwork()
        ids = {o: _identity(o) for o in ORGS[:2]}
        keys = {o: i.public_key for o, i in ids.items()}
        log = EgressLog(ids[ORGS[0]], tmp_path / "a.log", commit_within_s=0.05)
        a = Endpoint(ids[ORGS[0]], "fed", net.transport(ORGS[0]), lambda: keys, on_egress=log)
        b = Endpoint(ids[ORGS[1]], "fed", net.transport(ORGS[1]), lambda: keys)

        async def sink(env: Envelope) -> bytes:
            return b""

        b.on("ring.chunk", sink)
        b.on("update.plain", sink)
        await a.start()
        await b.start()
        await asyncio.gather(*(a.send(ORGS[1], "ring.chunk", p) for p in payloads))
        with pytest.raises(ForbiddenClass):
            await a.send(ORGS[1], "update.plain", payloads[0])
        return net, log

    net, log = asyncio.run(main())
    log.close()
    assert net.messages_sent[ORGS[0]] == 4
    assert sorted(e.sha256 for e in log.entries) == sorted(
        hashlib.sha256(p).hexdigest() for p in payloads
    )
    assert [e.index for e in log.entries] == [0, 1, 2, 3]
    assert len({e.seq for e in log.entries}) == 4 and len(log.refusals) == 1
    assert net.bytes_sent[ORGS[0]] == sum(e.bytes for e in log.entries)
    assert verify_log(tmp_path / "a.log").ok
