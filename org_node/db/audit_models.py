"""The hash-chained audit log's tables and the idempotency records (SQLModel), in the
families of :mod:`org_node.db.models`, which re-exports them.

Audit events (:class:`AuditEvent`) are hash-chained: ``entry_hash`` is the SHA-256 of
``prev_hash`` and the event's canonical JSON (see :mod:`org_node.db.repo`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, UniqueConstraint
from sqlmodel import Field, SQLModel

from org_node.db.columns import UTCDateTime
from org_node.db.columns import timestamp as _ts

__all__ = [
    "AuditEvent",
    "AuditEventBase",
    "AuditEventPublic",
    "AuditEventsPublic",
    "AuditHead",
    "IdempotencyRecord",
]


# --- audit ----------------------------------------------------------------------------


class AuditEventBase(SQLModel):
    time: datetime = Field(sa_type=UTCDateTime, index=True)
    run: str | None = Field(default=None, max_length=32, index=True)
    round: int | None = Field(default=None, ge=0)
    stage: str = Field(max_length=64)
    peer: str | None = Field(default=None, max_length=100, index=True)
    kind: str = Field(max_length=64, index=True)
    bytes: int = Field(default=0, ge=0, le=2**62, sa_type=BigInteger)
    sha256: str | None = Field(default=None, max_length=64)
    privacy_class: str = Field(max_length=32)


class AuditEvent(AuditEventBase, table=True):
    """One entry of the hash-chained audit log."""

    __tablename__ = "audit_event"
    id: int | None = Field(default=None, primary_key=True)
    prev_hash: str = Field(max_length=64)
    entry_hash: str = Field(max_length=64, unique=True)


class AuditEventPublic(AuditEventBase):
    id: int
    prev_hash: str
    entry_hash: str


class AuditEventsPublic(SQLModel):
    data: list[AuditEventPublic]
    count: int


class AuditHead(SQLModel, table=True):
    """The chain head: the last entry's hash and the chain length, in one row (id 1).

    Appending updates it in the same transaction as the new entry, with a row lock
    (PostgreSQL) or the database write lock (SQLite), so concurrent appends are
    serialized and the chain never forks.
    """

    __tablename__ = "audit_head"
    id: int = Field(default=1, primary_key=True)
    entry_hash: str = Field(max_length=64)
    length: int = Field(default=0, sa_type=BigInteger)


# --- idempotency ----------------------------------------------------------------------


class IdempotencyRecord(SQLModel, table=True):
    """The answer to a creation request, kept so that a retried request gets it again."""

    __tablename__ = "idempotency_record"
    __table_args__ = (UniqueConstraint("scope", "key"),)
    id: int | None = Field(default=None, primary_key=True)
    scope: str = Field(max_length=200)
    key: str = Field(max_length=200)
    request_hash: str = Field(max_length=64)
    status_code: int
    response: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    created_at: datetime = _ts()
