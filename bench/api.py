"""Admin API latency and throughput, SQLite and PostgreSQL side by side.

Run::

    python -m bench.api [--quick] [--json PATH]

The API is served by uvicorn on 127.0.0.1 in this process; the load comes from a second
process (``multiprocessing`` spawn) over loopback with keep-alive connections. Seeded
with one run and 10 000 hash-chained audit events.

Rows, per database (``sqlite`` always; ``postgres`` when ``FEDWEAVE_TEST_POSTGRES_URL``
names a reachable server, on a scratch database created and dropped here):

- ``get_run_p99[DB,200rps]``: p99 latency (ms) of ``GET /v1/runs/{id}`` under an
  open-loop load of 200 requests/s. Latency counts from the request's scheduled send
  time, so queueing behind slow requests is included (no coordinated omission).
  Target on SQLite: < 50 ms. Baseline: ``GET /healthz`` (no token, no database) under
  the same load.
- ``get_run_rps[DB]``: requests/s of ``GET /v1/runs/{id}`` from 8 closed-loop clients;
  baseline ``GET /healthz`` the same way.
- ``audit_list_10k_p99[DB]``: p99 latency (ms) of listing all 10 000 audit events
  (10 pages of 1 000, ``GET /v1/audit/events``) from 4 closed-loop listers; baseline
  is listing one page of 1 000.
- ``audit_lists_per_s[DB]``: full listings of 10 000 events per second, same load.

PostgreSQL rows carry the SQLite figure as their baseline.
"""

from __future__ import annotations

import http.client
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import uvicorn
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlmodel import Session

from api.app import create_app
from api.settings import Settings
from bench.common import Report, run_main
from org_node.db.engine import make_engine
from org_node.db.models import AuditEvent, AuditHead, Role, Run
from org_node.db.repo import GENESIS_HASH, audit_entry_hash, create_token
from org_node.services import NodeIdentityInfo, StaticNode

__all__ = ["main"]

AUDIT_EVENTS = 10_000
PAGE = 1_000
RATE = 200.0
PG_ENV = "FEDWEAVE_TEST_POSTGRES_URL"


@dataclass(frozen=True)
class Load:
    """What the load process measured: latencies (s) and achieved requests per second."""

    latencies: list[float]
    rate: float
    errors: int

    def p99_ms(self) -> float:
        if not self.latencies:
            return float("nan")
        q = statistics.quantiles(self.latencies, n=100, method="inclusive")
        return q[98] * 1000.0


class _Client:
    """A keep-alive HTTP/1.1 connection (``http.client``: little CPU per request, so the
    load process measures the server, not its own client library)."""

    def __init__(self, base: str, headers: dict[str, str]) -> None:
        host, _, port = base.removeprefix("http://").partition(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)
        self.headers = headers

    def get(self, path: str) -> int:
        self.conn.request("GET", path, headers=self.headers)
        r = self.conn.getresponse()
        r.read()
        return r.status

    def close(self) -> None:
        self.conn.close()


def _open_loop(
    base: str, paths: Sequence[str], headers: dict[str, str], rate: float, duration: float
) -> Load:
    """Send ``rate`` requests/s for ``duration`` s from a pool of threads; latency from
    each request's scheduled time."""
    n = int(rate * duration)
    start = time.perf_counter() + 0.2
    schedule = [start + i / rate for i in range(n)]
    lock = threading.Lock()
    nxt = [0]
    lat: list[float] = []
    errors = [0]

    def worker() -> None:
        client = _Client(base, headers)
        try:
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= n:
                    return
                due = schedule[i]
                delay = due - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                for path in paths:
                    if client.get(path) != 200:
                        with lock:
                            errors[0] += 1
                done = time.perf_counter()
                with lock:
                    lat.append(done - due)
        finally:
            client.close()

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    return Load(lat, len(lat) / elapsed, errors[0])


def _closed_loop(
    base: str, paths: Sequence[str], headers: dict[str, str], clients: int, duration: float
) -> Load:
    """``clients`` threads each sending ``paths`` in sequence, back to back."""
    stop = time.perf_counter() + duration
    lat: list[float] = []
    errors = [0]
    lock = threading.Lock()

    def worker() -> None:
        client = _Client(base, headers)
        try:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                for path in paths:
                    if client.get(path) != 200:
                        with lock:
                            errors[0] += 1
                with lock:
                    lat.append(time.perf_counter() - t0)
        finally:
            client.close()

    t_start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Load(lat, len(lat) / (time.perf_counter() - t_start), errors[0])


def _load_process(kind: str, args: tuple[Any, ...], out: Any) -> None:
    fn = _open_loop if kind == "open" else _closed_loop
    out.put(fn(*args))


def _in_second_process(kind: str, *args: Any) -> Load:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_load_process, args=(kind, args, out), daemon=True)
    proc.start()
    try:
        result: Load = out.get(timeout=600)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return result


