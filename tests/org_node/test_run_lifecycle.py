"""A run's life on long-lived nodes (issue 20, findings 8 and 9): a member removed from
the manifest mid-run leaves the next round and fetches nothing more of the run; an
ended run leaves no round state that slows the next; a wiped org recovers every run it
was in, the run in progress first; an admin resumes a run that failed."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
from coordinator_free.checkpoints import GLOBAL_OWNER, GLOBAL_SET
from coordinator_free.checkpoints.service import list_shards
from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.membership import SwimConfig
from coordinator_free.memory import InMemoryNetwork
from coordinator_free.rounds import RoundConfig
from coordinator_free.rounds.model_hash import ModelHashes
from coordinator_free.rounds.state import RoundTable
from coordinator_free.rounds.wire import KIND_MODEL, KIND_TOTAL, TOTAL_REQUEST
from coordinator_free.wire import Envelope
from sqlmodel import Session, select

from api.app import create_app
from api.settings import Settings
from org_node.config import NodeConfig
from org_node.db.engine import default_database_url, make_engine
from org_node.db.models import Role, Run, RunMetric
from org_node.db.repo import create_token
from org_node.engine import ATTEMPTS, EngineConfig, EngineState, RunPlan, model_hash
from org_node.initialize import prepare_recovery
from org_node.node import OrgNode, load_secret, read_chain, recover_runs
from org_node.node.lifecycle import (
    FAILURE_FILE,
    Failure,
    read_failure,
    run_row,
    write_failure,
)
from org_node.node.model_history import ModelHistory
from org_node.training.exchange import LocalResult
from tests.org_node.test_node_inprocess import ORGS, TinyTrainer, _Revived, make_federation

SWIM = SwimConfig(period_s=0.2, ping_timeout_s=0.08)


def _configure(dirs: Mapping[str, Path], **engine: Any) -> None:
    for d in dirs.values():
        config = NodeConfig.load(d / "fedweave.toml")
        config.replace(engine=EngineConfig(**engine)).save(d / "fedweave.toml")


def _spec(rounds: int) -> dict[str, Any]:
    return {
        "trainer": "breast_cancer",
        "rounds": rounds,
        "participants": list(ORGS),
        "threshold": 2,
        "backend": "masked",
        "epsilon": None,
    }


def _add_runs(dirs: Mapping[str, Path], name: str, spec: Mapping[str, Any]) -> dict[str, str]:
    """The run's row at every org, running (as after every consent)."""
    ids = {}
    for org, d in dirs.items():
        with Session(make_engine(default_database_url(d))) as s:
            row = Run(
                name=name,
                spec=dict(spec),
                state="running",
                proposed_by="test",
                id=f"{org}{name}".replace("-", ""),
            )
            s.add(row)
            s.commit()
            ids[org] = row.id
    return ids


class _Recording:
    """An org's in-memory transport that notes every message it is sent."""

    def __init__(self, network: InMemoryNetwork, org: str) -> None:
        self.inner = network.transport(org)
        self.org_id = org
        self.seen: list[Envelope] = []

    async def start(self, handler: Callable[[bytes], Any]) -> None:
        async def noted(data: bytes) -> bytes:
            self.seen.append(Envelope.from_wire(data, 1 << 30))
            return await handler(data)  # type: ignore[no-any-return]

        await self.inner.start(noted)

    async def request(self, peer: str, data: bytes, *, timeout: float) -> bytes:
        return await self.inner.request(peer, data, timeout=timeout)

    async def close(self) -> None:
        await self.inner.close()


def _tiny(value: float) -> Callable[[], Any]:
    return lambda: TinyTrainer(value, 0.05)


async def _start(
    dirs: Mapping[str, Path],
    network: InMemoryNetwork,
    trainers: Mapping[str, Callable[[], Any]] | None = None,
    transports: Mapping[str, Any] | None = None,
) -> dict[str, OrgNode]:
    nodes = {}
    for i, org in enumerate(ORGS):
        make: Callable[[], Any] = (trainers or {}).get(org) or _tiny(0.1 * (i + 1))
        node = OrgNode.open(
            dirs[org],
            transport=(transports or {}).get(org) or network.transport(org),
            trainer_factory=lambda plan, work, binding, make=make: make(),
            swim=SWIM,
        )
        await node.start()
        nodes[org] = node
    return nodes


