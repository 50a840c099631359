"""The API's per-request fast paths keep their answers: fresh reads, the same token
checks, ``last_used_at`` once a minute, the fallback of :class:`api.reads.Reads`, and
the audit listing encoded by SQLite equal to the generic encoding."""

from __future__ import annotations

import asyncio
import json
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic_core import to_json
from sqlalchemy import Connection, text, update
from sqlalchemy.exc import OperationalError
from sqlmodel import Session, col, select

from api.deps import Page
from api.reads import Reads
from api.routers.audit import events_page_generic, events_page_sqlite
from org_node.db.engine import make_engine
from org_node.db.models import ApiToken, Role, Run
from org_node.db.repo import append_audit_event, live_token, update_versioned
from tests.api.conftest import Api, propose_run


def test_a_get_after_a_write_elsewhere_sees_the_write(api: Api) -> None:
    """No cache: a write by another connection (as the run engine makes) is seen by the
    next GET, on the event loop's own connection."""
    run = propose_run(api)
    path = f"/v1/runs/{run['id']}"
    assert api.client.get(path, headers=api.h()).json()["current_round"] == 0
    for round_ in (1, 2):
        with Session(api.engine) as s:
            row = s.get(Run, run["id"])
            assert row is not None
            assert update_versioned(s, Run, run["id"], row.version, {"current_round": round_})
            s.commit()
        got = api.client.get(path, headers=api.h()).json()
        assert got["current_round"] == round_ and got["version"] == 1 + round_
    with api.engine.begin() as conn:
        conn.execute(text("DELETE FROM run"))
    assert api.client.get(path, headers=api.h()).status_code == 404


def test_a_revoked_token_fails_on_the_next_request(api: Api) -> None:
    h = api.h(Role.AUDITOR)
    assert api.client.get("/v1/runs", headers=h).status_code == 200
    with api.engine.begin() as conn:
        conn.execute(text("UPDATE api_token SET revoked_at = '2026-01-01 00:00:00.000000'"))
    assert api.client.get("/v1/runs", headers=h).status_code == 401


def _last_used(api: Api, role: Role) -> datetime | None:
    with Session(api.engine) as s:
        token = s.exec(select(ApiToken).where(ApiToken.name == f"{role.value}-token")).one()
        return token.last_used_at


def test_last_used_is_written_at_most_once_a_minute(api: Api) -> None:
    assert _last_used(api, Role.OPERATOR) is None
    api.client.get("/v1/runs", headers=api.h(Role.OPERATOR))
    first = _last_used(api, Role.OPERATOR)
    assert first is not None and first.tzinfo is not None
    api.client.get("/v1/runs", headers=api.h(Role.OPERATOR))
    assert _last_used(api, Role.OPERATOR) == first
    old = first - timedelta(minutes=2)
    with api.engine.begin() as conn:
        conn.execute(
            update(ApiToken).where(col(ApiToken.name) == "operator-token").values(last_used_at=old)
        )
    api.client.get("/v1/runs", headers=api.h(Role.OPERATOR))
    later = _last_used(api, Role.OPERATOR)
    assert later is not None and later > old + timedelta(minutes=1)


def test_live_token_checks_like_find_token(api: Api) -> None:
    secret = api.tokens[Role.ADMIN]
    with api.engine.connect() as conn:
        found = live_token(conn, secret)
        assert found is not None and found.role is Role.ADMIN and found.name == "admin-token"
        assert live_token(conn, secret[:-1] + ("A" if secret[-1] != "A" else "B")) is None
        assert live_token(conn, "fw_000000000000_" + "a" * 43) is None
        assert live_token(conn, "not a token") is None


def _read_one(conn: Connection) -> int:
    return int(conn.execute(text("SELECT 1")).scalar_one())


def test_reads_run_on_the_loop_thread_for_sqlite(api: Api) -> None:
    reads = Reads(api.engine)
    seen: list[int] = []

    def where(conn: Connection) -> int:
        seen.append(threading.get_ident())
        return _read_one(conn)

    async def go() -> None:
        assert await reads(where) == 1
        assert seen == [threading.get_ident()]

    asyncio.run(go())
    reads.close()