def _seed(engine: Any) -> tuple[str, str]:
    """One run, AUDIT_EVENTS chained audit events (bulk-inserted, the head moved once),
    an admin token; returns (run id, token)."""
    with Session(engine) as s:
        run_id = uuid.uuid4().hex
        spec = {
            "task": "tabular",
            "rounds": 10,
            "participants": ["org-a", "org-b"],
            "backend": "masked",
            "threshold": 2,
            "epsilon": None,
        }
        s.add(Run(id=run_id, name="bench", spec=spec, proposed_by="bench"))
        _, token = create_token(s, "bench", Role.ADMIN)
        prev = GENESIS_HASH
        t0 = datetime(2026, 1, 1, tzinfo=UTC)
        rows = []
        for i in range(AUDIT_EVENTS):
            fields: dict[str, Any] = {
                "time": t0 + timedelta(milliseconds=i),
                "run": run_id,
                "round": i // 100,
                "stage": "ring",
                "peer": f"org-{i % 7}",
                "kind": "masked_chunk",
                "bytes": 4096 + i,
                "sha256": f"{i:064x}",
                "privacy_class": "masked",
            }
            entry = audit_entry_hash(prev, fields)
            rows.append(AuditEvent(**fields, prev_hash=prev, entry_hash=entry))
            prev = entry
        s.add_all(rows)
        head = s.get(AuditHead, 1)
        assert head is not None, "the migrated database has an audit head"
        head.entry_hash, head.length = prev, head.length + AUDIT_EVENTS
        s.add(head)
        s.commit()
    return run_id, token


@contextmanager
def _serve(url: str, data_dir: Path) -> Iterator[tuple[str, str, str]]:
    """Serve a seeded app; yields (base URL, run id, token)."""
    engine = make_engine(url)
    settings = Settings(data_dir=data_dir, database_url=url, auth_failure_limit=1_000_000)
    node = StaticNode(NodeIdentityInfo("org-a", "Org A", "0" * 64, "https://127.0.0.1:1", "b"))
    app = create_app(settings, node, engine=engine)
    run_id, token = _seed(engine)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the API server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", run_id, token
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        engine.dispose()


@contextmanager
def _postgres() -> Iterator[str | None]:
    raw = os.environ.get(PG_ENV)
    if not raw:
        yield None
        return
    url = make_url(raw)
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    admin = create_engine(url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 3})
    name = f"fedweave_bench_{uuid.uuid4().hex[:10]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError:
        admin.dispose()
        yield None
        return
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _measure(url: str, data_dir: Path, duration: float) -> dict[str, float]:
    with _serve(url, data_dir) as (base, run_id, token):
        auth = {"Authorization": f"Bearer {token}"}
        run_path = [f"/v1/runs/{run_id}"]
        pages = [f"/v1/audit/events?limit={PAGE}&offset={k * PAGE}" for k in range(10)]
        warm = _in_second_process("closed", base, run_path, auth, 2, 0.5)
        assert warm.errors == 0, "warm-up requests failed"
        health = _in_second_process("open", base, ["/healthz"], {}, RATE, duration)
        run = _in_second_process("open", base, run_path, auth, RATE, duration)
        health_max = _in_second_process("closed", base, ["/healthz"], {}, 8, duration)
        run_max = _in_second_process("closed", base, run_path, auth, 8, duration)
        page = _in_second_process("closed", base, pages[:1], auth, 4, duration)
        lists = _in_second_process("closed", base, pages, auth, 4, duration)
        for load in (health, run, health_max, run_max, page, lists):
            if load.errors:
                raise RuntimeError(f"{load.errors} requests failed during the benchmark")
        return {
            "run_p99": run.p99_ms(),
            "run_rate": run.rate,
            "health_p99": health.p99_ms(),
            "run_rps": run_max.rate,
            "health_rps": health_max.rate,
            "page_p99": page.p99_ms(),
            "list_p99": lists.p99_ms(),
            "lists_per_s": lists.rate,
        }


def _body(report: Report) -> None:
    duration = 3.0 if report.quick else 10.0
    with tempfile.TemporaryDirectory() as tmp:
        sqlite_url = f"sqlite:///{Path(tmp) / 'sqlite' / 'fedweave.db'}"
        lite = _measure(sqlite_url, Path(tmp) / "sqlite", duration)
        with _postgres() as pg_url:
            pg = _measure(pg_url, Path(tmp) / "pg", duration) if pg_url else None
    note = f"open loop {RATE:g} req/s for {duration:g}s; achieved {lite['run_rate']:.0f}"
    report.add("get_run_p99[sqlite,200rps]", lite["run_p99"], "ms", target="< 50", note=note)
    report.add("get_run_p99_vs_healthz[sqlite,200rps]", lite["run_p99"], "ms", lite["health_p99"])
    report.add(
        "get_run_rps[sqlite]", lite["run_rps"], "req/s", lite["health_rps"], note="8 clients"
    )
    report.add(
        "audit_list_10k_p99[sqlite]",
        lite["list_p99"],
        "ms",
        lite["page_p99"],
        note="10 pages of 1000; baseline one page; 4 listers",
    )
    report.add("audit_lists_per_s[sqlite]", lite["lists_per_s"], "lists/s")
    if pg is None:
        report.add("postgres", float("nan"), "-", note=f"skipped: {PG_ENV} unset or unreachable")
        return
    report.add("get_run_p99[postgres,200rps]", pg["run_p99"], "ms", lite["run_p99"])
    report.add("get_run_rps[postgres]", pg["run_rps"], "req/s", lite["run_rps"])
    report.add("audit_list_10k_p99[postgres]", pg["list_p99"], "ms", lite["list_p99"])
    report.add("audit_lists_per_s[postgres]", pg["lists_per_s"], "lists/s", lite["lists_per_s"])


def main(argv: Sequence[str] | None = None) -> Report:
    return run_main("api", _body, argv, description=__doc__ or "")


if __name__ == "__main__":
    main()
