"""Whom a running peer port trusts follows the federation: :class:`TrustFollower`.

A server's :class:`ssl.SSLContext` loads its trusted certificates once, and OpenSSL
cannot remove one from a context. So the peer port's context is left as it was built
and, at every handshake, the follower swaps the connection onto a context that trusts
exactly the members' certificates *now* (the context's SNI callback, which OpenSSL calls
for every ClientHello, with or without a server name, may replace the connection's
context, and the client certificate is then verified against the new one's store). A
member removed from the manifest therefore fails the handshake from the moment the
node installs the new version, without a restart; connections already open finish the
requests in flight, and each new one is checked.

Contexts are built by :func:`~coordinator_free.tls.server_ssl_context` and kept per set
of certificates, so a handshake builds one only after the membership changed.
"""

from __future__ import annotations

import hashlib
import ssl
import threading
from collections.abc import Callable, Sequence

from coordinator_free.identity import OrgIdentity
from coordinator_free.tls import server_ssl_context

__all__ = ["TrustFollower"]


class TrustFollower:
    """Keeps a TLS server's trusted client certificates equal to ``trusted()``."""

    def __init__(self, identity: OrgIdentity, trusted: Callable[[], Sequence[bytes]]) -> None:
        self._identity = identity
        self._trusted = trusted
        self._lock = threading.Lock()
        self._cached: tuple[bytes, ssl.SSLContext] | None = None

    def context(self) -> ssl.SSLContext:
        """A server context trusting exactly the certificates ``trusted()`` gives now."""
        certificates = sorted(self._trusted())
        digest = hashlib.sha256(b"\0".join(certificates)).digest()
        with self._lock:
            if self._cached is None or self._cached[0] != digest:
                self._cached = (digest, server_ssl_context(self._identity, certificates))
            return self._cached[1]

    def follow(self, server_context: ssl.SSLContext) -> None:
        """Check every later handshake on ``server_context`` against ``trusted()``."""
        server_context.sni_callback = self._on_hello

    def _on_hello(
        self, connection: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _: object
    ) -> None:
        connection.context = self.context()
