"""Repository helpers: tokens, versioned updates, the audit chain, first-run set-up.

Tokens are ``fw_<key id>_<secret>``: the key id (12 hex digits) finds the row, and the
SHA-256 of the whole token is compared in constant time with the stored hash. A token
that names no row is compared against a dummy hash, so that an unknown key id and a
wrong secret cost the same work (:func:`find_token`; :func:`live_token` is the same check
on a plain connection, for the API's per-request path).

Versioned rows (datasets, policies, runs) are changed by one conditional
``UPDATE ... WHERE id = :id AND version = :expected``: of two concurrent writers naming
the same version exactly one succeeds (:func:`update_versioned`).

Audit entries are chained: ``entry_hash = SHA-256(prev_hash || canonical JSON of the
event's fields)`` with ``prev_hash`` of the first entry 64 zeros (:func:`audit_entry_hash`).
The head of the chain lives in the one-row ``audit_head`` table; an append reads it
``FOR UPDATE`` and moves it with a compare-and-set in the caller's transaction, so
concurrent appends (threads or processes) serialize on the database and the chain never
forks; the entry commits or rolls back with whatever it records. Signing of chain heads
belongs to the audit log, not to this module.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Connection, Engine, bindparam, func, update
from sqlalchemy import select as sa_select
from sqlmodel import Session, SQLModel, select

from org_node.db.engine import migrate
from org_node.db.models import ApiToken, AuditEvent, AuditHead, Role, utcnow

__all__ = [
    "GENESIS_HASH",
    "TOKEN_PATTERN",
    "AuditChainError",
    "LiveToken",
    "append_audit_event",
    "audit_entry_hash",
    "create_token",
    "find_token",
    "hash_token",
    "init_database",
    "live_token",
    "touch_token",
    "update_versioned",
]

GENESIS_HASH = "0" * 64
TOKEN_PATTERN = re.compile(r"fw_([0-9a-f]{12})_[A-Za-z0-9_-]{43}")
_DUMMY_HASH = hashlib.sha256(b"fedweave/no-such-token").hexdigest()

RandBytes = Callable[[int], bytes]


class AuditChainError(Exception):
    """The audit chain cannot be extended (no head row, or a head that keeps moving)."""


def hash_token(token: str) -> str:
    """SHA-256 of the token, hex; what the database stores."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def create_token(
    session: Session, name: str, role: Role, *, randbytes: RandBytes = secrets.token_bytes
) -> tuple[ApiToken, str]:
    """Add a token row (flushed, not committed); returns it and the secret to show once."""
    key_id = randbytes(6).hex()
    secret = _b64(randbytes(32))
    token = f"fw_{key_id}_{secret}"
    row = ApiToken(name=name, role=Role(role).value, key_id=key_id, token_hash=hash_token(token))
    session.add(row)
    session.flush()
    return row, token