async def _wait_for(cond: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < end, f"timed out: {what}"
        await asyncio.sleep(0.05)


def _round(node: OrgNode) -> int:
    active = node.runs.active
    return active.engine.state.round if active is not None else -1


async def _both_complete(a: OrgNode, b: OrgNode, ids: Mapping[str, str]) -> None:
    """Wait for the run to end at org-a and org-b, completed at both."""
    await _wait_for(
        lambda: ids["org-a"] in a.runs.finished and ids["org-b"] in b.runs.finished,
        90,
        "the run to end at org-a and org-b",
    )
    assert a.runs.finished[ids["org-a"]] == "completed"
    assert b.runs.finished[ids["org-b"]] == "completed"


def _survivors(node: OrgNode, run_id: str) -> dict[int, float]:
    with Session(node.db) as s:
        rows = s.exec(select(RunMetric).where(RunMetric.run_id == run_id)).all()
    return {m.round: m.value for m in rows if m.name == "survivors"}


def _state(node: OrgNode, run_id: str) -> Run:
    with Session(node.db) as s:
        row = s.get(Run, run_id)
        assert row is not None
        return row


# -- finding 8 ---------------------------------------------------------------------------


def test_a_round_s_model_is_not_coded_onto_a_survivor_removed_while_it_ran() -> None:
    # org-a finished the round in progress with org-c among its survivors after
    # installing org-c's removal, while org-b failed that round: org-b can rebuild the
    # model only from shards on members, so org-c must hold none of this version
    kept: list[tuple[int, tuple[str, ...]]] = []

    class History:
        def add_version(self, version: int, data: bytes, sha: str, *, members: Any) -> None:
            kept.append((version, tuple(members)))

    published: list[str] = []
    ctx = SimpleNamespace(
        me="org-a",
        history=History(),
        gossip=SimpleNamespace(publish=lambda topic, key, value: published.append(key)),
        current_manifest=SimpleNamespace(member_ids=("org-a", "org-b")),
    )
    history = ModelHistory(ctx)  # type: ignore[arg-type]
    model = {"w": np.arange(4, dtype=np.float32)}
    asyncio.run(history.share("run", 4, model, ("org-a", "org-b", "org-c")))
    assert kept == [(4, ("org-a", "org-b"))]
    assert published == ["run/4"]
    # the removal, installed again (or late), finds nothing on org-c to place again
    asyncio.run(history.place_again({"org-c"}, 4, model))
    assert kept == [(4, ("org-a", "org-b"))]


def test_finding_8_a_removed_member_is_out_of_the_next_round_and_fetches_nothing(
    tmp_path: Path,
) -> None:
    dirs = make_federation(tmp_path)
    # until both remaining orgs installed the removal their member lists differ and
    # their rounds fail: every attempt a round has covers that gap on a loaded machine
    _configure(
        dirs,
        ready_timeout_s=3.0,
        model_hash_timeout_s=3,
        max_attempts=ATTEMPTS,
        quorum_backoff_max_s=2.0,
    )
    spec = _spec(8)
    key = RunPlan.from_spec("shrink", spec).run_key
    ids = _add_runs(dirs, "shrink", spec)

    async def scenario() -> None:
        network = InMemoryNetwork()
        watched = _Recording(network, "org-c")
        nodes = await _start(dirs, network, transports={"org-c": watched})
        a, b, c = (nodes[o] for o in ORGS)
        try:
            for org, node in nodes.items():
                await asyncio.to_thread(node.on_run_started, ids[org], spec)
            await _wait_for(lambda: _round(a) >= 2, what="round 2")
            proposal = await asyncio.to_thread(a.propose_remove, "org-c", "leaves mid-run")
            await _wait_for(
                lambda: proposal.digest in {p.digest for p in b.proposals()}, what="proposal"
            )
            await asyncio.to_thread(b.sign_proposal, proposal.digest)
            installed = [a, b]
            await _wait_for(
                lambda: all(n.current_manifest.version == 1 for n in installed),  # type: ignore[union-attr]
                what="removal installed",
            )
            # the round under way may still have had org-c; the next one may not
            next_round = max(_round(a), _round(b)) + 1
            await _both_complete(a, b, ids)
            for node in installed:
                engine = node.runs.active.engine  # type: ignore[union-attr]
                assert engine.plan.participants == ("org-a", "org-b")
                assert engine.state.plan["removed"] == ["org-c"]
            later = {r: n for r, n in _survivors(a, ids["org-a"]).items() if r > next_round}
            assert later and set(later.values()) == {2.0}
            # nothing of the run's later rounds reached the removed org
            sent_to_c = [
                e
                for e in watched.seen
                if e.run.startswith(key) and e.round >= next_round * ATTEMPTS
            ]
            assert sent_to_c == []
            # and the removed org fetches nothing of the run: sums, model hashes, models
            assert c.endpoint is not None
            last = (8 - 1) * ATTEMPTS
            for kind, payload in (
                (KIND_TOTAL, TOTAL_REQUEST.pack(0, 0, 1)),
                (KIND_MODEL, b"\0" * 32),
            ):
                with pytest.raises(Refused) as refused:
                    await c.endpoint.send("org-a", kind, payload, run=key, round=last)
                assert refused.value.reason is RefusalReason.NOT_MEMBER
            with pytest.raises(Refused):
                await list_shards(c.endpoint, "org-b", GLOBAL_OWNER, GLOBAL_SET, timeout=5)
            # the removed org, once it learns of its removal, stops the run for good (it
            # may have failed already, refused by the others: then that failure is final)
            c.runs.on_manifest(("org-a", "org-b"), 1)

            def final() -> bool:
                kept = read_failure(c.paths.run_dir(key))
                return kept is not None and not kept.recoverable

            await _wait_for(final, what="org-c stops for good")
            assert "removed from the federation" in c.runs.finished[ids["org-c"]]

            def said() -> bool:
                return "(it cannot be resumed)" in str(_state(c, ids["org-c"]).state_reason)

            await _wait_for(said, what="org-c's row says so")
            row = await asyncio.to_thread(_state, c, ids["org-c"])
            assert row.state == "failed" and "removed from the federation" in str(row.state_reason)
        finally:
            for node in nodes.values():
                await node.stop()

    asyncio.run(scenario())


def test_a_member_behind_catches_up_with_the_one_other_a_removal_left(tmp_path: Path) -> None:
    """org-b fails in round 2 while org-a and org-c go on; org-c is removed; org-b's run
    resumes behind org-a, the one other participant left, and catches up with the model
    org-a published (org-c's word no longer counts): both finish the run together."""
    dirs = make_federation(tmp_path)
    _configure(dirs, ready_timeout_s=3.0, model_hash_timeout_s=3, quorum_backoff_max_s=2.0)
    spec = _spec(7)
    ids = _add_runs(dirs, "behind", spec)
    _FailsOnce.crashed = False

    async def scenario() -> None:
        nodes = await _start(dirs, InMemoryNetwork(), trainers={"org-b": _FailsOnce})
        a, b = nodes["org-a"], nodes["org-b"]
        try:
            for org, node in nodes.items():
                await asyncio.to_thread(node.on_run_started, ids[org], spec)
            await _wait_for(lambda: ids["org-b"] in b.runs.finished, what="org-b fails")
            await _wait_for(lambda: _round(a) >= 4, what="org-a and org-c go on")
            proposal = await asyncio.to_thread(a.propose_remove, "org-c", "leaves")
            await _wait_for(
                lambda: proposal.digest in {p.digest for p in b.proposals()}, what="proposal"
            )
            await asyncio.to_thread(b.sign_proposal, proposal.digest)
            await _wait_for(
                lambda: all(n.current_manifest.version == 1 for n in (a, b)),  # type: ignore[union-attr]
                what="removal installed",
            )
            await asyncio.to_thread(b.runs.on_run_resumed, ids["org-b"], spec)
            await _both_complete(a, b, ids)
            done_at_b = set(_survivors(b, ids["org-b"]))
            assert max(done_at_b) == 7 and 3 not in done_at_b  # it skipped the rounds it missed
            models = {
                model_hash(n.runs.active.engine.state.model)  # type: ignore[union-attr]
                for n in (a, b)
            }
            assert len(models) == 1
        finally:
            for node in nodes.values():
                await node.stop()

    asyncio.run(scenario())


# -- finding 9 ---------------------------------------------------------------------------


def test_finding_9_an_ended_run_leaves_no_round_state_for_the_next() -> None:
    """The round engine's tables of a run that ended are dropped, and the model hashes of
    a new run (low round numbers) are never evicted for an old run's (high ones)."""

    def envelope(run: str, round: int, sender: str) -> Envelope:
        return Envelope("fed", run, round, "model", KIND_MODEL, sender, "me", 1, 0.0, b"h" * 32)

    hashes = ModelHashes(None, RoundConfig(), lambda run: None)  # type: ignore[arg-type]

    async def fill() -> None:
        for r in range(16):
            await hashes.on_model(envelope("old", 600 + r, "org-b"))
        await hashes.on_model(envelope("new", 0, "org-b"))

    asyncio.run(fill())
    assert ("new", 0) in hashes._hashes
    hashes.forget_run("old")
    assert [k for k in hashes._hashes if k[0] == "old"] == []

    class _Ring:
        def open(self, run: str, round: int) -> None: ...

        def close(self, run: str, round: int) -> None: ...

    table = RoundTable("me", RoundConfig(lookahead_rounds=4), _Ring())  # type: ignore[arg-type]
    for r in range(3):
        table.state("old", 10 + r)
    table.close_run("old")
    assert table.open_rounds() == []
    with pytest.raises(Refused, match="is over here"):
        table.state("old", 14)  # a late message of the ended run holds no slot
    table.keep_window("old", 14)  # the run runs here again (an admin resumed it)
    assert table.state("old", 14).round == 14


def test_finding_9_a_second_run_is_as_fast_and_recovery_brings_back_every_run(
    tmp_path: Path,
) -> None:
    dirs = make_federation(tmp_path)
    _configure(dirs, ready_timeout_s=3.0, model_hash_timeout_s=20)
    first, second = _spec(18), _spec(6)
    first_ids = _add_runs(dirs, "first", first)
    second_ids = _add_runs(dirs, "second", second)
    keys = {n: RunPlan.from_spec(n, s).run_key for n, s in (("first", first), ("second", second))}

    async def scenario() -> None:
        network = InMemoryNetwork()
        nodes = await _start(dirs, network)
        a, c = nodes["org-a"], nodes["org-c"]
        try:
            for org, node in nodes.items():
                await asyncio.to_thread(node.on_run_started, first_ids[org], first)
            await _wait_for(
                lambda: all(first_ids[o] in n.runs.finished for o, n in nodes.items()),
                120,
                "the first run",
            )
            assert {n.runs.finished[first_ids[o]] for o, n in nodes.items()} == {"completed"}
            loop = asyncio.get_running_loop()
            started = loop.time()
            for org, node in nodes.items():
                await asyncio.to_thread(node.on_run_started, second_ids[org], second)
            # the same nodes: every round of the second run goes through at once (a model
            # hash pushed out by the first run's would hold each round 20 s)
            # (the first three rounds in well under the 60 s they took before, on a loaded
            # machine too)
            await _wait_for(lambda: _round(c) >= 3, 50, "three rounds of the second run")
            assert loop.time() - started < 50
            assert set(_survivors(a, second_ids["org-a"]).values()) == {3.0}
            assert all(not run.startswith(keys["first"]) for run, _ in a.rounds.open_rounds())  # type: ignore[union-attr]
            # org-c loses its disk while the second run is under way
            await c.stop()
            fresh = tmp_path / "org-c-new"
            paths, _token = prepare_recovery(
                fresh,
                dirs["org-c"] / "org-c-recovery-backup.json",
                dirs["org-a"] / "federation" / "chain.json",
            )
            revived = OrgNode.open(fresh, transport=None)
            endpoint = Endpoint(
                revived.org_identity,
                "fed-test",
                _Revived(network, "org-c"),
                lambda: read_chain(paths.chain)[-1].public_keys(),
            )
            await endpoint.start()
            try:
                runs, lost = await recover_runs(
                    endpoint, load_secret(paths.secret), list(ORGS), paths, timeout=10
                )
            finally:
                await endpoint.close()
            assert lost == {}
            assert [r.run_key for r in runs] == [keys["second"], keys["first"]]
            in_progress, ended = runs
            # its newest checkpoint: round 3, or 2 while the third was being pushed
            assert in_progress.status == "running" and in_progress.round >= 2
            assert (ended.status, ended.round) == ("completed", 18)
            assert in_progress.path == paths.run_dir(keys["second"]) / "engine-state.bin"
            assert in_progress.path.exists() and ended.path.exists()
            # the rebuilt node knows both runs: the one to resume, and the one that ended
            states = [EngineState.from_bytes(r.path.read_bytes()) for r in runs]
            assert run_row(revived.db, states[0]) is not None
            assert run_row(revived.db, states[1]) is None
            with Session(revived.db) as s:
                rows = {r.run_key: r.state for r in s.exec(select(Run)).all()}
            assert rows == {keys["second"]: "running", keys["first"]: "completed"}
        finally:
            for org, node in nodes.items():
                if org != "org-c":
                    await node.stop()

    asyncio.run(scenario())


class _FailsOnce:
    """A trainer whose job crashes once, in round 2 (a worker killed, a full disk)."""

    crashed = False

    def __init__(self) -> None:
        self.inner = TinyTrainer(0.3, 0.05)

    def initial_model(self) -> dict[str, np.ndarray]:
        return self.inner.initial_model()

    def train(
        self, global_state: Mapping[str, np.ndarray], round: int, options: Mapping[str, Any]
    ) -> LocalResult:
        if round == 2 and not _FailsOnce.crashed:
            _FailsOnce.crashed = True
            raise RuntimeError("the local job crashed")
        return self.inner.train(global_state, round, options)


class _Gated:
    """A trainer that holds its job from round :data:`GATE_ROUND` on until ``opened``:
    the others wait there for the org that resumes, however slow the machine."""

    GATE_ROUND = 7
    opened = threading.Event()

    def __init__(self, value: float) -> None:
        self.inner = TinyTrainer(value, 0.05)

    def initial_model(self) -> dict[str, np.ndarray]:
        return self.inner.initial_model()

    def train(
        self, global_state: Mapping[str, np.ndarray], round: int, options: Mapping[str, Any]
    ) -> LocalResult:
        if round >= self.GATE_ROUND:
            assert _Gated.opened.wait(timeout=120), "the gate was never opened"
        return self.inner.train(global_state, round, options)


def test_finding_9_an_admin_resumes_a_failed_run_and_it_catches_up(tmp_path: Path) -> None:
    dirs = make_federation(tmp_path)
    _configure(dirs, ready_timeout_s=3.0, model_hash_timeout_s=3)
    spec = _spec(10)
    key = RunPlan.from_spec("mend", spec).run_key
    ids = _add_runs(dirs, "mend", spec)
    with Session(make_engine(default_database_url(dirs["org-c"]))) as s:
        _, token = create_token(s, "test", Role.ADMIN)
        s.commit()
    _FailsOnce.crashed = False
    _Gated.opened.clear()
    trainers = {
        "org-a": lambda: _Gated(0.1),
        "org-b": lambda: _Gated(0.2),
        "org-c": _FailsOnce,
    }

    async def scenario() -> None:
        nodes = await _start(dirs, InMemoryNetwork(), trainers=trainers)
        a, c = nodes["org-a"], nodes["org-c"]
        app = create_app(Settings(data_dir=dirs["org-c"]), c, engine=c.db)
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://admin",
            headers={"Authorization": f"Bearer {token}"},
        )
        try:
            for org, node in nodes.items():
                await asyncio.to_thread(node.on_run_started, ids[org], spec)
            await _wait_for(lambda: ids["org-c"] in c.runs.finished, what="org-c fails")
            assert c.runs.finished[ids["org-c"]].startswith("failed")
            run = f"/v1/runs/{ids['org-c']}"
            await _wait_for(lambda: _state(c, ids["org-c"]).state == "failed", what="row")
            why = str(_state(c, ids["org-c"]).state_reason)
            assert "the local job crashed" in why and why.endswith("(it can be resumed)")
            await _wait_for(lambda: _round(a) >= 5, what="the others go on")
            # an unrecoverable failure is refused with its reason, and nothing changes
            run_dir = c.paths.run_dir(key)
            kept = read_failure(run_dir)
            assert kept is not None and kept.recoverable
            write_failure(run_dir, Failure("the models diverged", False))
            refused = await client.post(f"{run}/resume")
            assert refused.status_code == 409
            assert "the models diverged" in refused.json()["detail"]
            assert (await client.get(run)).json()["state"] == "failed"
            write_failure(run_dir, kept)
            resumed = await client.post(f"{run}/resume")
            assert resumed.status_code == 200, resumed.text
            assert resumed.json()["state"] == "running"
            assert not (run_dir / FAILURE_FILE).exists()
            # the others hold at round 7 until org-c has caught up with them
            await _wait_for(lambda: _round(c) >= _Gated.GATE_ROUND, what="org-c to catch up")
            _Gated.opened.set()
            await _wait_for(
                lambda: all(ids[o] in n.runs.finished for o, n in nodes.items()),
                90,
                "every org to finish",
            )
            assert {n.runs.finished[ids[o]] for o, n in nodes.items()} == {"completed"}
            assert (await client.get(run)).json()["state"] == "completed"
            done_at_c = set(_survivors(c, ids["org-c"]))
            assert max(done_at_c) == 10 and len(done_at_c) < 10  # it caught up
            models = {
                model_hash(n.runs.active.engine.state.model)  # type: ignore[union-attr]
                for n in nodes.values()
            }
            assert len(models) == 1
        finally:
            _Gated.opened.set()  # no job left waiting when the test fails early
            await client.aclose()
            for node in nodes.values():
                await node.stop()

    asyncio.run(scenario())