def test_a_locked_inline_read_is_retried_in_a_worker_thread(api: Api) -> None:
    reads = Reads(api.engine)
    threads: list[int] = []

    def locked_once(conn: Connection) -> int:
        threads.append(threading.get_ident())
        if len(threads) == 1:
            raise OperationalError("SELECT 1", {}, Exception("database is locked"))
        return _read_one(conn)

    async def go() -> None:
        assert await reads(locked_once) == 1
        assert threads[0] == threading.get_ident() != threads[1]
        assert await reads(_read_one) == 1  # a new loop connection after the failure

    asyncio.run(go())
    reads.close()


def test_a_busy_loop_connection_sends_the_read_to_a_worker_thread(api: Api) -> None:
    reads = Reads(api.engine)
    threads: list[int] = []

    def where(conn: Connection) -> int:
        threads.append(threading.get_ident())
        return _read_one(conn)

    async def go() -> None:
        with reads._lock:  # another event loop is using the connection
            assert await reads(where) == 1
        assert threads[0] != threading.get_ident()

    asyncio.run(go())
    reads.close()


T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def _varied_events(api: Api) -> None:
    times = [T0, T0 + timedelta(microseconds=1000), T0 + timedelta(seconds=5, microseconds=7)]
    with Session(api.engine) as s:
        for i in range(9):
            append_audit_event(
                s,
                time=times[i % 3] + timedelta(days=i),
                run=None if i % 4 == 0 else f"run{i % 2}",
                round=None if i % 3 == 0 else i,
                stage="ring",
                peer=None if i % 5 == 0 else 'org-ü"\\\n' if i % 2 else "org-b",
                kind="masked_chunk" if i % 2 else "k",
                bytes=(2**40 + i) if i % 2 else 0,
                sha256=None if i % 2 else "ab" * 32,
                privacy_class="masked",
            )
        s.commit()


@pytest.mark.parametrize(
    "cond_of",
    [
        lambda: [],
        lambda: [text("kind = 'masked_chunk'")],
        lambda: [text("time >= '2026-03-03'")],
    ],
)
def test_sqlite_encoded_events_equal_the_generic_encoding(api: Api, cond_of: Any) -> None:
    _varied_events(api)
    for page in (Page(0, 100), Page(2, 3), Page(50, 10)):
        with Session(api.engine) as s:
            fast = events_page_sqlite(s, cond_of(), page)
            generic = events_page_generic(s, cond_of(), page)
        assert fast is not None
        assert json.loads("[" + ",".join(fast) + "]") == json.loads(to_json(generic))
        # keys in the same order, too
        assert [list(json.loads(f)) for f in fast] == [list(g) for g in generic]


def test_an_unusual_stored_time_takes_the_generic_path(api: Api) -> None:
    _varied_events(api)
    h = api.h(Role.AUDITOR)
    before = api.client.get("/v1/audit/events", headers=h).json()
    with api.engine.begin() as conn:
        conn.execute(text("UPDATE audit_event SET time = '2026-03-01 12:00:00' WHERE id = 1"))
    with Session(api.engine) as s:
        assert events_page_sqlite(s, [], Page(0, 100)) is None
    after = api.client.get("/v1/audit/events", headers=h).json()
    assert after["count"] == before["count"] == 9
    assert after["data"][0]["time"] == "2026-03-01T12:00:00Z"
    assert after["data"][1:] == before["data"][1:]


def test_the_events_listing_answers_the_generic_encoding(api: Api) -> None:
    _varied_events(api)
    got = api.client.get("/v1/audit/events?offset=1&limit=5", headers=api.h(Role.AUDITOR))
    assert got.status_code == 200 and got.headers["content-type"] == "application/json"
    with Session(api.engine) as s:
        generic = events_page_generic(s, [], Page(1, 5))
    assert got.json() == json.loads(to_json({"data": generic, "count": 9}))


def test_reads_stay_off_the_loop_where_they_must(api: Api) -> None:
    assert Reads(api.engine).inline is (api.engine.dialect.name == "sqlite")
    memory = make_engine("sqlite://")
    try:
        assert Reads(memory).inline is False  # one database per connection: never shared
    finally:
        memory.dispose()
