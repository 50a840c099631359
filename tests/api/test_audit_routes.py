"""``/v1/audit``: filtered, paginated events; the report and its chain verification."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

from sqlmodel import Session, col, select

from org_node.db.models import AuditEvent, Role
from org_node.db.repo import GENESIS_HASH, append_audit_event, audit_entry_hash
from tests.api.conftest import Api

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _seed(api: Api) -> None:
    with Session(api.engine) as s:
        for i in range(6):
            append_audit_event(
                s,
                time=T0 + timedelta(minutes=i),
                run="run1" if i < 4 else "run2",
                round=i,
                stage="ring",
                peer="org-b" if i % 2 else "org-c",
                kind="masked_chunk",
                bytes=100 * (i + 1),
                sha256="ab" * 32,
                privacy_class="masked",
            )
        s.commit()


def test_events_filter_and_paginate(api: Api) -> None:
    _seed(api)
    h = api.h(Role.AUDITOR)
    all_ = api.client.get("/v1/audit/events?kind=masked_chunk", headers=h).json()
    assert all_["count"] == 6 and [e["round"] for e in all_["data"]] == list(range(6))
    page = api.client.get("/v1/audit/events?kind=masked_chunk&offset=2&limit=2", headers=h).json()
    assert page["count"] == 6 and [e["round"] for e in page["data"]] == [2, 3]
    by_run = api.client.get("/v1/audit/events?run=run2", headers=h).json()
    assert by_run["count"] == 2
    by_peer = api.client.get("/v1/audit/events?peer=org-b&run=run1", headers=h).json()
    assert [e["round"] for e in by_peer["data"]] == [1, 3]
    since = (T0 + timedelta(minutes=3)).isoformat()
    until = (T0 + timedelta(minutes=5)).isoformat()
    window = api.client.get(
        "/v1/audit/events", params={"since": since, "until": until}, headers=h
    ).json()
    assert [e["round"] for e in window["data"]] == [3, 4]
    assert api.client.get("/v1/audit/events?limit=0", headers=h).status_code == 422
    assert api.client.get("/v1/audit/events?since=yesterday", headers=h).status_code == 422


def test_report_totals_and_a_sound_chain(api: Api) -> None:
    _seed(api)
    r = api.client.get("/v1/audit/report?run=run1", headers=api.h()).json()
    assert r["events"] == 4 and r["bytes_total"] == 100 + 200 + 300 + 400
    assert r["bytes_by_peer"] == {"org-b": 200 + 400, "org-c": 100 + 300}
    assert r["events_by_kind"] == {"masked_chunk": 4}
    assert r["chain_ok"] is True and r["first_bad_entry"] is None


def test_report_finds_a_tampered_entry(api: Api) -> None:
    _seed(api)
    with Session(api.engine) as s:
        row = s.exec(select(AuditEvent).where(AuditEvent.round == 2)).one()
        row.bytes = 1
        s.add(row)
        s.commit()
        bad_id = row.id
    r = api.client.get("/v1/audit/report", headers=api.h(Role.AUDITOR)).json()
    assert r["chain_ok"] is False and r["first_bad_entry"] == bad_id


def test_chain_links(api: Api) -> None:
    _seed(api)
    with Session(api.engine) as s:
        rows = s.exec(select(AuditEvent).order_by(col(AuditEvent.id))).all()
    prev = GENESIS_HASH
    for row in rows:
        assert row.prev_hash == prev
        assert row.entry_hash == audit_entry_hash(prev, row.model_dump())
        prev = row.entry_hash


def test_entry_hash_vector() -> None:
    fields = {
        "time": datetime(2026, 1, 1, 12, 0, tzinfo=UTC),
        "run": "r",
        "round": 1,
        "stage": "ring",
        "peer": "org-b",
        "kind": "masked_chunk",
        "bytes": 10,
        "sha256": None,
        "privacy_class": "masked",
    }
    naive = fields | {"time": datetime(2026, 1, 1, 12, 0)}
    assert audit_entry_hash(GENESIS_HASH, fields) == audit_entry_hash(GENESIS_HASH, naive)
    assert (
        audit_entry_hash(GENESIS_HASH, fields)
        == "6f4df034250926a849552e9ec64bb01464b0c748178b838c13385253d79d74f2"
    )


def test_operators_may_not_read_the_audit_log(api: Api) -> None:
    assert api.client.get("/v1/audit/events", headers=api.h(Role.OPERATOR)).status_code == 403


def test_concurrent_appends_never_fork_the_chain(api: Api) -> None:
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def writer(peer: str) -> None:
        try:
            barrier.wait()
            for i in range(5):
                with Session(api.engine) as s:
                    append_audit_event(
                        s, stage="ring", kind="chunk", peer=peer, round=i, privacy_class="masked"
                    )
                    time.sleep(0.002)  # hold the transaction open while others try
                    s.commit()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(f"org-{k}",)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    r = api.client.get("/v1/audit/report?kind=chunk", headers=api.h()).json()
    assert r["chain_ok"] is True and r["head_ok"] is True
    assert r["events_by_kind"]["chunk"] == 20


def test_rolled_back_append_leaves_the_head_alone(api: Api) -> None:
    _seed(api)
    with Session(api.engine) as s:
        append_audit_event(s, stage="x", kind="never", privacy_class="internal")
        s.rollback()
    r = api.client.get("/v1/audit/report", headers=api.h()).json()
    assert r["chain_ok"] is True and "never" not in r["events_by_kind"]
