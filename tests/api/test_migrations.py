"""Alembic migrations: an empty database reaches the models' schema exactly, an upgrade
keeps the data, a downgrade to base removes every table."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect, text
from sqlmodel import Session, SQLModel, select

from org_node.db.engine import (
    DatabaseError,
    current_revision,
    downgrade,
    head_revision,
    make_engine,
    migrate,
)
from org_node.db.models import AuditEvent, AuditHead, PolicyRecord, Role, Run
from org_node.db.repo import (
    GENESIS_HASH,
    append_audit_event,
    audit_entry_hash,
    create_token,
    find_token,
)


def schema_drift(engine: Engine) -> list[object]:
    """Differences between the migrated database and the SQLModel tables."""
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return list(compare_metadata(ctx, SQLModel.metadata))


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    e = make_engine(f"sqlite:///{tmp_path / 'sub' / 'm.db'}")
    yield e
    e.dispose()


def test_empty_database_reaches_the_models_schema(engine: Engine) -> None:
    assert current_revision(engine) is None
    migrate(engine)
    assert current_revision(engine) == head_revision()
    assert schema_drift(engine) == []
    tables = set(inspect(engine).get_table_names())
    assert set(SQLModel.metadata.tables) <= tables


def _insert_0001_rows(engine: Engine) -> None:
    """A policy and a run as revision 0001 stored them (a task, not a trainer)."""
    now = datetime(2026, 1, 1, tzinfo=UTC)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO policy (name, enabled, min_participants, max_epsilon, "
                "allowed_tasks, version, created_at, updated_at) "
                "VALUES ('p', 1, 2, 2.5, :tasks, 1, :now, :now)"
            ),
            {"tasks": json.dumps(["tabular", "digits"]), "now": now},
        )
        spec = {"task": "tabular", "rounds": 2, "participants": ["a", "b"], "backend": "masked"}
        conn.execute(
            text(
                "INSERT INTO run (id, name, spec, state, version, current_round, proposed_by, "
                "created_at, updated_at) VALUES ('r1', 'old', :spec, 'proposed', 1, 0, 'x', "
                ":now, :now)"
            ),
            {"spec": json.dumps(spec), "now": now},
        )


def test_upgrade_keeps_data_and_is_idempotent(engine: Engine) -> None:
    migrate(engine, "0001")
    with Session(engine) as s:
        _, secret = create_token(s, "keep", Role.ADMIN)
        s.commit()
    _insert_0001_rows(engine)
    migrate(engine)
    migrate(engine)
    with Session(engine) as s:
        assert find_token(s, secret) is not None
        policy = s.exec(select(PolicyRecord)).one()
        assert policy.max_epsilon == 2.5
        assert policy.allowed_trainers == ["breast_cancer", "digits"]
        run = s.exec(select(Run)).one()
        assert "task" not in run.spec and run.spec["trainer"] == "breast_cancer"
        assert run.trainer_hash is None and run.state_reason is None


def test_upgrade_seeds_the_audit_head_from_existing_entries(engine: Engine) -> None:
    migrate(engine, "0001")
    prev = GENESIS_HASH
    with engine.begin() as conn:
        for i in range(3):
            fields = {
                "time": datetime(2026, 1, 1, 0, 0, i, tzinfo=UTC),
                "stage": "ring",
                "kind": "chunk",
                "bytes": i,
                "privacy_class": "masked",
            }
            entry = audit_entry_hash(prev, fields)
            conn.execute(
                AuditEvent.__table__.insert().values(  # type: ignore[attr-defined]
                    **fields, prev_hash=prev, entry_hash=entry
                )
            )
            prev = entry
    migrate(engine)
    with Session(engine) as s:
        head = s.get(AuditHead, 1)
        assert head is not None and (head.entry_hash, head.length) == (prev, 3)
        event = append_audit_event(s, stage="admin", kind="after", privacy_class="internal")
        s.commit()
        assert event.prev_hash == prev


def test_downgrade_to_base_removes_the_tables(engine: Engine) -> None:
    migrate(engine)
    downgrade(engine, "base")
    assert current_revision(engine) is None
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}


def test_bad_urls_are_refused() -> None:
    with pytest.raises(DatabaseError, match="unreadable"):
        make_engine("not a url")
    with pytest.raises(DatabaseError, match="unsupported"):
        make_engine("mysql://u@h/db")
