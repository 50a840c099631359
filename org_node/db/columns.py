"""Column types shared by the node's tables (:mod:`org_node.db.models` and
:mod:`org_node.db.audit_models`): timestamps stored in UTC and read back
timezone-aware. Both table modules import this one, neither the other's internals.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import DateTime, Dialect
from sqlalchemy.types import TypeDecorator
from sqlmodel import Field

__all__ = ["UTCDateTime", "timestamp", "utcnow"]


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored in UTC and always read back timezone-aware.

    PostgreSQL keeps ``timestamptz``; SQLite has no time zones, so the UTC wall time is
    stored and UTC is attached again on reading. Naive datetimes are refused on writing.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("timestamps must be timezone-aware")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def timestamp() -> Any:
    """A column stamped with the time the row is made (:func:`utcnow`), in UTC."""
    return Field(default_factory=utcnow, sa_type=UTCDateTime)
