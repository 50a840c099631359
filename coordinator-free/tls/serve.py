"""Serving an ASGI app with uvicorn on a bound socket, as an async context.

:func:`serve_app` returns once the server listens and, on leaving, waits until it
has closed its connections; :func:`serve_peer_app` serves the peer port that way with
mutual TLS (:func:`~.contexts.uvicorn_ssl_options`), HTTP only. uvicorn is imported
when a server starts, not before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coordinator_free.tls.contexts import uvicorn_ssl_options

if TYPE_CHECKING:
    import uvicorn

__all__ = ["RunningServer", "ServerStartError", "serve_app", "serve_peer_app"]

logger = logging.getLogger(__name__)


class ServerStartError(RuntimeError):
    """A server stopped, or did not listen in time, while it was starting."""


@dataclass(frozen=True)
class RunningServer:
    """A server started by :func:`serve_app`: ``task`` serves until the server stops."""

    server: uvicorn.Server
    task: asyncio.Task[None]

    def stop(self) -> None:
        """Ask the server to stop (leaving the context waits until it has)."""
        self.server.should_exit = True


def _server_class(handle_signals: bool) -> type[uvicorn.Server]:
    import uvicorn

    if handle_signals:
        return uvicorn.Server

    class _SignalFreeServer(uvicorn.Server):
        """A uvicorn server that leaves SIGINT and SIGTERM to its caller."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return _SignalFreeServer


@contextlib.asynccontextmanager
async def serve_app(
    app: Callable[..., Any],
    sock: socket.socket,
    *,
    handle_signals: bool = True,
    start_timeout_s: float | None = None,
    **config: Any,
) -> AsyncIterator[RunningServer]:
    """Serve the ASGI ``app`` with uvicorn on ``sock`` (bound) while the context lasts.

    Entering returns once the server listens (:class:`ServerStartError` if it stops
    first, or does not listen within ``start_timeout_s``); leaving asks it to stop and
    waits until it has closed its connections (``timeout_graceful_shutdown`` bounds
    the wait for requests in progress). The server runs as a task on the running loop.
    A failure of the server after it started ends ``task`` and is logged when the
    context is left.

    handle_signals: True leaves uvicorn's own SIGINT/SIGTERM handling in place (from
        the main thread: the server stops on the signal, which is raised again once
        it has); False leaves the signals to the caller.
    config: ``uvicorn.Config`` keyword arguments; by default the server logs warnings
        and errors only, and no access log.
    """
    import uvicorn

    host, port = sock.getsockname()[:2]
    where = f"{host}:{port}"
    options: dict[str, Any] = {"log_level": "warning", "access_log": False, **config}
    server = _server_class(handle_signals)(uvicorn.Config(app, **options))
    running = RunningServer(server, asyncio.create_task(server.serve(sockets=[sock])))
    try:
        await _until_listening(running, where, start_timeout_s)
        yield running
    finally:
        running.stop()
        await asyncio.wait([running.task])
        failure = None if running.task.cancelled() else running.task.exception()
        if failure is not None and running.server.started:
            logger.error("the server on %s failed", where, exc_info=failure)


async def _until_listening(running: RunningServer, where: str, timeout_s: float | None) -> None:
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    while not running.server.started:
        if running.task.done():
            failure = None if running.task.cancelled() else running.task.exception()
            raise ServerStartError(f"the server on {where} stopped while starting") from failure
        if deadline is not None and loop.time() > deadline:
            raise ServerStartError(f"the server on {where} did not listen within {timeout_s}s")
        await asyncio.sleep(0.01)


def serve_peer_app(
    app: Callable[..., Any],
    sock: socket.socket,
    identity_dir: Path,
    trust_bundle: Path,
    *,
    passphrase: bytes | None = None,
    graceful_shutdown_s: int | None = None,
    handle_signals: bool = True,
    start_timeout_s: float | None = None,
) -> contextlib.AbstractAsyncContextManager[RunningServer]:
    """Serve the peer port's ``app`` (:meth:`TlsTransport.asgi_app`) on ``sock`` with
    mutual TLS (:func:`uvicorn_ssl_options`) while the context lasts (:func:`serve_app`).

    The peer port speaks HTTP only: no lifespan events, no WebSocket upgrade.
    ``graceful_shutdown_s`` bounds how long leaving waits for open connections (idle
    keep-alive TLS connections from peers would otherwise hold it for asyncio's SSL
    shutdown timeout); None waits as long as they last.
    """
    return serve_app(
        app,
        sock,
        handle_signals=handle_signals,
        start_timeout_s=start_timeout_s,
        lifespan="off",
        ws="none",
        timeout_graceful_shutdown=graceful_shutdown_s,
        **uvicorn_ssl_options(identity_dir, trust_bundle, passphrase),
    )
