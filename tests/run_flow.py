"""The run flow every multi-node test drives through the admin APIs: a run proposed once
at one org reaches the others, each accepts it, and it starts by itself once every
consent is in (``org_node.proposals``)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

__all__ = [
    "admin_clients",
    "apropose_once",
    "await_states",
    "propose_once",
    "seen",
    "wait_states",
]

START_DELAY_S = 1
"""The tests' start delay after the last consent (the product's default is 5 s)."""


def _body(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
    return {"name": name, "spec": dict(spec), "start_delay_s": START_DELAY_S}


def propose_once(
    clients: Mapping[str, httpx.Client],
    name: str,
    spec: Mapping[str, Any],
    accept: Mapping[str, Mapping[str, Any]] | None = None,
    timeout: float = 60.0,
) -> dict[str, str]:
    """Propose at the first org, wait for every org to see it, accept at each (with
    ``accept[org]`` as the body); the run's local id at each org."""
    first = next(iter(clients.values()))
    r = first.post("/v1/runs", json=_body(name, spec))
    assert r.status_code == 201, r.text
    ids: dict[str, str] = {}
    end = time.monotonic() + timeout
    for org, c in clients.items():
        while True:
            got = c.get(f"/v1/runs/{name}")
            if got.status_code == 200:
                ids[org] = got.json()["id"]
                break
            assert time.monotonic() < end, f"{org} never saw the proposal: {got.text}"
            time.sleep(0.1)
    for org, c in clients.items():
        r = c.post(f"/v1/runs/{name}/accept", json=dict((accept or {}).get(org, {})))
        assert r.status_code == 200, r.text
    return ids


def wait_states(
    clients: Mapping[str, httpx.Client],
    name: str,
    states: set[str],
    timeout: float = 60.0,
) -> dict[str, dict[str, Any]]:
    """Wait until the run is in one of ``states`` at every org; its rows."""
    rows: dict[str, dict[str, Any]] = {}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rows = {o: c.get(f"/v1/runs/{name}").json() for o, c in clients.items()}
        if all(row.get("state") in states for row in rows.values()):
            break
        time.sleep(0.1)
    return rows


async def apropose_once(
    clients: Mapping[str, httpx.AsyncClient],
    name: str,
    spec: Mapping[str, Any],
    timeout: float = 60.0,
) -> dict[str, str]:
    """:func:`propose_once` over async clients."""
    first = next(iter(clients.values()))
    r = await first.post("/v1/runs", json=_body(name, spec))
    assert r.status_code == 201, r.text
    ids: dict[str, str] = {}
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    for org, c in clients.items():
        while True:
            got = await c.get(f"/v1/runs/{name}")
            if got.status_code == 200:
                ids[org] = got.json()["id"]
                break
            assert loop.time() < end, f"{org} never saw the proposal: {got.text}"
            await asyncio.sleep(0.05)
    for c in clients.values():
        r = await c.post(f"/v1/runs/{name}/accept", json={})
        assert r.status_code == 200, r.text
    return ids


async def await_states(
    clients: Mapping[str, httpx.AsyncClient],
    name: str,
    states: set[str],
    timeout: float = 60.0,
) -> dict[str, dict[str, Any]]:
    """:func:`wait_states` over async clients."""
    rows: dict[str, dict[str, Any]] = {}
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        rows = {o: (await c.get(f"/v1/runs/{name}")).json() for o, c in clients.items()}
        if all(row.get("state") in states for row in rows.values()):
            break
        await asyncio.sleep(0.05)
    return rows


def admin_clients(
    dirs: Mapping[str, Path], nodes: Mapping[str, Any]
) -> dict[str, httpx.AsyncClient]:
    """An admin API client per in-process node (``nodes``: org -> ``OrgNode``), each
    with a fresh admin token of its org."""
    from sqlmodel import Session

    from api.app import create_app
    from api.settings import Settings
    from org_node.db.engine import default_database_url, make_engine
    from org_node.db.models import Role
    from org_node.db.repo import create_token

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


async def seen(c: httpx.AsyncClient, ref: str, timeout: float = 20.0) -> dict[str, Any]:
    """The run ``ref`` at the org of ``c``, once its proposal has arrived there."""
    end = asyncio.get_running_loop().time() + timeout
    while True:
        r = await c.get(f"/v1/runs/{ref}")
        if r.status_code == 200:
            body: dict[str, Any] = r.json()
            return body
        assert asyncio.get_running_loop().time() < end, r.text
        await asyncio.sleep(0.05)
