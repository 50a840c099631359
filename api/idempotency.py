"""Idempotency keys on creation requests.

A client that sends ``Idempotency-Key: K`` with a creation may retry it safely: the
first request's answer is stored with the created row, in the same transaction, under
``(route, token, K)``; a retry with the same body gets that answer again (same status,
same body), a retry with a different body gets 422. Without the header nothing is stored.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from fastapi import HTTPException, status
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from sqlmodel import Session, select

from api.security import Principal
from org_node.db.models import IdempotencyRecord

__all__ = ["remember", "replay", "request_hash", "scope_of"]


def scope_of(route: str, principal: Principal) -> str:
    """Keys are scoped to the route and the calling token."""
    return f"{route}#{principal.token_id}"


def request_hash(body: BaseModel) -> str:
    """SHA-256 of the request's canonical JSON."""
    data = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(data.encode("utf-8")).hexdigest()


def replay(session: Session, scope: str, key: str | None, body: BaseModel) -> JSONResponse | None:
    """The stored answer to an earlier request with ``key``; None if there is none."""
    if key is None:
        return None
    record = session.exec(
        select(IdempotencyRecord).where(
            IdempotencyRecord.scope == scope, IdempotencyRecord.key == key
        )
    ).first()
    if record is None:
        return None
    if record.request_hash != request_hash(body):
        raise HTTPException(
            status_code=status.HTTP_422_UNPROCESSABLE_CONTENT,
            detail="Idempotency-Key was already used with a different request body",
        )
    return JSONResponse(status_code=record.status_code, content=record.response)


def remember(
    session: Session,
    scope: str,
    key: str | None,
    body: BaseModel,
    status_code: int,
    response: dict[str, Any],
) -> None:
    """Store the answer (added to the session; the caller's commit makes it durable)."""
    if key is None:
        return
    session.add(
        IdempotencyRecord(
            scope=scope,
            key=key,
            request_hash=request_hash(body),
            status_code=status_code,
            response=response,
        )
    )
