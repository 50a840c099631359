"""Alembic environment: runs the scripts in ``versions/`` on the engine handed over by
:func:`org_node.db.engine.migrate` (``config.attributes["engine"]``)."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

import org_node.db.models  # noqa: F401  (registers the tables on SQLModel.metadata)

target_metadata = SQLModel.metadata


def run_migrations_online() -> None:
    """Run every pending migration in one transaction per revision."""
    engine = context.config.attributes.get("engine")
    if engine is None:
        raise RuntimeError("migrations run through org_node.db.engine.migrate(engine)")
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            compare_type=True,
        )
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    raise RuntimeError("offline (SQL script) migrations are not supported")
run_migrations_online()
