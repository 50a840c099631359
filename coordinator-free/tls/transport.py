"""The mutual-TLS transport of a member: :class:`TlsTransport` and its limits, :class:`TlsConfig`.

Server side, the peer route (``POST`` :data:`PEER_PATH`) as a bare ASGI app or a
Starlette route, reading at most ``max_message_bytes + 1`` bytes of a request; client
side, one pinned transport per peer (:mod:`.pinning`), bodies streamed in
``chunk_size`` pieces, and connection failures retried with jittered backoff.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import httpx
from coordinator_free.address import PeerAddress
from coordinator_free.errors import (
    PeerUnreachable,
    RefusalReason,
    Refused,
    RemoteError,
    RequestTimeout,
    TransportError,
)
from coordinator_free.identity import OrgIdentity
from coordinator_free.tls.contexts import client_ssl_context
from coordinator_free.tls.pinning import PinnedTransport
from coordinator_free.transport import RawHandler
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

__all__ = ["PEER_PATH", "REFUSAL_HEADER", "TlsConfig", "TlsTransport"]

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
        self._clients: dict[str, tuple[PeerAddress, PinnedTransport, httpx.URL]] = {}
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
        parts: list[bytes] = []
        kept = received = 0
        async for chunk in chunks:
            received += len(chunk)
            if kept <= limit:
                piece = chunk[: limit + 1 - kept]
                parts.append(piece)
                kept += len(piece)
            elif received > _DRAIN_FACTOR * limit:
                break
        # the pieces joined once: one copy of the message, not two
        return parts[0] if len(parts) == 1 else b"".join(parts)

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

    async def _client(self, peer: str) -> tuple[PeerAddress, PinnedTransport, httpx.URL]:
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
        transport = PinnedTransport(
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
        transport: PinnedTransport,
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
        parts: list[bytes] = []
        size = 0
        async for chunk in response.aiter_raw():
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                logger.warning("%s refused a reply: %s (from %r)", self.org_id, "oversized", peer)
                raise Refused(RefusalReason.OVERSIZED, f"reply from {peer!r} exceeds {limit} bytes")
        return parts[0] if len(parts) == 1 else b"".join(parts)

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
