"""The API's dependencies as ``Annotated`` aliases.

``SessionDep`` (a database session per request), ``CurrentPrincipal`` (the token's
owner, or the one opaque 401), ``NodeDep`` (the running node's services),
``SettingsDep``, ``PageDep`` (offset/limit) and ``IdempotencyKeyDep``. Routes declare the
roles they admit with ``dependencies=[require_roles(...)]``.

Dependencies that never block are ``async def`` so that they run on the event loop;
only those that touch the database run in the worker threads (one hop each).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Any

from fastapi import Depends, Header, HTTPException, Query, Request, status
from sqlmodel import Session

from api.security import UNAUTHORIZED, AuthFailureLimiter, Principal, forbidden
from api.settings import Settings
from org_node.db.models import Role, utcnow
from org_node.db.repo import find_token
from org_node.services import NodeServices

__all__ = [
    "CurrentPrincipal",
    "IdempotencyKeyDep",
    "NodeDep",
    "Page",
    "PageDep",
    "SessionDep",
    "SettingsDep",
    "require_roles",
]

_LAST_USED_GRANULARITY = timedelta(minutes=1)


def get_session(request: Request) -> Iterator[Session]:
    with Session(request.app.state.engine) as session:
        yield session


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_node(request: Request) -> NodeServices:
    node: NodeServices = request.app.state.node
    return node


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
NodeDep = Annotated[NodeServices, Depends(get_node)]


def _client(request: Request) -> str:
    return request.client.host if request.client else "-"


def get_principal(request: Request, session: SessionDep) -> Principal:
    """Authenticate the bearer token; every failure is the same 401."""
    limiter: AuthFailureLimiter = request.app.state.auth_limiter
    client = _client(request)
    wait = limiter.retry_after(client)
    if wait:
        raise HTTPException(
            status_code=status.HTTP_429_TOO_MANY_REQUESTS,
            detail="too many failed authentication attempts",
            headers={"Retry-After": str(max(1, round(wait)))},
        )
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    row = None
    if scheme.lower() == "bearer" and presented:
        row = find_token(session, presented.strip())
    if row is None or row.id is None:
        limiter.failure(client)
        raise UNAUTHORIZED
    now = utcnow()
    last = row.last_used_at
    if last is not None and last.tzinfo is None:  # SQLite returns naive UTC datetimes
        last = last.replace(tzinfo=now.tzinfo)
    if last is None or now - last > _LAST_USED_GRANULARITY:
        row.last_used_at = now
        session.add(row)
        session.commit()
    return Principal(token_id=row.id, name=row.name, role=Role(row.role))


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]


def require_roles(*roles: Role) -> Any:
    """A route dependency admitting only ``roles`` (403 for a valid token of another)."""
    admitted = frozenset(roles)

    async def check(principal: CurrentPrincipal) -> Principal:
        if principal.role not in admitted:
            raise forbidden(principal.role)
        return principal

    check.admitted = admitted  # type: ignore[attr-defined]
    return Depends(check)


@dataclass(frozen=True)
class Page:
    offset: int
    limit: int


async def get_page(
    request: Request,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Page:
    settings: Settings = request.app.state.settings
    return Page(offset=offset, limit=min(limit, settings.max_page_size))


PageDep = Annotated[Page, Depends(get_page)]


async def get_idempotency_key(
    idempotency_key: Annotated[
        str | None,
        Header(
            min_length=1,
            max_length=200,
            pattern=r"^[\x21-\x7e]+$",
            description="Makes a creation safe to retry: the same key and body get the "
            "same answer, a different body with the same key gets 422.",
        ),
    ] = None,
) -> str | None:
    return idempotency_key


IdempotencyKeyDep = Annotated[str | None, Depends(get_idempotency_key)]
