"""HTTPS with mutual TLS between org processes: server routes and an httpx client.

Server side: :meth:`TlsTransport.asgi_app` answers ``POST /fedweave/peer/v1/message``
and nothing else, straight from the ASGI messages (:meth:`TlsTransport.routes` is the
same as a Starlette route). :func:`serve_peer_app` serves it on the peer port with
uvicorn (the node, the benchmarks and the tests all start it so), using
:func:`uvicorn_ssl_options`:
the org's certificate and key, and a trust bundle (:func:`write_trust_bundle`) holding
exactly the members' certificates with ``ssl.CERT_REQUIRED``. A member certificate is
self-signed, so it is its own trust anchor and OpenSSL accepts that certificate (or
another one for the same key) and nothing else: a client without a certificate, or with
a certificate that is not in the manifest, fails the TLS handshake. (uvicorn does not
expose the client certificate to the application; every message is in any case signed
by its sender's identity key and checked by the endpoint's
:class:`~coordinator_free.transport.MessageGuard`.)

Client side: one httpx transport per peer over an httpcore connection pool whose
network backend checks the server certificate against the fingerprint pinned in the
manifest **right after the TLS handshake and before a single HTTP byte is written**.
The SSL context itself does no CA or hostname verification (``CERT_NONE``): the pin is
stricter than any CA (exactly one certificate is acceptable), works for self-signed
and CA-issued certificates alike, and needs only the fingerprint that the manifest
publishes. The alternative, a per-peer ``cadata`` with the pinned certificate, would
need every certificate's PEM on the client and would still accept any certificate
issued by a pinned CA. A mismatch raises :class:`~coordinator_free.errors.UntrustedPeer`.

Large payloads are streamed in ``chunk_size`` pieces with a ``Content-Length``; each
piece is pulled only when the previous one has been written to the socket, which is the
backpressure. The server reads at most ``max_message_bytes + 1`` bytes into memory and
hands an over-long body to the handler truncated, so that the endpoint's guard refuses
it as ``OVERSIZED`` (logged and counted like any refusal).

Connection failures (nothing reached the peer) are retried with jittered exponential
backoff; refusals, handler failures and errors after the request was sent are not,
since a resent message would only be refused as a replay.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import random
import socket
import ssl
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpcore
import httpx
from coordinator_free.address import PeerAddress
from coordinator_free.errors import (
    PeerUnreachable,
    RefusalReason,
    Refused,
    RemoteError,
    RequestTimeout,
    TransportError,
    UntrustedPeer,
)
from coordinator_free.identity import CERT_FILE, KEY_FILE, OrgIdentity
from coordinator_free.transport import RawHandler
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

if TYPE_CHECKING:
    import uvicorn

__all__ = [
    "PEER_PATH",
    "REFUSAL_HEADER",
    "PeerAddress",
    "RunningServer",
    "ServerStartError",
    "TlsConfig",
    "TlsTransport",
    "client_ssl_context",
    "serve_app",
    "serve_peer_app",
    "server_ssl_context",
    "uvicorn_ssl_options",
    "write_trust_bundle",
]

logger = logging.getLogger(__name__)

PEER_PATH = "/fedweave/peer/v1/message"
REFUSAL_HEADER = "x-fedweave-refusal"
_DRAIN_FACTOR = 4


@dataclass(frozen=True)
class TlsConfig:
    """Limits and retry policy of :class:`TlsTransport`."""

    max_message_bytes: int = 64 << 20
    """Largest request or reply body accepted; match the endpoint's ``max_size``."""
    chunk_size: int = 256 << 10
    """Size of the pieces a body is streamed in."""
    connect_retries: int = 4
    """Extra attempts after a failed connection (0 disables retries)."""
    backoff_base_s: float = 0.05
    """Delay before the first retry; doubles each retry, jittered to 50–100 %."""
    backoff_max_s: float = 2.0
    """Upper bound of one retry delay."""
    max_connections_per_peer: int = 8
    """Concurrent connections to one peer."""

    def __post_init__(self) -> None:
        if self.max_message_bytes <= 0 or self.chunk_size <= 0:
            raise ValueError("max_message_bytes and chunk_size must be positive")
        if self.connect_retries < 0:
            raise ValueError("connect_retries must be non-negative")
        if self.backoff_base_s < 0 or self.backoff_max_s < self.backoff_base_s:
            raise ValueError("need 0 <= backoff_base_s <= backoff_max_s")
        if self.max_connections_per_peer < 1:
            raise ValueError("max_connections_per_peer must be at least 1")


