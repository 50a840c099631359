"""The node's persistence: SQLModel tables, the engine, Alembic migrations, repositories.

SQLite in the node's data directory by default; PostgreSQL when
``FEDWEAVE_DATABASE_URL`` names one. :func:`~org_node.db.engine.migrate` brings any
database to the current schema and keeps its data.
"""

from org_node.db.engine import (
    DatabaseError,
    default_database_url,
    make_engine,
    migrate,
)

__all__ = ["DatabaseError", "default_database_url", "make_engine", "migrate"]
