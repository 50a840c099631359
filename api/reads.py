"""Short database reads for ``async`` routes: :class:`Reads`.

The hot read paths of the API (authenticating the bearer token, reading one run) are a
single indexed ``SELECT`` each — tens of microseconds in SQLite, far less than handing
the work to a worker thread and back. :class:`Reads` runs such a read:

* on **SQLite**, on the event loop's own thread, through one connection kept for that
  purpose (never one of the pool's, so a read never waits for a pooled connection that
  a worker thread holds). Every read ends its transaction, so it sees everything
  committed before it: there is no cache to go stale. Its busy timeout is short: a read
  that finds the database locked (rare in WAL mode, where readers do not wait for the
  writer) is retried once in a worker thread with a pooled connection, so the event
  loop is never blocked for long. When another thread's event loop is using that
  connection at the moment, the read also takes the worker-thread path.
* on **PostgreSQL** (any other database), in one worker-thread hop with a pooled
  connection: a network round trip must never block the event loop.

Writes never come here; they stay in the worker threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from fastapi.concurrency import run_in_threadpool
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import OperationalError

__all__ = ["INLINE_BUSY_TIMEOUT_MS", "Reads"]

T = TypeVar("T")

INLINE_BUSY_TIMEOUT_MS = 50
"""How long a read on the event loop's thread waits for a locked SQLite database before
it is retried in a worker thread."""


class Reads:
    """Runs ``fn(connection)`` for a short read; see the module's description."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # a SQLite file; an in-memory database is one per connection, never shared
        self.inline = engine.dialect.name == "sqlite" and engine.url.database not in (
            None,
            "",
            ":memory:",
        )
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    async def __call__(self, fn: Callable[[Connection], T]) -> T:
        if self.inline and self._lock.acquire(blocking=False):
            try:
                return self._inline(fn)
            except OperationalError:
                self._drop()  # locked (or broken): the worker-thread path below decides
            finally:
                self._lock.release()
        return await run_in_threadpool(self.pooled, fn)

    def pooled(self, fn: Callable[[Connection], T]) -> T:
        """``fn`` with a pooled connection, in the calling thread; its transaction ends."""
        with self.engine.connect() as conn:
            return fn(conn)

    def _inline(self, fn: Callable[[Connection], T]) -> T:
        conn = self._conn
        if conn is None or conn.closed or conn.invalidated:
            conn = self.engine.connect()
            conn.exec_driver_sql(f"PRAGMA busy_timeout={INLINE_BUSY_TIMEOUT_MS}")
            conn.rollback()
            self._conn = conn
        try:
            return fn(conn)
        finally:
            conn.rollback()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            # Closed, not returned to the pool: its busy timeout is not the pool's.
            conn.invalidate()
            conn.close()

    def close(self) -> None:
        """Close the event loop's connection (at shutdown)."""
        with self._lock:
            self._drop()