def _load_identity_chain(context: ssl.SSLContext, identity: OrgIdentity) -> None:
    """Load the identity's certificate and key into ``context``.

    ``ssl`` reads keys only from files: the key is written encrypted under a one-time
    random passphrase (which never touches the disk) into a private temporary
    directory, loaded, and deleted.
    """
    one_time = os.urandom(32).hex().encode()
    with tempfile.TemporaryDirectory(prefix="fedweave-tls-") as tmp:
        key_path, cert_path = Path(tmp) / KEY_FILE, Path(tmp) / CERT_FILE
        for path, data in (
            (key_path, identity.private_key_pem(one_time)),
            (cert_path, identity.certificate_pem),
        ):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        context.load_cert_chain(cert_path, key_path, password=one_time)


def client_ssl_context(identity: OrgIdentity) -> ssl.SSLContext:
    """Client context: presents the identity; the server is checked by pin, not by CA."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    _load_identity_chain(context, identity)
    return context


def server_ssl_context(identity: OrgIdentity, trusted_certificates: list[bytes]) -> ssl.SSLContext:
    """Server context requiring a client certificate among ``trusted_certificates``."""
    if not trusted_certificates:
        raise ValueError("a server needs at least one trusted certificate")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=b"".join(trusted_certificates).decode("ascii"))
    _load_identity_chain(context, identity)
    return context


def write_trust_bundle(path: Path, certificates: list[bytes]) -> None:
    """Write the members' PEM certificates as one bundle (uvicorn's ``ssl_ca_certs``)."""
    if not certificates:
        raise ValueError("a trust bundle needs at least one certificate")
    bundle = b"".join(pem if pem.endswith(b"\n") else pem + b"\n" for pem in certificates)
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_bytes(bundle)
    tmp.replace(path)


def uvicorn_ssl_options(
    identity_dir: Path, trust_bundle: Path, passphrase: bytes | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` serving the peer port with mutual TLS."""
    identity_dir = Path(identity_dir)
    return {
        "ssl_keyfile": str(identity_dir / KEY_FILE),
        "ssl_certfile": str(identity_dir / CERT_FILE),
        "ssl_keyfile_password": passphrase.decode() if passphrase else None,
        "ssl_ca_certs": str(trust_bundle),
        "ssl_cert_reqs": ssl.CERT_REQUIRED,
    }


# --- serving: one uvicorn server on a bound socket, as an async context ---------------


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


# --- client plumbing: a pinning network backend under httpx -----------------------------


class _PinningStream(httpcore.AsyncNetworkStream):
    """A TCP stream whose TLS upgrade fails unless the peer presents the pinned cert."""

    def __init__(self, inner: httpcore.AsyncNetworkStream, fingerprint: str) -> None:
        self._inner = inner
        self._fingerprint = fingerprint

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)

    async def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.AsyncNetworkStream:
        tls = await self._inner.start_tls(ssl_context, server_hostname, timeout)
        ssl_object = tls.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        if der is None or hashlib.sha256(der).hexdigest() != self._fingerprint:
            await tls.aclose()
            raise UntrustedPeer(
                f"{server_hostname} presented a certificate that is not the pinned one"
            )
        return tls


class _PinningBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, fingerprint: str) -> None:
        self._inner = httpcore.AnyIOBackend()
        self._fingerprint = fingerprint

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(
            host, port, timeout=timeout, local_address=local_address, socket_options=socket_options
        )
        return _PinningStream(stream, self._fingerprint)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


_HTTPCORE_TO_HTTPX: dict[type[Exception], type[httpx.TransportError]] = {
    httpcore.ConnectTimeout: httpx.ConnectTimeout,
    httpcore.ReadTimeout: httpx.ReadTimeout,
    httpcore.WriteTimeout: httpx.WriteTimeout,
    httpcore.PoolTimeout: httpx.PoolTimeout,
    httpcore.ConnectError: httpx.ConnectError,
    httpcore.ReadError: httpx.ReadError,
    httpcore.WriteError: httpx.WriteError,
    httpcore.RemoteProtocolError: httpx.RemoteProtocolError,
    httpcore.LocalProtocolError: httpx.LocalProtocolError,
}


@contextlib.contextmanager
def _httpx_errors() -> Iterator[None]:
    try:
        yield
    except tuple(_HTTPCORE_TO_HTTPX) as exc:
        raise _HTTPCORE_TO_HTTPX[type(exc)](str(exc)) from exc


class _ResponseStream(httpx.AsyncByteStream):
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _httpx_errors():
            async for chunk in self._inner:
                yield chunk

    async def aclose(self) -> None:
        with _httpx_errors():
            await self._inner.aclose()


