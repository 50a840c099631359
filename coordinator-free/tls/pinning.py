"""The client's plumbing: an httpx transport over an httpcore pool that pins one certificate.

The pool's network backend checks the server certificate against the fingerprint
pinned in the manifest right after the TLS handshake and before a single HTTP byte
is written (:class:`~coordinator_free.errors.UntrustedPeer` on a mismatch); httpcore's
errors surface as httpx's.
"""

from __future__ import annotations

import contextlib
import hashlib
import ssl
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpcore
import httpx
from coordinator_free.errors import UntrustedPeer

__all__ = ["KEEPALIVE_EXPIRY_S", "PinnedTransport"]

KEEPALIVE_EXPIRY_S = 4.0
"""A pooled connection idle this long is closed rather than used again: below the
server's keep-alive timeout (uvicorn's default, 5 s), so that a request never goes
out on a connection the server is closing, which fails with ``ReadError('')`` once
a vector's ring steps leave a connection idle for seconds."""


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


class PinnedTransport(httpx.AsyncBaseTransport):
    """httpx transport over an httpcore pool that pins one server certificate."""

    def __init__(self, context: ssl.SSLContext, fingerprint: str, max_connections: int) -> None:
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=context,
            max_connections=max_connections,
            http1=True,
            http2=False,
            retries=0,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
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
