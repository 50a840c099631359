"""The node's persistence: SQLModel tables, the engine, Alembic migrations, repositories.

SQLite in the node's data directory by default; PostgreSQL when
``FEDWEAVE_DATABASE_URL`` names one. :func:`~org_node.db.engine.migrate` brings any
database to the current schema and keeps its data.

The tables are in ``models`` and ``audit_models`` (which ``models`` re-exports), over
the column types of ``columns``; ``repo`` holds the repositories. It imports
SQLModel/SQLAlchemy, Alembic and the rest of ``org_node`` (run states, policies,
dataset specs), never ``api``.
"""

from org_node.db.engine import (
    DatabaseError,
    default_database_url,
    make_engine,
    migrate,
)

__all__ = ["DatabaseError", "default_database_url", "make_engine", "migrate"]
