"""The audit chain head: one row holding the last entry's hash and the chain length,
seeded from the entries already in the log.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

GENESIS_HASH = "0" * 64


def upgrade() -> None:
    head = op.create_table(
        "audit_head",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("entry_hash", sa.String(length=64), nullable=False),
        sa.Column("length", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    conn = op.get_bind()
    events = sa.table("audit_event", sa.column("id"), sa.column("entry_hash"))
    last = conn.execute(
        sa.select(events.c.entry_hash).order_by(events.c.id.desc()).limit(1)
    ).scalar()
    count = conn.execute(sa.select(sa.func.count()).select_from(events)).scalar() or 0
    op.bulk_insert(head, [{"id": 1, "entry_hash": last or GENESIS_HASH, "length": count}])


def downgrade() -> None:
    op.drop_table("audit_head")
