"""The admin API's app factory: ``create_app(settings, node)``.

One FastAPI app with a router per resource (:mod:`api.routers`), the database engine
from the settings, the node's services, the failed-authentication limiter, the body
size limit, the refusal of non-finite JSON numbers (422), and CORS only when origins are
configured. Errors are JSON
``{"detail": message}``; an unexpected exception is logged without request data and
answered with an opaque 500.
"""

from __future__ import annotations

import errno
import logging
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from sqlalchemy import Engine
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import dashboard
from api.jsonbody import FiniteJsonBodies
from api.reads import Reads
from api.routers import audit, checkpoints, datasets, federation, peers, policies, runs, tokens
from api.routers import node as node_routes
from api.routers import trainers as trainers_routes
from api.security import AuthFailureLimiter, BodySizeLimit
from api.settings import Settings
from org_node import __version__
from org_node.db.engine import make_engine, migrate
from org_node.observability import Observability
from org_node.services import NodeServices
from org_node.trainers.catalog import TrainerCatalog

__all__ = ["ROUTERS", "RequestCounter", "create_app"]

logger = logging.getLogger(__name__)

ROUTERS: tuple[APIRouter, ...] = tuple(
    module.router
    for module in (
        node_routes,
        tokens,
        trainers_routes,
        datasets,
        policies,
        runs,
        federation,
        peers,
        checkpoints,
        audit,
        dashboard,
    )
)
"""Every router of the admin API, in inclusion order."""


class RequestCounter:
    """ASGI middleware counting answered requests by status class (``2xx``, ``4xx`` …)
    for ``/metrics``; pure ASGI, so it adds no task or stream per request."""

    def __init__(self, app: ASGIApp, counts: Counter[str]) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counts[f"{message['status'] // 100}xx"] += 1
            await send(message)

        await self.app(scope, receive, counting)


def create_app(
    settings: Settings,
    node: NodeServices,
    *,
    engine: Engine | None = None,
    limiter: AuthFailureLimiter | None = None,
    run_migrations: bool = True,
    observability: Observability | None = None,
    trainers: TrainerCatalog | None = None,
) -> FastAPI:
    """Build the admin API.

    settings: the node's settings (database URL, limits, CORS, dataset roots).
    node: the running node's services; tests pass a fake.
    engine: an engine to use instead of one made from ``settings``.
    limiter: the failed-authentication limiter (tests pass one with a fake clock).
    run_migrations: bring the schema to the newest version at start-up.
    observability: the node's metrics, fault scores and round timeline (the dashboard
        and ``/metrics`` read it); by default the node's own ``observability`` if it
        has one, else a new one, attached to the node's round engine when it has one.
    trainers: the org's trainer catalog; by default the node's own ``catalog`` if it has
        one, else one holding the bundled trainers only.
    """
    engine = engine or make_engine(settings.resolved_database_url)
    if run_migrations:
        migrate(engine)

    reads = Reads(engine)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        reads.close()
        engine.dispose()

    app = FastAPI(
        title="fedweave org admin API",
        version=__version__,
        description="Administer one org node: tokens, datasets, policies, runs, "
        "federation membership, checkpoints and the audit log.",
        lifespan=lifespan,
    )
    _attach_state(app, settings, node, engine, reads, limiter, observability, trainers)
    for router in ROUTERS:
        app.include_router(router)
    app.include_router(dashboard.page_router)
    app.add_exception_handler(Exception, _unexpected)
    _add_middleware(app, settings)
    return app


def _attach_state(
    app: FastAPI,
    settings: Settings,
    node: NodeServices,
    engine: Engine,
    reads: Reads,
    limiter: AuthFailureLimiter | None,
    observability: Observability | None,
    trainers: TrainerCatalog | None,
) -> None:
    """What the routers read from ``app.state``: settings, database, the node and its
    trainer catalog, the failed-authentication limiter and the observability."""
    app.state.settings = settings
    app.state.engine = engine
    app.state.reads = reads
    app.state.node = node
    catalog = trainers or getattr(node, "catalog", None)
    app.state.trainers = catalog if isinstance(catalog, TrainerCatalog) else TrainerCatalog()
    app.state.auth_limiter = limiter or AuthFailureLimiter(
        settings.auth_failure_limit, settings.auth_failure_window_s
    )
    app.state.request_counts = Counter[str]()
    found = observability or getattr(node, "observability", None)
    if not isinstance(found, Observability):
        found = Observability(node.identity().org_id)
    app.state.observability = found
    rounds = getattr(node, "rounds", None)
    if rounds is not None and hasattr(rounds, "add_observer"):
        found.attach(rounds)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """507 for a full disk (nothing was written: the transaction rolled back), else 500
    without the exception's text."""
    full = disk_full(exc)
    if full is not None:
        logger.error("%s %s: the disk is full: %s", request.method, request.url.path, full)
        return JSONResponse(
            status_code=507,
            content={"detail": f"the node's disk is full, nothing was written: {full}"},
        )
    logger.error("unhandled %s on %s %s", type(exc).__name__, request.method, request.url.path)
    return JSONResponse(status_code=500, content={"detail": "internal error"})


def _add_middleware(app: FastAPI, settings: Settings) -> None:
    app.add_middleware(FiniteJsonBodies)  # inside the size limit: it reads bounded bodies
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    app.add_middleware(RequestCounter, counts=app.state.request_counts)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST", "PATCH", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key"],
        )


def disk_full(exc: BaseException) -> str | None:
    """The reason, when ``exc`` (or what caused it) is a full disk: ``ENOSPC`` from the
    file system, or SQLite's ``database or disk is full``; None otherwise."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return seen.strerror or "no space left on the device"
        text = str(seen)
        if "database or disk is full" in text or "No space left on device" in text:
            return text.strip().splitlines()[0]
        seen = seen.__cause__ or seen.__context__
    return None
