"""Initial schema: tokens, datasets, policies, runs and their metrics, audit events,
idempotency records.

Revision ID: 0001
Revises: (none)
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_token",
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("api_token", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_api_token_key_id"), ["key_id"], unique=True)

    op.create_table(
        "audit_event",
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("run", sa.String(length=32), nullable=True),
        sa.Column("round", sa.Integer(), nullable=True),
        sa.Column("stage", sa.String(length=64), nullable=False),
        sa.Column("peer", sa.String(length=100), nullable=True),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=True),
        sa.Column("privacy_class", sa.String(length=32), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("prev_hash", sa.String(length=64), nullable=False),
        sa.Column("entry_hash", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("entry_hash"),
    )
    with op.batch_alter_table("audit_event", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_audit_event_kind"), ["kind"], unique=False)
        batch_op.create_index(batch_op.f("ix_audit_event_peer"), ["peer"], unique=False)
        batch_op.create_index(batch_op.f("ix_audit_event_run"), ["run"], unique=False)
        batch_op.create_index(batch_op.f("ix_audit_event_time"), ["time"], unique=False)

    op.create_table(
        "dataset",
        sa.Column("description", sa.String(length=1000), nullable=False),
        sa.Column("columns", sa.JSON(), nullable=False),
        sa.Column("row_count", sa.BigInteger(), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("path", sa.String(length=4096), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("dataset", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_dataset_name"), ["name"], unique=True)

    op.create_table(
        "idempotency_record",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("scope", sa.String(length=200), nullable=False),
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("request_hash", sa.String(length=64), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("response", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("scope", "key"),
    )
    op.create_table(
        "policy",
        sa.Column("min_participants", sa.Integer(), nullable=False),
        sa.Column("min_threshold", sa.Integer(), nullable=True),
        sa.Column("max_epsilon", sa.Float(), nullable=True),
        sa.Column("allowed_tasks", sa.JSON(), nullable=True),
        sa.Column("allowed_peers", sa.JSON(), nullable=True),
        sa.Column("required_backend", sa.String(length=16), nullable=True),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("policy", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_policy_name"), ["name"], unique=True)

    op.create_table(
        "run",
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("current_round", sa.Integer(), nullable=False),
        sa.Column("proposed_by", sa.String(length=100), nullable=False),
        sa.Column("decided_by", sa.String(length=100), nullable=True),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("decision_reason", sa.String(length=500), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("run", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_run_state"), ["state"], unique=False)

    op.create_table(
        "run_metric",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["run.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("run_metric", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_run_metric_run_id"), ["run_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("run_metric", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_run_metric_run_id"))

    op.drop_table("run_metric")
    with op.batch_alter_table("run", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_run_state"))

    op.drop_table("run")
    with op.batch_alter_table("policy", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_policy_name"))

    op.drop_table("policy")
    op.drop_table("idempotency_record")
    with op.batch_alter_table("dataset", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_dataset_name"))

    op.drop_table("dataset")
    with op.batch_alter_table("audit_event", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_audit_event_time"))
        batch_op.drop_index(batch_op.f("ix_audit_event_run"))
        batch_op.drop_index(batch_op.f("ix_audit_event_peer"))
        batch_op.drop_index(batch_op.f("ix_audit_event_kind"))

    op.drop_table("audit_event")
    with op.batch_alter_table("api_token", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_api_token_key_id"))

    op.drop_table("api_token")
