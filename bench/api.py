"""Admin API latency, throughput and server CPU, SQLite and PostgreSQL side by side.

Run::

    python -m bench.api [--quick] [--json PATH]

The API is served by uvicorn on 127.0.0.1 in this process, on a plain asyncio loop with
httptools and no access log, as ``fedweave run`` serves it. The load comes from a second
process on the same machine (``multiprocessing`` spawn, started once), over loopback:
a single-threaded client on raw keep-alive HTTP/1.1 sockets, so that it takes little of
the CPUs the server needs. Seeded with one run and 10 000 hash-chained audit events.

Rows, per database (``sqlite`` always; ``postgres`` when ``FEDWEAVE_TEST_POSTGRES_URL``
names a reachable server, on a scratch database created and dropped here):

- ``get_run_p99[DB,200rps]``: p99 latency (ms) of ``GET /v1/runs/{id}`` under an
  open-loop load of 200 requests/s over 8 connections. Latency counts from the
  request's scheduled send time, so time spent queued behind slow requests (or waiting
  for a free connection) is included: no coordinated omission. Target on SQLite:
  < 50 ms. Baseline (``..._vs_healthz``): ``GET /healthz`` (no token, no database) under
  the same load. Each figure is the median over repeats, baseline and measured run
  interleaved; the note gives the range.
- ``server_cpu_get_run[DB]``: CPU time (ms) this process (the server) spends per
  ``GET /v1/runs/{id}`` in those windows; baseline ``GET /healthz``. Much less noisy
  than latency on a shared machine.
- ``get_run_rps[DB]``: requests/s of ``GET /v1/runs/{id}`` from 8 closed-loop clients;
  baseline ``GET /healthz`` the same way.
- ``audit_list_10k_p99[DB]``: p99 latency (ms) of listing all 10 000 audit events
  (10 pages of 1 000, ``GET /v1/audit/events``) from 4 closed-loop listers; baseline
  is listing one page of 1 000.
- ``audit_lists_per_s[DB]``: full listings of 10 000 events per second, same load.
- ``server_cpu_audit_list_10k[DB]``: server CPU (ms) per full listing; baseline one page.

PostgreSQL rows carry the SQLite figure as their baseline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import selectors
import socket
import statistics
import tempfile
import threading
import time
import uuid
from collections import deque
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
from api.serve import bind
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
OPEN_CONNECTIONS = 8
PG_ENV = "FEDWEAVE_TEST_POSTGRES_URL"

Headers = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Load:
    """What the load process measured: latencies (s) of each job (one request, or a
    sequence of requests on one connection), jobs per second, failed requests, and
    the load process's own CPU seconds."""

    latencies: list[float]
    rate: float
    errors: int
    client_cpu_s: float

    def p99_ms(self) -> float:
        if not self.latencies:
            return float("nan")
        q = statistics.quantiles(self.latencies, n=100, method="inclusive")
        return q[98] * 1000.0


@dataclass(frozen=True)
class LoadSpec:
    """One load window: ``rate`` jobs/s open loop (None: closed loop, every connection
    starts its next job as soon as the last one ends) for ``duration`` s."""

    port: int
    paths: tuple[str, ...]
    headers: Headers
    connections: int
    duration: float
    rate: float | None = None


