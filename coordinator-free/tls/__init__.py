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

Modules, each importing only those listed before it (besides ssl, httpx, httpcore,
starlette, uvicorn when a server starts, and ``coordinator_free``'s errors, identity,
addresses and transport protocol; nothing of ``secure_agg`` or of the layers above):

* :mod:`.contexts`: the SSL contexts, the trust bundle, uvicorn's TLS options.
* :mod:`.serve`: an ASGI app served by uvicorn on a socket, as an async context.
* :mod:`.pinning`: the client's pinned httpx transport.
* :mod:`.transport`: ``TlsConfig`` and ``TlsTransport``, the peer app and the client.
"""

from coordinator_free.address import PeerAddress
from coordinator_free.tls.contexts import (
    client_ssl_context,
    server_ssl_context,
    uvicorn_ssl_options,
    write_trust_bundle,
)
from coordinator_free.tls.serve import RunningServer, ServerStartError, serve_app, serve_peer_app
from coordinator_free.tls.transport import PEER_PATH, REFUSAL_HEADER, TlsConfig, TlsTransport

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