def test_finding_9_the_report_of_a_wiped_org_says_which_entries_and_rounds_were_lost(
    tmp_path: Path,
) -> None:
    """A node rebuilt after a wipe starts a new egress log; the heads its peers hold of
    the old one prove how many entries are gone and which rounds of the run they held."""
    from coordinator_free.identity import OrgIdentity

    from org_node.audit import EgressLog
    from org_node.node.heads import lost_entries

    me = OrgIdentity.generate("org-c", b"\1" * 32)

    def send(log: EgressLog, round: int, seq: int) -> None:
        env = Envelope("fed", "k", round, "s", "round.ready", "org-c", "org-a", seq, 0.0, b"x")
        signed = env.with_signature(me.sign(env.signing_bytes()))
        log.record(signed, signed.to_wire())

    old = EgressLog(me, tmp_path / "old.jsonl")
    held = []
    for r in range(1, 4):  # three rounds of run k, a head after each (what peers keep)
        for i in range(5):
            send(old, r * ATTEMPTS, r * 10 + i)
        held.append(old.sign_head("k", r))
    old.close()
    new = EgressLog(me, tmp_path / "new.jsonl")
    send(new, 4 * ATTEMPTS, 100)
    new.sign_head("k", 4)
    assert lost_entries(new, new.heads, "k") == []  # its own heads prove nothing lost
    lines = lost_entries(new, held, "k")
    assert len(lines) == 2
    assert "at least 15 entries of an earlier log are gone" in lines[0]
    assert "3 signed heads" in lines[0]
    assert "rounds up to 3 of this run" in lines[1] and "rounds 1-3" in lines[1]
    # a head that the org's key did not sign proves nothing
    forged = [replace(h, signature="") for h in held]
    assert lost_entries(new, forged, "k") == []
    new.close()