def _b64(raw: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def find_token(session: Session, presented: str) -> ApiToken | None:
    """The live (not revoked) token row matching ``presented``, or None.

    Does the same hashing and one constant-time comparison whether or not the key id
    exists, so that response time does not tell a valid key id from an invalid one.
    """
    match = TOKEN_PATTERN.fullmatch(presented)
    key_id = match.group(1) if match else "-"
    row = session.exec(select(ApiToken).where(ApiToken.key_id == key_id)).first()
    expected = row.token_hash if row is not None else _DUMMY_HASH
    ok = hmac.compare_digest(hash_token(presented), expected)
    if not ok or row is None or row.revoked_at is not None:
        return None
    return row


@dataclass(frozen=True, slots=True)
class LiveToken:
    """What authenticating a request needs of a live token row (no hash, no ORM object)."""

    id: int
    name: str
    role: Role
    last_used_at: datetime | None


_TOKEN = ApiToken.__table__  # type: ignore[attr-defined]
_LIVE_TOKEN_BY_KEY = sa_select(
    _TOKEN.c.id,
    _TOKEN.c.name,
    _TOKEN.c.role,
    _TOKEN.c.token_hash,
    _TOKEN.c.revoked_at,
    _TOKEN.c.last_used_at,
).where(_TOKEN.c.key_id == bindparam("key_id"))


def live_token(conn: Connection, presented: str) -> LiveToken | None:
    """:func:`find_token` on a plain connection, for the per-request hot path: one Core
    ``SELECT`` by key id, the same hashing and constant-time comparison whether or not
    the key id exists, and the few fields a request needs."""
    match = TOKEN_PATTERN.fullmatch(presented)
    key_id = match.group(1) if match else "-"
    row = conn.execute(_LIVE_TOKEN_BY_KEY, {"key_id": key_id}).first()
    expected = row.token_hash if row is not None else _DUMMY_HASH
    ok = hmac.compare_digest(hash_token(presented), expected)
    if not ok or row is None or row.revoked_at is not None:
        return None
    return LiveToken(id=row.id, name=row.name, role=Role(row.role), last_used_at=row.last_used_at)


def touch_token(conn: Connection, token_id: int, when: datetime) -> None:
    """Record ``when`` as the token's last use (the caller commits)."""
    conn.execute(update(_TOKEN).where(_TOKEN.c.id == token_id).values(last_used_at=when))


def update_versioned(
    session: Session,
    model: type[SQLModel],
    key: Any,
    expected_version: int,
    values: Mapping[str, Any],
    *,
    where: Mapping[str, Any] | None = None,
) -> bool:
    """Apply ``values`` and bump ``version`` iff the row still has ``expected_version``.

    ``where`` adds further equality conditions (e.g. the run state the change assumes).
    Returns False when another writer got there first; nothing is changed then.
    """
    table = model.__table__  # type: ignore[attr-defined]
    stmt = (
        update(table)
        .where(table.c.id == key, table.c.version == expected_version)
        .values(**values, version=expected_version + 1)
    )
    for column, value in (where or {}).items():
        stmt = stmt.where(table.c[column] == value)
    result = session.execute(stmt)
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def _jsonable(value: Any) -> Any:
    """Datetimes as UTC ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` (naive ones are taken as UTC, as
    SQLite returns them), so that a hash recomputes from what any database reads back."""
    if isinstance(value, datetime):
        if value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
        return value.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return value


AUDIT_FIELDS = (
    "time",
    "run",
    "round",
    "stage",
    "peer",
    "kind",
    "bytes",
    "sha256",
    "privacy_class",
)


def audit_entry_hash(prev_hash: str, fields: Mapping[str, Any]) -> str:
    """``SHA-256(prev_hash || canonical JSON of the AUDIT_FIELDS of fields)``, hex."""
    body = {k: _jsonable(fields.get(k)) for k in AUDIT_FIELDS}
    data = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(prev_hash.encode("ascii") + data.encode("utf-8")).hexdigest()


def append_audit_event(
    session: Session,
    *,
    stage: str,
    kind: str,
    privacy_class: str,
    run: str | None = None,
    round: int | None = None,
    peer: str | None = None,
    bytes: int = 0,
    sha256: str | None = None,
    time: datetime | None = None,
) -> AuditEvent:
    """Append one chained event (flushed; committed with the caller's transaction)."""
    fields: dict[str, Any] = {
        "time": time or utcnow(),
        "run": run,
        "round": round,
        "stage": stage,
        "peer": peer,
        "kind": kind,
        "bytes": bytes,
        "sha256": sha256,
        "privacy_class": privacy_class,
    }
    head = AuditHead.__table__  # type: ignore[attr-defined]
    for _ in range(3):
        row = session.execute(
            select(head.c.entry_hash).where(head.c.id == 1).with_for_update()
        ).first()
        if row is None:
            raise AuditChainError("the audit head row is missing: migrate the database")
        prev: str = row[0]
        entry = audit_entry_hash(prev, fields)
        moved = session.execute(
            update(head)
            .where(head.c.id == 1, head.c.entry_hash == prev)
            .values(entry_hash=entry, length=head.c.length + 1)
        )
        # 0 rows: an append committed between our read and our write (SQLite reads
        # before a transaction's first write are not isolated); read the head again,
        # now inside our write transaction.
        if moved.rowcount == 1:  # type: ignore[attr-defined]
            event = AuditEvent(**fields, prev_hash=prev, entry_hash=entry)
            session.add(event)
            session.flush()
            return event
    raise AuditChainError("the audit head kept moving; append abandoned")


def init_database(engine: Engine, *, randbytes: RandBytes = secrets.token_bytes) -> str | None:
    """Migrate the schema; create the first admin token if the node has no token yet.

    Returns that token's secret (to be shown once), or None when tokens already exist.
    This is what ``fedweave init`` runs.
    """
    migrate(engine)
    with Session(engine) as session:
        count = session.exec(select(func.count()).select_from(ApiToken)).one()
        if count:
            return None
        _, secret = create_token(session, "initial-admin", Role.ADMIN, randbytes=randbytes)
        append_audit_event(session, stage="admin", kind="token.create", privacy_class="internal")
        session.commit()
        return secret
