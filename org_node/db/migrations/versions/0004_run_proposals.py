"""Runs proposed once and consented to by each participant: the federation run key, the
proposing org, the signed proposal, its consent deadline and the agreed start time on
each run's row; each participant's signed consent (or decline) by run key.

A run recorded before this revision gets its run key computed from its name and spec
(the same key every org's engine already used), so every command and route finds it by
its key as well.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def _fill_run_keys() -> None:
    from org_node.run_config import run_key

    conn = op.get_bind()
    runs = sa.table(
        "run",
        sa.column("id", sa.String),
        sa.column("name", sa.String),
        sa.column("spec", sa.JSON),
        sa.column("run_key", sa.String),
    )
    for row in conn.execute(sa.select(runs.c.id, runs.c.name, runs.c.spec)).all():
        try:
            key = run_key(row.name, dict(row.spec or {}))
        except (KeyError, TypeError, ValueError):
            continue
        conn.execute(runs.update().where(runs.c.id == row.id).values(run_key=key))


def upgrade() -> None:
    op.create_table(
        "run_consent",
        sa.Column("run_key", sa.String(length=32), nullable=False),
        sa.Column("org_id", sa.String(length=100), nullable=False),
        sa.Column("decision", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.String(length=500), nullable=False),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("signature", sa.String(length=256), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("run_key", "org_id"),
    )
    with op.batch_alter_table("run", schema=None) as batch_op:
        batch_op.add_column(sa.Column("run_key", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("origin", sa.String(length=100), nullable=True))
        batch_op.add_column(sa.Column("proposal", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("consent_by", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("start_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index(batch_op.f("ix_run_run_key"), ["run_key"], unique=False)
    _fill_run_keys()


def downgrade() -> None:
    with op.batch_alter_table("run", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_run_run_key"))
        for name in ("start_at", "consent_by", "proposal", "origin", "run_key"):
            batch_op.drop_column(name)
    op.drop_table("run_consent")
