"""Installed trainers; what a run binds at consent (trainer hash, dataset); a run's state
reason; a dataset's kind; policies name trainers, not tasks.

Run specs stored before this revision named a ``task``; they now name a ``trainer``
(the old bundled ``tabular`` task, the breast-cancer MLP, is the ``breast_cancer``
trainer). A ``module:callable`` task cannot be named by a run any more: its name is
kept with the characters a trainer name cannot hold replaced, so that no installed
trainer matches it and the run cannot start.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import re
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_RENAMED = {"tabular": "breast_cancer"}


def _trainer_name(task: Any) -> str:
    name = _RENAMED.get(str(task), str(task))
    name = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:100]
    return name if name and name[0].isalnum() else f"t{name}"[:100]


def _specs_to_trainers() -> None:
    conn = op.get_bind()
    runs = sa.table("run", sa.column("id", sa.String), sa.column("spec", sa.JSON))
    for row in conn.execute(sa.select(runs.c.id, runs.c.spec)).all():
        spec = dict(row.spec or {})
        if "task" not in spec:
            continue
        spec["trainer"] = _trainer_name(spec.pop("task"))
        conn.execute(runs.update().where(runs.c.id == row.id).values(spec=spec))
    policies = sa.table(
        "policy", sa.column("id", sa.Integer), sa.column("allowed_trainers", sa.JSON)
    )
    for row in conn.execute(sa.select(policies.c.id, policies.c.allowed_trainers)).all():
        if row.allowed_trainers:
            names = [_trainer_name(t) for t in row.allowed_trainers]
            conn.execute(
                policies.update().where(policies.c.id == row.id).values(allowed_trainers=names)
            )


def upgrade() -> None:
    op.create_table(
        "trainer",
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("ref", sa.String(length=4096), nullable=False),
        sa.Column("description", sa.String(length=1000), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("installed_by", sa.String(length=100), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("trainer", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_trainer_name"), ["name"], unique=True)
    with op.batch_alter_table("dataset", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("kind", sa.String(length=16), nullable=False, server_default="table")
        )
    with op.batch_alter_table("run", schema=None) as batch_op:
        batch_op.add_column(sa.Column("state_reason", sa.String(length=2000), nullable=True))
        batch_op.add_column(sa.Column("trainer_hash", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("dataset_id", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("dataset_name", sa.String(length=100), nullable=True))
        batch_op.add_column(sa.Column("dataset_hash", sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column("dataset_rows", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("policy", schema=None) as batch_op:
        batch_op.alter_column("allowed_tasks", new_column_name="allowed_trainers")
    _specs_to_trainers()


def downgrade() -> None:
    with op.batch_alter_table("policy", schema=None) as batch_op:
        batch_op.alter_column("allowed_trainers", new_column_name="allowed_tasks")
    with op.batch_alter_table("run", schema=None) as batch_op:
        for name in (
            "dataset_rows",
            "dataset_hash",
            "dataset_name",
            "dataset_id",
            "trainer_hash",
            "state_reason",
        ):
            batch_op.drop_column(name)
    with op.batch_alter_table("dataset", schema=None) as batch_op:
        batch_op.drop_column("kind")
    with op.batch_alter_table("trainer", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_trainer_name"))
    op.drop_table("trainer")