class _Conn:
    """A keep-alive HTTP/1.1 connection working through one job's requests."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.todo: deque[bytes] = deque()
        self.due = 0.0

    def start(self, requests: Sequence[bytes], due: float) -> None:
        self.todo = deque(requests)
        self.due = due
        self.sock.sendall(self.todo[0])

    def feed(self, data: bytes) -> list[int]:
        """Statuses of the responses ``data`` completes (sending the next request)."""
        self.buf += data
        done: list[int] = []
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return done
            head = bytes(self.buf[:head_end]).lower()
            at = head.find(b"\r\ncontent-length:")
            if at < 0:
                raise RuntimeError("response without Content-Length")
            stop = head.find(b"\r\n", at + 2)
            length = int(head[at + 17 : stop if stop >= 0 else len(head)])
            total = head_end + 4 + length
            if len(self.buf) < total:
                return done
            done.append(int(head[9:12]))
            del self.buf[:total]
            self.todo.popleft()
            if self.todo:
                self.sock.sendall(self.todo[0])


def _request(path: str, headers: Sequence[tuple[str, str]]) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")


def drive(spec: LoadSpec) -> Load:
    """Run one load window from this thread (one selector, no client library)."""
    cpu0 = time.process_time()
    requests = [_request(p, spec.headers) for p in spec.paths]
    conns = [_Conn(spec.port) for _ in range(spec.connections)]
    sel = selectors.DefaultSelector()
    for c in conns:
        sel.register(c.sock, selectors.EVENT_READ, c)
    idle = deque(conns)
    waiting: deque[float] = deque()  # scheduled times of jobs no connection has taken yet
    start = time.perf_counter() + 0.05
    end = start + spec.duration
    scheduled = int(spec.rate * spec.duration) if spec.rate else 0
    i = 0
    lat: list[float] = []
    errors = 0
    last = start
    progress = time.monotonic()
    try:
        while True:
            now = time.perf_counter()
            if spec.rate:
                while i < scheduled and start + i / spec.rate <= now:
                    waiting.append(start + i / spec.rate)
                    i += 1
            elif start <= now < end:
                waiting.extend(now for _ in range(len(idle) - len(waiting)))
            while waiting and idle:
                idle.popleft().start(requests, waiting.popleft())
            busy = len(conns) - len(idle)
            if spec.rate:
                if i >= scheduled and not waiting and not busy:
                    break
                timeout = max(0.0, start + i / spec.rate - now) if i < scheduled else 1.0
            else:
                if now >= end and not busy:
                    break
                timeout = max(0.0, start - now) if now < start else 1.0
            events = sel.select(min(timeout, 1.0))
            if events:
                progress = time.monotonic()
            elif time.monotonic() - progress > 30 and busy:
                raise RuntimeError("the server stopped answering")
            for key, _ in events:
                conn: _Conn = key.data
                data = conn.sock.recv(1 << 18)
                if not data:
                    raise RuntimeError("the server closed a connection")
                statuses = conn.feed(data)
                errors += sum(1 for s in statuses if s != 200)
                if statuses and not conn.todo:
                    last = time.perf_counter()
                    lat.append(last - conn.due)
                    idle.append(conn)
    finally:
        sel.close()
        for c in conns:
            c.sock.close()
    return Load(lat, len(lat) / max(last - start, 1e-9), errors, time.process_time() - cpu0)


def _load_worker(inbox: Any, outbox: Any) -> None:
    while (spec := inbox.get()) is not None:
        try:
            outbox.put(drive(spec))
        except Exception as exc:  # reported to the parent, which raises
            outbox.put(exc)


class LoadProcess:
    """The second process that generates the load; started once, reused per window."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.inbox = ctx.Queue()
        self.outbox = ctx.Queue()
        self.proc = ctx.Process(target=_load_worker, args=(self.inbox, self.outbox), daemon=True)
        self.proc.start()

    def run(self, spec: LoadSpec) -> tuple[Load, float]:
        """The load's figures and the CPU seconds this process (the server) spent."""
        cpu0 = time.process_time()
        self.inbox.put(spec)
        result = self.outbox.get(timeout=600)
        cpu = time.process_time() - cpu0
        if isinstance(result, Exception):
            raise RuntimeError(f"load generator failed: {result}")
        if result.errors:
            raise RuntimeError(f"{result.errors} requests failed during the benchmark")
        assert isinstance(result, Load)
        return result, cpu

    def close(self) -> None:
        self.inbox.put(None)
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def _seed(engine: Any) -> tuple[str, str]:
    """One run, AUDIT_EVENTS chained audit events (bulk-inserted, the head moved once),
    an admin token; returns (run id, token)."""
    with Session(engine) as s:
        run_id = uuid.uuid4().hex
        spec = {
            "trainer": "breast_cancer",
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
def _serve(url: str, data_dir: Path) -> Iterator[tuple[int, str, str]]:
    """Serve a seeded app; yields (port, run id, token)."""
    engine = make_engine(url)
    settings = Settings(data_dir=data_dir, database_url=url, auth_failure_limit=1_000_000)
    node = StaticNode(NodeIdentityInfo("org-a", "Org A", "0" * 64, "https://127.0.0.1:1", "b"))
    app = create_app(settings, node, engine=engine)
    run_id, token = _seed(engine)
    sock = bind("127.0.0.1", 0)  # as ``fedweave run`` listens (TCP_NODELAY on its connections)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, loop="asyncio", http="httptools", log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the API server did not start")
        time.sleep(0.05)
    try:
        yield port, run_id, token
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


@dataclass(frozen=True)
class Figures:
    """Medians over the repeats of one database's windows (and the p99 ranges)."""

    repeats: int
    values: dict[str, float]
    ranges: dict[str, tuple[float, float]]


def _median(name: str, xs: list[float], into: Figures) -> None:
    into.values[name] = statistics.median(xs)
    into.ranges[name] = (min(xs), max(xs))


def _measure(load: LoadProcess, url: str, data_dir: Path, quick: bool) -> Figures:
    repeats = 3 if quick else 5
    open_s, closed_s = (2.0, 1.0) if quick else (5.0, 3.0)
    out = Figures(repeats, {}, {})
    with _serve(url, data_dir) as (port, run_id, token):
        auth: Headers = (("Authorization", f"Bearer {token}"),)
        run_path = (f"/v1/runs/{run_id}",)
        pages = tuple(f"/v1/audit/events?limit={PAGE}&offset={k * PAGE}" for k in range(10))
        load.run(LoadSpec(port, run_path, auth, 2, 0.5))  # warm-up
        load.run(LoadSpec(port, pages, auth, 1, 0.5))

        def window(
            paths: tuple[str, ...], hdrs: Headers, conns: int, secs: float, rate: float | None
        ) -> tuple[Load, float]:
            return load.run(LoadSpec(port, paths, hdrs, conns, secs, rate))

        series: dict[str, list[float]] = {}

        def note(name: str, value: float) -> None:
            series.setdefault(name, []).append(value)

        for r in range(repeats):
            # baseline and measured run interleaved, their order alternating
            order: list[tuple[str, tuple[str, ...], Headers]] = [
                ("health", ("/healthz",), ()),
                ("run", run_path, auth),
            ]
            for name, paths, hdrs in order if r % 2 == 0 else order[::-1]:
                got, cpu = window(paths, hdrs, OPEN_CONNECTIONS, open_s, RATE)
                note(f"{name}_p99", got.p99_ms())
                note(f"{name}_rate", got.rate)
                note(f"{name}_cpu_ms", cpu / len(got.latencies) * 1e3)
                note(f"{name}_client_cpu_ms", got.client_cpu_s / len(got.latencies) * 1e3)
            for name, paths, hdrs in order if r % 2 == 0 else order[::-1]:
                got, _ = window(paths, hdrs, 8, closed_s, None)
                note(f"{name}_rps", got.rate)
        for r in range(max(2, repeats - 1)):
            listing: list[tuple[str, tuple[str, ...]]] = [("page", pages[:1]), ("list", pages)]
            for name, paths in listing if r % 2 == 0 else listing[::-1]:
                got, cpu = window(paths, auth, 4, 2 * closed_s, None)
                note(f"{name}_p99", got.p99_ms())
                note(f"{name}_per_s", got.rate)
                note(f"{name}_cpu_ms", cpu / len(got.latencies) * 1e3)
    for name, xs in series.items():
        _median(name, xs, out)
    return out


def _span(f: Figures, name: str) -> str:
    lo, hi = f.ranges[name]
    return f"{lo:.3g}-{hi:.3g}"


def _rows(report: Report, db: str, f: Figures, base: Figures | None, quick: bool) -> None:
    v = f.values
    b = base.values if base is not None else None
    open_s = 2 if quick else 5
    where = (
        f"{os.cpu_count()} CPUs; load from a second process on the same machine, loopback, "
        f"{OPEN_CONNECTIONS} keep-alive connections"
    )
    report.add(
        f"get_run_p99[{db},200rps]",
        v["run_p99"],
        "ms",
        b["run_p99"] if b else None,
        target="< 50" if b is None else None,
        note=f"open loop {RATE:g} req/s, median of {f.repeats} x {open_s}s "
        f"(range {_span(f, 'run_p99')}); achieved {v['run_rate']:.0f} req/s; {where}",
    )
    if b is None:
        report.add(
            f"get_run_p99_vs_healthz[{db},200rps]",
            v["run_p99"],
            "ms",
            v["health_p99"],
            note=f"healthz range {_span(f, 'health_p99')}",
        )
    report.add(
        f"server_cpu_get_run[{db}]",
        v["run_cpu_ms"],
        "ms/req",
        b["run_cpu_ms"] if b else v["health_cpu_ms"],
        note=f"API server process CPU per request at {RATE:g} req/s"
        + ("; baseline GET /healthz" if b is None else "; the PostgreSQL server's own not counted")
        + f"; load process {v['run_client_cpu_ms']:.3f} ms/req",
    )
    report.add(
        f"get_run_rps[{db}]",
        v["run_rps"],
        "req/s",
        b["run_rps"] if b else v["health_rps"],
        note="8 closed-loop clients" + ("" if b else "; baseline GET /healthz"),
    )
    report.add(
        f"audit_list_10k_p99[{db}]",
        v["list_p99"],
        "ms",
        b["list_p99"] if b else v["page_p99"],
        note="10 pages of 1000, 4 listers" + ("" if b else "; baseline one page"),
    )
    report.add(
        f"audit_lists_per_s[{db}]", v["list_per_s"], "lists/s", b["list_per_s"] if b else None
    )
    report.add(
        f"server_cpu_audit_list_10k[{db}]",
        v["list_cpu_ms"],
        "ms/list",
        b["list_cpu_ms"] if b else v["page_cpu_ms"],
        note="API server process CPU per listing of 10 000"
        + ("; baseline one page" if b is None else "; the PostgreSQL server's own not counted"),
    )


def _body(report: Report) -> None:
    load = LoadProcess()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            sqlite_url = f"sqlite:///{Path(tmp) / 'sqlite' / 'fedweave.db'}"
            lite = _measure(load, sqlite_url, Path(tmp) / "sqlite", report.quick)
            with _postgres() as pg_url:
                pg = _measure(load, pg_url, Path(tmp) / "pg", report.quick) if pg_url else None
    finally:
        load.close()
    _rows(report, "sqlite", lite, None, report.quick)
    if pg is None:
        report.add("postgres", float("nan"), "-", note=f"skipped: {PG_ENV} unset or unreachable")
        return
    _rows(report, "postgres", pg, lite, report.quick)


def main(argv: Sequence[str] | None = None) -> Report:
    return run_main("api", _body, argv, description=__doc__ or "")


if __name__ == "__main__":
    main()
