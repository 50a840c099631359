"""The database engine from a URL, and schema migrations (Alembic).

``sqlite:///PATH`` (the default, a file in the node's data directory) or
``postgresql+psycopg://user:pass@host/db``. SQLite connections enable foreign keys,
write-ahead logging and a busy timeout so that the API's worker threads wait for the
writer instead of failing. :func:`migrate` runs the Alembic scripts shipped in
``org_node/db/migrations`` up to ``head``: an empty database gets the whole schema, an
older one is upgraded in place with its data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

__all__ = [
    "DB_FILENAME",
    "DatabaseError",
    "current_revision",
    "default_database_url",
    "downgrade",
    "head_revision",
    "make_engine",
    "migrate",
]

DB_FILENAME = "fedweave.db"
MIGRATIONS = Path(__file__).resolve().parent / "migrations"


class DatabaseError(Exception):
    """A database URL that cannot be used, or a schema that cannot be migrated."""


def default_database_url(data_dir: Path) -> str:
    """``sqlite:///DATA_DIR/fedweave.db``."""
    return f"sqlite:///{(Path(data_dir) / DB_FILENAME).resolve()}"


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.close()


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """An engine for ``url`` (SQLite or PostgreSQL); :class:`DatabaseError` otherwise."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise DatabaseError("unreadable database URL") from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if parsed.database not in (None, "", ":memory:"):
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            parsed, echo=echo, connect_args={"check_same_thread": False, "timeout": 10}
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if backend == "postgresql":
        if parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")
        return create_engine(parsed, echo=echo, pool_pre_ping=True, pool_size=10, max_overflow=20)
    raise DatabaseError(f"unsupported database {backend!r}: use sqlite or postgresql")


def _config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.attributes["engine"] = engine
    return cfg


def head_revision() -> str:
    """The newest revision the shipped migrations define."""
    script = ScriptDirectory(str(MIGRATIONS))
    head = script.get_current_head()
    if head is None:
        raise DatabaseError("no migrations found")
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at; None for a database never migrated."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def migrate(engine: Engine, revision: str = "head") -> None:
    """Upgrade the schema of ``engine``'s database to ``revision`` (default the newest)."""
    command.upgrade(_config(engine), revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Downgrade the schema to ``revision`` (``base`` drops every table)."""
    command.downgrade(_config(engine), revision)
