"""The composition root: ``fedweave run`` serves one node in one process.

Two uvicorn servers share the process's event loop with the node's own tasks (SWIM,
gossip, the run engine):

* the **admin API** (:func:`api.app.create_app`, bearer tokens) on
  ``network.admin_host:admin_port``, loopback unless the config allows otherwise;
* the **peer API** (the mutual-TLS route of :class:`coordinator_free.tls.TlsTransport`)
  on ``network.peer_host:peer_port``, requiring a client certificate among the
  federation members' (:func:`coordinator_free.tls.serve_peer_app`): the members of the
  manifest installed *now* (:class:`coordinator_free.trust.TrustFollower`), so a member
  removed while the node runs is refused at the next handshake.

This module is the composition root, the only place that knows every layer
(``docs/ARCHITECTURE.md``, "Layers"), which is why it lives in ``api``, the top
layer. Both sockets are bound before anything starts, so a port in use is one
clear error. SIGTERM or SIGINT stops the node gracefully: the run engine abandons the
current stage (its state stays at the last finished round, from which a restart
resumes), the node leaves the membership, then both servers close their connections
and free their ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path

from coordinator_free.tls import (
    RunningServer,
    ServerStartError,
    serve_app,
    serve_peer_app,
    write_trust_bundle,
)
from coordinator_free.trust import TrustFollower

from api.app import create_app
from api.settings import Settings
from org_node.config import NodeConfig, NodePaths
from org_node.db.engine import make_engine
from org_node.node import NodeError, OrgNode

__all__ = ["bind", "dataset_roots", "serve_node"]

logger = logging.getLogger(__name__)

_GRACE_S = 5
ADMIN_KEEP_ALIVE_S = 30
"""How long the admin API keeps an idle connection open: longer than a client's pool
keeps one (httpx: 5 s), so that a client always closes an idle connection first and
never sends a request on one the server is closing ("Server disconnected without
sending a response"), which a polling script on a loaded machine otherwise meets."""


def dataset_roots(configured: tuple[str, ...]) -> tuple[Path, ...]:
    """The config's ``[datasets] roots``, then any ``FEDWEAVE_DATASET_ROOTS`` adds."""
    roots = [Path(r) for r in configured]
    for extra in _env_roots():
        if extra not in roots:
            roots.append(extra)
    return tuple(roots)


def _env_roots() -> tuple[Path, ...]:
    raw = os.environ.get("FEDWEAVE_DATASET_ROOTS")
    if not raw:
        return ()
    try:
        values = json.loads(raw)
    except ValueError:
        raise NodeError("FEDWEAVE_DATASET_ROOTS must be a JSON list of directories") from None
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise NodeError("FEDWEAVE_DATASET_ROOTS must be a JSON list of directories")
    return tuple(Path(v) for v in values)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``; :class:`NodeError` if it cannot be bound.

    Created with ``IPPROTO_TCP`` named explicitly: asyncio turns Nagle's algorithm off
    (``TCP_NODELAY``) only on sockets whose ``proto`` says TCP, and a response written
    as headers then body would otherwise wait for the client's delayed ACK (40 ms on
    Linux) before its body leaves.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise NodeError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


async def serve_node(
    data_dir: Path,
    *,
    on_ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    passphrase: bytes | None = None,
) -> None:
    """Serve the node in ``data_dir`` until SIGTERM/SIGINT (or ``stop`` is set);
    ``passphrase`` opens its encrypted identity key and recovery secret."""
    paths = NodePaths(Path(data_dir))
    if not paths.config.exists():
        raise NodeError(f"{data_dir} is not a node data directory: run `fedweave init`")
    config = NodeConfig.load(paths.config)
    settings = _settings(paths, config)
    # the database the settings name (FEDWEAVE_DATABASE_URL: PostgreSQL), else SQLite
    node = OrgNode.open(
        paths.root, passphrase=passphrase, db=make_engine(settings.resolved_database_url)
    )
    net = config.network
    admin_sock = bind(net.admin_host, net.admin_port)
    peer_sock: socket.socket | None = None
    if node.current_manifest is not None:
        try:
            peer_sock = bind(net.peer_host, net.peer_port)
        except NodeError:
            admin_sock.close()
            raise
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await _serve(node, settings, admin_sock, peer_sock, stop, on_ready, passphrase)
    finally:
        admin_sock.close()
        if peer_sock is not None:
            peer_sock.close()
        node.db.dispose()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)


def _settings(paths: NodePaths, config: NodeConfig) -> Settings:
    net = config.network
    return Settings(
        data_dir=paths.root,
        admin_host=net.admin_host,
        admin_port=net.admin_port,
        allow_remote_admin=net.allow_remote_admin,
        peer_host=net.peer_host,
        peer_port=net.peer_port,
        dataset_roots=dataset_roots(config.datasets.roots),
    )


async def _serve(
    node: OrgNode,
    settings: Settings,
    admin_sock: socket.socket,
    peer_sock: socket.socket | None,
    stop: asyncio.Event,
    on_ready: Callable[[str], None] | None,
    passphrase: bytes | None = None,
) -> None:
    """Start the node and both servers, say so, serve until ``stop``; then stop the node
    first and both servers together (leaving the stack waits for them)."""
    async with contextlib.AsyncExitStack() as stack:
        servers: list[RunningServer] = []
        try:
            await node.start()
            app = create_app(settings, node, engine=node.db)
            admin = serve_app(
                app,
                admin_sock,
                handle_signals=False,
                timeout_graceful_shutdown=_GRACE_S,
                timeout_keep_alive=ADMIN_KEEP_ALIVE_S,
            )
            servers.append(await stack.enter_async_context(admin))
            if peer_sock is not None:
                servers.append(await _serve_peers(node, peer_sock, stack, passphrase))
            _announce(node, peer_sock is not None, on_ready)
            stopped = asyncio.create_task(stop.wait())
            serving = [s.task for s in servers]
            await asyncio.wait([stopped, *serving], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
        except ServerStartError as exc:
            raise NodeError(str(exc)) from exc
        finally:
            await node.stop()
            for server in servers:
                server.stop()


async def _serve_peers(
    node: OrgNode,
    sock: socket.socket,
    stack: contextlib.AsyncExitStack,
    passphrase: bytes | None = None,
) -> RunningServer:
    """The peer port over mutual TLS; whom it admits follows the installed manifest
    (:class:`TrustFollower`), so a removed member is refused without a restart."""
    manifest, tls = node.current_manifest, node.tls
    if manifest is None or tls is None:
        raise NodeError("the node has no federation to serve its peers")
    write_trust_bundle(node.paths.trust_bundle, manifest.certificates())
    peer = serve_peer_app(
        tls.asgi_app(),
        sock,
        node.paths.identity_dir,
        node.paths.trust_bundle,
        passphrase=passphrase,
        graceful_shutdown_s=_GRACE_S,
        handle_signals=False,
    )
    running = await stack.enter_async_context(peer)
    context = running.server.config.ssl
    assert context is not None  # the peer server listens with TLS
    TrustFollower(node.org_identity, node.trusted_certificates).follow(context)
    return running


def _announce(node: OrgNode, peers: bool, on_ready: Callable[[str], None] | None) -> None:
    net = node.config.network
    where = f"admin http://{net.admin_host}:{net.admin_port}"
    if peers:
        where += f", peer {net.peer_url}"
    message = f"fedweave node {node.me} ready: {where}"
    logger.info(message)
    if on_ready is not None:
        on_ready(message)
