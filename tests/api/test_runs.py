"""``/v1/runs``: proposal, consent, the state machine over HTTP, metrics, SSE."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from sqlmodel import Session, select

from org_node.db.models import AuditEvent, Role, Run, RunMetric
from org_node.runs import InvalidTransition, RunAction, RunState, allowed_actions, next_state
from org_node.services import RunEventBus, ServiceRefused
from tests.api.conftest import ORG, RUN_SPEC, Api, propose_run


def test_propose_read_and_list(api: Api) -> None:
    run = propose_run(api, peers_accept=False)
    assert run["state"] == "proposed" and run["version"] == 1
    assert run["origin"] == ORG and len(run["run_key"]) == 32 and run["consents"] == []
    assert run["waiting"]["what"] == "consent"
    assert run["waiting"]["orgs"] == sorted(RUN_SPEC["participants"])
    assert ("announced", run["id"]) in api.node.calls
    assert run["spec"]["participants"] == RUN_SPEC["participants"]
    assert run["proposed_by"] == "admin-token"
    got = api.client.get(f"/v1/runs/{run['id']}", headers=api.h(Role.AUDITOR)).json()
    assert got == run
    listed = api.client.get("/v1/runs?state=proposed", headers=api.h()).json()
    assert listed["count"] == 1 and listed["data"][0]["id"] == run["id"]
    assert api.client.get("/v1/runs?state=running", headers=api.h()).json()["count"] == 0


def test_full_life_cycle_calls_hooks_and_records_consent(api: Api) -> None:
    run = propose_run(api)
    rid = run["id"]
    for action, state in [
        ("accept", "accepted"),
        ("start", "running"),
        ("pause", "paused"),
        ("resume", "running"),
        ("abort", "aborted"),
    ]:
        r = api.client.post(
            f"/v1/runs/{rid}/{action}", json={"reason": "ok by us"}, headers=api.h(Role.OPERATOR)
        )
        assert r.status_code == 200, r.text
        assert r.json()["state"] == state
    final = api.client.get(f"/v1/runs/{rid}", headers=api.h()).json()
    assert final["decided_by"] == "operator-token"
    assert final["decision_reason"] == "ok by us"
    assert final["version"] == 6
    hooks = [c[0] for c in api.node.calls if c[0] != "announced"]
    assert hooks == ["accepted", "started", "paused", "resumed", "aborted"]
    # the proposal, then this org's consent: each spread once
    assert [c for c in api.node.calls if c[0] == "announced"] == [("announced", rid)] * 2
    with Session(api.engine) as s:
        kinds = s.exec(select(AuditEvent.kind).where(AuditEvent.run == rid)).all()
    assert kinds == [
        "run.propose",
        "run.accept",
        "run.start",
        "run.pause",
        "run.resume",
        "run.abort",
    ]


def test_invalid_transition_is_409_naming_the_state(api: Api) -> None:
    rid = propose_run(api)["id"]
    assert api.client.post(f"/v1/runs/{rid}/abort", headers=api.h()).status_code == 200
    r = api.client.post(f"/v1/runs/{rid}/start", headers=api.h())
    assert r.status_code == 409
    assert "aborted" in r.json()["detail"]
    assert api.client.get(f"/v1/runs/{rid}", headers=api.h()).json()["state"] == "aborted"


def test_stale_version_is_409(api: Api) -> None:
    rid = propose_run(api)["id"]
    r = api.client.post(f"/v1/runs/{rid}/accept", json={"version": 7}, headers=api.h())
    assert r.status_code == 409 and "version is 1" in r.json()["detail"]
    r = api.client.post(f"/v1/runs/{rid}/accept", json={"version": 1}, headers=api.h())
    assert r.status_code == 200


def test_refusing_hook_leaves_nothing_written(api: Api) -> None:
    rid = propose_run(api)["id"]
    api.node.refuse_next = ServiceRefused("engine busy")
    r = api.client.post(f"/v1/runs/{rid}/accept", headers=api.h())
    assert r.status_code == 409 and "engine busy" in r.json()["detail"]
    run = api.client.get(f"/v1/runs/{rid}", headers=api.h()).json()
    assert run["state"] == "proposed" and run["version"] == 1 and run["decided_by"] is None
    with Session(api.engine) as s:
        assert s.exec(select(AuditEvent).where(AuditEvent.kind == "run.accept")).first() is None


def test_policy_blocks_consent(api: Api) -> None:
    p = {"name": "strict", "max_epsilon": 1.0, "allowed_trainers": ["digits"]}
    assert api.client.post("/v1/policies", json=p, headers=api.h()).status_code == 201
    rid = propose_run(api)["id"]
    r = api.client.post(f"/v1/runs/{rid}/accept", headers=api.h())
    assert r.status_code == 409
    detail = r.json()["detail"]
    assert "strict" in detail and "epsilon" in detail and "breast_cancer" in detail
    r = api.client.post(f"/v1/runs/{rid}/decline", json={"reason": "no"}, headers=api.h())
    assert r.status_code == 200


def test_unknown_run_and_bad_specs(api: Api) -> None:
    assert api.client.get("/v1/runs/nope", headers=api.h()).status_code == 404
    assert api.client.post("/v1/runs/nope/start", headers=api.h()).status_code == 404
    bads: list[dict[str, object]] = [
        {"threshold": 9},
        {"participants": []},
        {"participants": ["a", "a"]},
        {"epsilon": -1},
        {"backend": "plain"},
        {"rounds": 0},
        {"surprise": 1},
        {"compression": "top-k=0.1"},
        {"compression": "q8", "epsilon": 1.0},
        {"compression": "random-k=0.1", "backend": "ckks"},
    ]
    for bad in bads:
        r = api.client.post("/v1/runs", json={"name": "x", "spec": RUN_SPEC | bad}, headers=api.h())
        assert r.status_code == 422, bad
    with Session(api.engine) as s:
        assert s.exec(select(Run)).all() == []


def test_idempotent_proposal(api: Api) -> None:
    body = {"name": "r1", "spec": RUN_SPEC}
    key = {"Idempotency-Key": "abc-1"}
    a = api.client.post("/v1/runs", json=body, headers=api.h(Role.ADMIN, **key))
    b = api.client.post("/v1/runs", json=body, headers=api.h(Role.ADMIN, **key))
    assert a.status_code == b.status_code == 201 and a.json() == b.json()
    c = api.client.post("/v1/runs", json=body | {"name": "r2"}, headers=api.h(Role.ADMIN, **key))
    assert c.status_code == 422
    assert api.client.get("/v1/runs", headers=api.h()).json()["count"] == 1


def test_metrics_by_round(api: Api) -> None:
    rid = propose_run(api)["id"]
    with Session(api.engine) as s:
        for rnd in (0, 1, 2):
            s.add(RunMetric(run_id=rid, round=rnd, name="loss", value=1.0 / (rnd + 1)))
        s.commit()
    r = api.client.get(f"/v1/runs/{rid}/metrics", headers=api.h(Role.AUDITOR)).json()
    assert r["count"] == 3 and [m["round"] for m in r["data"]] == [0, 1, 2]
    one = api.client.get(f"/v1/runs/{rid}/metrics?round=1", headers=api.h()).json()
    assert one["count"] == 1 and one["data"][0]["value"] == pytest.approx(0.5)


def _events(text: str) -> list[tuple[str, dict[str, object]]]:
    out = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        out.append((fields["event"], json.loads(fields["data"])))
    return out


def test_event_stream_of_a_finished_run(api: Api) -> None:
    rid = propose_run(api)["id"]
    api.client.post(f"/v1/runs/{rid}/decline", json={"reason": "not now"}, headers=api.h())
    with api.client.stream("GET", f"/v1/runs/{rid}/events", headers=api.h()) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    assert _events(body) == [("state", {"state": "declined", "version": 2})]


def test_event_stream_follows_progress_until_the_end(api: Api) -> None:
    rid = propose_run(api)["id"]
    api.client.post(f"/v1/runs/{rid}/accept", headers=api.h())
    api.client.post(f"/v1/runs/{rid}/start", headers=api.h())
    api.node.events.publish(rid, "round", {"round": 1, "survivors": 3})
    api.node.events.publish(rid, "state", {"state": "completed"})
    with api.client.stream("GET", f"/v1/runs/{rid}/events", headers=api.h()) as r:
        events = _events(r.read().decode())
    assert events[0] == ("state", {"state": "running", "version": 3})
    assert ("round", {"round": 1, "survivors": 3}) in events
    assert events[-1] == ("state", {"state": "completed"})
    assert api.node.events.subscribers(rid) == 0


def test_transition_table_is_total_and_consistent() -> None:
    for state in RunState:
        for action in RunAction:
            if action in allowed_actions(state):
                assert next_state(state, action) in RunState
            else:
                with pytest.raises(InvalidTransition, match=state.value):
                    next_state(state, action)
    with pytest.raises(ValueError):
        next_state("flying", "start")


def test_two_operators_starting_one_run_one_wins(api: Api) -> None:
    rid = propose_run(api)["id"]
    api.client.post(f"/v1/runs/{rid}/accept", headers=api.h())
    barrier = threading.Barrier(2)
    codes: list[int] = []

    def operator() -> None:
        barrier.wait()
        codes.append(
            api.client.post(f"/v1/runs/{rid}/start", headers=api.h(Role.OPERATOR)).status_code
        )

    threads = [threading.Thread(target=operator) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(codes) == [200, 409]
    assert [c for c in api.node.calls if c[0] == "started"] == [("started", rid)]


def test_event_bus_delivers_across_threads_and_drops_the_oldest() -> None:
    bus = RunEventBus(queue_size=2, history=1)

    async def scenario() -> list[int]:
        queue = bus.subscribe("r")
        publisher = threading.Thread(
            target=lambda: [bus.publish("r", "round", {"round": i}) for i in range(5)]
        )
        publisher.start()
        publisher.join()
        await asyncio.sleep(0.05)
        got = [queue.get_nowait().data["round"] for _ in range(queue.qsize())]
        bus.unsubscribe("r", queue)
        return got

    assert asyncio.run(scenario()) == [3, 4]
    assert bus.subscribers("r") == 0

    async def late() -> list[int]:
        queue = bus.subscribe("r")
        return [queue.get_nowait().data["round"] for _ in range(queue.qsize())]

    assert asyncio.run(late()) == [4]  # the history replays the last event
    with pytest.raises(ValueError):
        RunEventBus(queue_size=0)


# -- a run proposed once: bad input is a 4xx with its reason, nothing half-started ------


def _state(api: Api, ref: str) -> dict[str, Any]:
    body: dict[str, Any] = api.client.get(f"/v1/runs/{ref}", headers=api.h()).json()
    return body


def test_a_proposal_naming_a_non_member_or_leaving_out_the_proposer_is_422(api: Api) -> None:
    for participants, said in (
        ([ORG, "org-b", "org-zz"], "org-zz are not members of the federation"),
        (["org-b", "org-c"], "proposes only runs it takes part in"),
    ):
        body = {"name": "bad", "spec": RUN_SPEC | {"participants": participants}}
        r = api.client.post("/v1/runs", json=body, headers=api.h())
        assert r.status_code == 422 and said in r.json()["detail"], r.text
    assert api.client.get("/v1/runs", headers=api.h()).json()["count"] == 0
    assert [c for c in api.node.calls if c[0] == "announced"] == []


def test_a_name_used_in_the_federation_is_409(api: Api) -> None:
    run = propose_run(api)
    r = api.client.post("/v1/runs", json={"name": "r1", "spec": RUN_SPEC}, headers=api.h())
    assert r.status_code == 409 and run["run_key"] in r.json()["detail"]


def test_a_run_is_found_by_its_key_name_and_key_prefix(api: Api) -> None:
    run = propose_run(api)
    for ref in (run["run_key"], "r1", run["run_key"][:8], run["id"]):
        assert _state(api, ref)["id"] == run["id"]
    assert api.client.get("/v1/runs/r2", headers=api.h()).status_code == 404
    r = api.client.get(f"/v1/runs/{run['run_key']}/metrics", headers=api.h())
    assert r.status_code == 200


def test_decline_without_reason_second_accept_and_wrong_key_are_refused(api: Api) -> None:
    run = propose_run(api)
    r = api.client.post("/v1/runs/r1/decline", json={"reason": " "}, headers=api.h())
    assert r.status_code == 422 and "must give its reason" in r.json()["detail"]
    wrong = "0" * 32
    r = api.client.post("/v1/runs/r1/accept", json={"run_key": wrong}, headers=api.h())
    assert r.status_code == 409 and "not the one reviewed" in r.json()["detail"]
    assert _state(api, "r1")["state"] == "proposed"
    r = api.client.post("/v1/runs/r1/accept", json={"run_key": run["run_key"]}, headers=api.h())
    assert r.status_code == 200
    r = api.client.post("/v1/runs/r1/accept", json={}, headers=api.h())
    assert r.status_code == 409 and "accepted" in r.json()["detail"]
    mine = [c for c in _state(api, "r1")["consents"] if c["org_id"] == ORG]
    assert [c["decision"] for c in mine] == ["accept"]


def test_an_accept_after_the_deadline_is_409(api: Api) -> None:
    propose_run(api)
    with Session(api.engine) as s:
        row = s.exec(select(Run).where(Run.name == "r1")).one()
        assert row.proposal is not None
        row.proposal = dict(row.proposal) | {"consent_by_ms": row.proposal["proposed_at_ms"] + 1}
        s.add(row)
        s.commit()
    r = api.client.post("/v1/runs/r1/accept", json={}, headers=api.h())
    assert r.status_code == 409 and "consent deadline passed" in r.json()["detail"]
    assert _state(api, "r1")["state"] == "proposed" and _state(api, "r1")["consents"] != []


def test_start_waits_for_every_consent_and_says_whose(api: Api) -> None:
    propose_run(api, peers_accept=False)
    assert api.client.post("/v1/runs/r1/accept", json={}, headers=api.h()).status_code == 200
    waiting = _state(api, "r1")["waiting"]
    assert waiting["what"] == "consent" and waiting["orgs"] == ["org-b", "org-c"]
    r = api.client.post("/v1/runs/r1/start", json={}, headers=api.h())
    assert r.status_code == 409 and "org-b, org-c" in r.json()["detail"]
    assert _state(api, "r1")["state"] == "accepted"
    assert not [c for c in api.node.calls if c[0] == "started"]


def test_finding_9_a_failed_run_may_be_resumed_and_one_paused_in_its_last_round_completes() -> None:
    from org_node.runs import TERMINAL_STATES

    assert next_state(RunState.FAILED, RunAction.RESUME) is RunState.RUNNING
    assert allowed_actions(RunState.FAILED) == (RunAction.RESUME,)
    assert next_state(RunState.PAUSED, RunAction.COMPLETE) is RunState.COMPLETED
    # a failed run has still ended: streams stop, datasets and trainers are free again
    assert RunState.FAILED in TERMINAL_STATES and RunState.PAUSED not in TERMINAL_STATES


def test_a_proposal_stores_its_compression_in_canonical_form(api: Api) -> None:
    spec = RUN_SPEC | {"compression": "q8,random-k=0.1", "epsilon": None}
    body = {"name": "small", "spec": spec}
    r = api.client.post("/v1/runs", json=body, headers=api.h(Role.ADMIN))
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["compression"] == "random-k=0.1,q8"
    plain = api.client.post("/v1/runs", json={"name": "plain", "spec": RUN_SPEC}, headers=api.h())
    assert plain.status_code == 201, plain.text
    assert plain.json()["spec"]["compression"] == "none"
