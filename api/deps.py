"""The API's dependencies as ``Annotated`` aliases.

``SessionDep`` (a database session per request), ``ReadsDep`` (short reads for ``async``
routes, :mod:`api.reads`), ``CurrentPrincipal`` (the token's owner, or the one opaque
401), ``NodeDep`` (the running node's services), ``TrainersDep`` (its trainer
catalog), ``SettingsDep``, ``PageDep``
(offset/limit) and ``IdempotencyKeyDep``. Routes declare the roles they admit with
``dependencies=[require_roles(...)]``.

Every dependency is ``async def``, so none costs a hop to a worker thread by itself:
the token is read with :class:`api.reads.Reads`, a session is made on the event loop and
used by the (synchronous) route in its worker thread. Only the writes — a token's
``last_used_at``, once a minute — and closing a session that still holds a connection
go to a worker thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Annotated, Any

from fastapi import Depends, Header, HTTPException, Query, Request, status
from fastapi.concurrency import run_in_threadpool
from sqlalchemy import Engine
from sqlmodel import Session

from api.reads import Reads
from api.security import UNAUTHORIZED, AuthFailureLimiter, Principal, forbidden
from api.settings import Settings
from org_node.db.models import Role, utcnow
from org_node.db.repo import live_token, touch_token
from org_node.observability import Observability
from org_node.services import NodeServices
from org_node.trainers.catalog import TrainerCatalog

__all__ = [
    "CurrentPrincipal",
    "IdempotencyKeyDep",
    "NodeDep",
    "Page",
    "PageDep",
    "ReadsDep",
    "SessionDep",
    "SettingsDep",
    "TrainersDep",
    "observability_for",
    "require_roles",
]

_LAST_USED_GRANULARITY = timedelta(minutes=1)


async def get_session(request: Request) -> AsyncIterator[Session]:
    """A session for the request. Making one touches no database, so it is made on the
    event loop; closing one that still holds a connection (a read left its transaction
    open) returns that connection in a worker thread, one hop instead of two."""
    session = Session(request.app.state.engine)
    try:
        yield session
    finally:
        if session.in_transaction():
            await run_in_threadpool(session.close)
        else:
            session.close()


def _app_state(name: str) -> Callable[[Request], Awaitable[Any]]:
    """The dependency that gives ``request.app.state.<name>`` (set when the app is made)."""

    async def dependency(request: Request) -> Any:
        return getattr(request.app.state, name)

    dependency.__name__ = dependency.__qualname__ = f"get_{name}"
    return dependency


get_settings = _app_state("settings")
get_node = _app_state("node")
get_trainers = _app_state("trainers")
get_reads = _app_state("reads")


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
NodeDep = Annotated[NodeServices, Depends(get_node)]
ReadsDep = Annotated[Reads, Depends(get_reads)]
TrainersDep = Annotated[TrainerCatalog, Depends(get_trainers)]


def _client(request: Request) -> str:
    return request.client.host if request.client else "-"


def _touch(engine: Engine, token_id: int, when: datetime) -> None:
    with engine.begin() as conn:
        touch_token(conn, token_id, when)


async def get_principal(request: Request) -> Principal:
    """Authenticate the bearer token; every failure is the same 401.

    The token is read with :class:`api.reads.Reads` (no session, no ORM object); its
    ``last_used_at`` is written, in a worker thread, at most once a minute.
    """
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    row = None
    if scheme.lower() == "bearer" and presented:
        reads: Reads = request.app.state.reads
        row = await reads(partial(live_token, presented=presented.strip()))
    if row is None:
        # only failures are limited: a valid token is checked first and always admitted,
        # so a burst of bad requests from the same address cannot lock it out
        limiter: AuthFailureLimiter = request.app.state.auth_limiter
        client = _client(request)
        wait = limiter.retry_after(client)
        if wait:
            raise HTTPException(
                status_code=status.HTTP_429_TOO_MANY_REQUESTS,
                detail="too many failed authentication attempts",
                headers={"Retry-After": str(max(1, round(wait)))},
            )
        limiter.failure(client)
        raise UNAUTHORIZED
    now = utcnow()
    last = row.last_used_at
    if last is not None and last.tzinfo is None:  # SQLite returns naive UTC datetimes
        last = last.replace(tzinfo=now.tzinfo)
    if last is None or now - last > _LAST_USED_GRANULARITY:
        await run_in_threadpool(_touch, request.app.state.engine, row.id, now)
    return Principal(token_id=row.id, name=row.name, role=row.role)


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


def observability_for(request: Request) -> Observability:
    """The app's :class:`Observability`, attached to the node's round engine as soon as
    the node has one (the node creates it when it joins its federation)."""
    obs: Observability = request.app.state.observability
    rounds = getattr(request.app.state.node, "rounds", None)
    if rounds is not None and hasattr(rounds, "add_observer"):
        obs.attach(rounds)
    return obs