class _PinnedTransport(httpx.AsyncBaseTransport):
    """httpx transport over an httpcore pool that pins one server certificate."""

    def __init__(self, context: ssl.SSLContext, fingerprint: str, max_connections: int) -> None:
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=context,
            max_connections=max_connections,
            http1=True,
            http2=False,
            retries=0,
            network_backend=_PinningBackend(fingerprint),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        core_request = httpcore.Request(
            method=request.method,
            url=httpcore.URL(
                scheme=request.url.raw_scheme,
                host=request.url.raw_host,
                port=request.url.port,
                target=request.url.raw_path,
            ),
            headers=request.headers.raw,
            content=request.stream,
            extensions=request.extensions,
        )
        with _httpx_errors():
            response = await self._pool.handle_async_request(core_request)
        return httpx.Response(
            status_code=response.status,
            headers=response.headers,
            stream=_ResponseStream(response.stream),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._pool.aclose()


class _PeerApp:
    """ASGI application of the peer port: ``POST`` :data:`PEER_PATH`, nothing else.

    The same answers as :meth:`TlsTransport.routes` under Starlette (404 for another
    path, 405 for another method), read and written straight from the ASGI messages.
    """

    def __init__(self, transport: TlsTransport) -> None:
        self._transport = transport

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if scope["path"] != PEER_PATH:
            await _respond(send, 404, {}, b"Not Found")
            return
        if scope["method"] != "POST":
            await _respond(send, 405, {"allow": "POST"}, b"Method Not Allowed")
            return

        async def chunks() -> AsyncIterator[bytes]:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnect()
                yield message.get("body", b"")
                if not message.get("more_body", False):
                    return

        status, headers, body = await self._transport._answer(chunks())
        await _respond(send, status, headers, body, self._transport.config.chunk_size)


async def _respond(
    send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    status: int,
    headers: Mapping[str, str],
    body: bytes,
    chunk_size: int = 1 << 30,
) -> None:
    """Send one response: its head, then ``body`` in pieces of ``chunk_size`` bytes
    (the server's ``send`` waits while the socket's buffer is full: the backpressure)."""
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    raw.append((b"content-length", str(len(body)).encode("ascii")))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    view = memoryview(body)
    for start in range(0, max(len(view), 1), chunk_size):
        piece = bytes(view[start : start + chunk_size])
        more = start + chunk_size < len(view)
        await send({"type": "http.response.body", "body": piece, "more_body": more})


class _ConnectFailed(Exception):
    """Internal: the connection failed before the request reached the peer."""


# --- the transport -------------------------------------------------------------------


class TlsTransport:
    """Mutual-TLS HTTPS transport (implements :class:`~coordinator_free.transport.Transport`).

    ``peers()`` maps org ids to :class:`PeerAddress`; it is read on every request, so a
    new manifest version applies at once. ``rng`` drives the backoff jitter.
    """

    def __init__(
        self,
        identity: OrgIdentity,
        peers: Callable[[], Mapping[str, PeerAddress]],
        *,
        config: TlsConfig | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.org_id = identity.org_id
        self.config = config or TlsConfig()
        self._peers = peers
        self._context = client_ssl_context(identity)
        self._rng = rng or random.Random()
        self._clients: dict[str, tuple[PeerAddress, _PinnedTransport, httpx.URL]] = {}
        self._handler: RawHandler | None = None
        self.retries = 0
        """Connection attempts retried so far (for tests and metrics)."""

    # server side

    async def start(self, handler: RawHandler) -> None:
        """Serve requests through :meth:`routes` with ``handler``."""
        self._handler = handler

    def routes(self) -> list[Route]:
        """The peer route, for an application that serves other routes too."""
        return [Route(PEER_PATH, self._receive, methods=["POST"])]

    def asgi_app(self) -> _PeerApp:
        """The peer port's ASGI application: the peer route alone, with no framework's
        routing and middleware between the socket and the handler (every message of
        the federation passes here)."""
        return _PeerApp(self)

    async def _read_body(self, chunks: AsyncIterator[bytes]) -> bytes:
        limit = self.config.max_message_bytes
        body = bytearray()
        received = 0
        async for chunk in chunks:
            received += len(chunk)
            if len(body) <= limit:
                body.extend(chunk[: limit + 1 - len(body)])
            elif received > _DRAIN_FACTOR * limit:
                break
        return bytes(body)

    async def _answer(self, chunks: AsyncIterator[bytes]) -> tuple[int, dict[str, str], bytes]:
        """Status, headers and body of the answer to the message read from ``chunks``."""
        handler = self._handler
        if handler is None:
            return 503, {}, b""
        try:
            body = await self._read_body(chunks)
        except ClientDisconnect:
            logger.info("%s: a peer disconnected while sending", self.org_id)
            return 400, {}, b""
        try:
            reply = await handler(body)
        except Refused as exc:
            return 403, {REFUSAL_HEADER: exc.reason.value}, b""
        except Exception:
            logger.exception("%s: peer message handler failed", self.org_id)
            return 500, {}, b""
        return 200, {"content-type": "application/octet-stream"}, reply

    async def _receive(self, request: Request) -> Response:
        status, headers, reply = await self._answer(request.stream())
        if len(reply) <= self.config.chunk_size:
            return Response(reply, status_code=status, headers=headers)
        return StreamingResponse(
            self._chunks(reply),
            status_code=status,
            headers={**headers, "content-length": str(len(reply))},
        )

    async def _chunks(self, data: bytes) -> AsyncIterator[bytes]:
        view = memoryview(data)
        size = self.config.chunk_size
        for start in range(0, len(view), size):
            yield bytes(view[start : start + size])

    # client side

    async def _client(self, peer: str) -> tuple[PeerAddress, _PinnedTransport, httpx.URL]:
        """The peer's address, pinned transport and message URL (made on first use, and
        again when the manifest changes the address)."""
        address = self._peers().get(peer)
        if address is None:
            raise PeerUnreachable(f"no address for {peer!r}")
        cached = self._clients.pop(peer, None)
        if cached is not None and cached[0] == address:
            self._clients[peer] = cached
            return cached
        if cached is not None:
            await cached[1].aclose()
        transport = _PinnedTransport(
            self._context, address.fingerprint, self.config.max_connections_per_peer
        )
        entry = (address, transport, httpx.URL(address.url).join(PEER_PATH))
        self._clients[peer] = entry
        return entry

    def backoff(self, attempt: int) -> float:
        """Delay before retry ``attempt`` (0-based): exponential, jittered to 50–100 %."""
        ceiling = min(self.config.backoff_max_s, self.config.backoff_base_s * (1 << attempt))
        return ceiling * (0.5 + 0.5 * self._rng.random())

    async def request(self, peer: str, data: bytes, *, timeout: float) -> bytes:
        """POST ``data`` to ``peer``'s peer route; return the reply body."""
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        try:
            async with asyncio.timeout(timeout):
                return await self._request_with_retries(peer, data, timeout)
        except TimeoutError:
            raise RequestTimeout(f"{peer!r} did not answer within {timeout}s") from None

    async def _request_with_retries(self, peer: str, data: bytes, timeout: float) -> bytes:
        attempt = 0
        while True:
            _, transport, url = await self._client(peer)
            try:
                return await self._post(transport, url, peer, data, timeout)
            except _ConnectFailed as exc:
                if attempt >= self.config.connect_retries:
                    raise PeerUnreachable(f"cannot connect to {peer!r}: {exc}") from None
            delay = self.backoff(attempt)
            attempt += 1
            self.retries += 1
            logger.info("%s: retrying %s in %.3fs (attempt %d)", self.org_id, peer, delay, attempt)
            await asyncio.sleep(delay)

    async def _post(
        self,
        transport: _PinnedTransport,
        url: httpx.URL,
        peer: str,
        data: bytes,
        timeout: float,
    ) -> bytes:
        """One POST straight through the peer's pinned transport (a client's cookies,
        redirects and URL merging have no use here and cost more than the send)."""
        request = httpx.Request(
            "POST",
            url,
            # a small message goes in one write, a large one chunk by chunk
            content=data if len(data) <= self.config.chunk_size else self._chunks(data),
            headers={
                "content-type": "application/octet-stream",
                "content-length": str(len(data)),
            },
            extensions={"timeout": httpx.Timeout(timeout).as_dict()},
        )
        try:
            response = await transport.handle_async_request(request)
            try:
                if response.status_code == 200:
                    return await self._read_reply(response, peer)
                raise self._status_error(response, peer)
            finally:
                await response.aclose()
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise _ConnectFailed(str(exc) or type(exc).__name__) from None
        except httpx.TimeoutException:
            raise RequestTimeout(f"{peer!r} timed out") from None
        except httpx.TransportError as exc:
            raise PeerUnreachable(f"connection to {peer!r} failed: {exc!r}") from None

    async def _read_reply(self, response: httpx.Response, peer: str) -> bytes:
        limit = self.config.max_message_bytes
        body = bytearray()
        async for chunk in response.aiter_raw():
            body.extend(chunk)
            if len(body) > limit:
                logger.warning("%s refused a reply: %s (from %r)", self.org_id, "oversized", peer)
                raise Refused(RefusalReason.OVERSIZED, f"reply from {peer!r} exceeds {limit} bytes")
        return bytes(body)

    @staticmethod
    def _status_error(response: httpx.Response, peer: str) -> TransportError:
        if response.status_code == 403:
            try:
                return Refused(RefusalReason(response.headers.get(REFUSAL_HEADER, "")))
            except ValueError:
                return RemoteError(f"{peer!r} refused with an unknown reason")
        if response.status_code == 503:
            return PeerUnreachable(f"{peer!r} is not serving yet")
        return RemoteError(f"{peer!r} answered HTTP {response.status_code}")

    async def close(self) -> None:
        """Stop serving and close every client connection."""
        self._handler = None
        clients, self._clients = self._clients, {}
        for _, transport, _ in clients.values():
            await transport.aclose()
