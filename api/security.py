"""Bearer tokens, roles, the failed-authentication limiter and the body-size limit.

Every authentication failure — no header, a malformed header, an unknown or revoked
token, a wrong secret — is one opaque 401 (:data:`UNAUTHORIZED`); the token check does
the same work whether or not the token exists (:func:`org_node.db.repo.find_token`).
A client address with too many failures in the window gets 429 instead of 401 for
its failures until the window passes; a valid token is looked at first and is never
limited, so bad requests from an address (any local process shares 127.0.0.1) cannot
lock the real token out. Authorization is by role: each route declares
the roles it admits (:func:`require_roles`); a valid token of another role gets 403.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException, status
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from org_node.db.models import Role

__all__ = [
    "ALL_ROLES",
    "UNAUTHORIZED",
    "AuthFailureLimiter",
    "BodySizeLimit",
    "Principal",
    "forbidden",
]

ALL_ROLES: frozenset[Role] = frozenset(Role)

UNAUTHORIZED = HTTPException(
    status_code=status.HTTP_401_UNAUTHORIZED,
    detail="invalid or missing credentials",
    headers={"WWW-Authenticate": "Bearer"},
)
"""The one answer to every authentication failure."""


def forbidden(role: Role) -> HTTPException:
    """403 for a valid token whose role the route does not admit."""
    return HTTPException(
        status_code=status.HTTP_403_FORBIDDEN, detail=f"role {role.value!r} may not do this"
    )


@dataclass(frozen=True)
class Principal:
    """The authenticated caller: token id, token name, role."""

    token_id: int
    name: str
    role: Role


class AuthFailureLimiter:
    """Sliding-window count of failed authentications per client address.

    ``clock`` is injectable for tests. Thread-safe: the API's worker threads share it.
    """

    def __init__(
        self, limit: int, window_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if limit < 1 or window_s <= 0:
            raise ValueError("limit must be >= 1 and window_s > 0")
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: dict[str, deque[float]] = {}

    def _prune(self, client: str, now: float) -> deque[float]:
        q = self._failures.setdefault(client, deque())
        while q and q[0] <= now - self.window_s:
            q.popleft()
        return q

    def retry_after(self, client: str) -> float:
        """Seconds until ``client`` may try again; 0 when it is not blocked."""
        with self._lock:
            now = self._clock()
            q = self._prune(client, now)
            if len(q) < self.limit:
                if not q:
                    self._failures.pop(client, None)
                return 0.0
            return max(q[0] + self.window_s - now, 0.001)

    def failure(self, client: str) -> None:
        """Record one failed authentication by ``client``."""
        with self._lock:
            now = self._clock()
            q = self._prune(client, now)
            q.append(now)
            if len(self._failures) > 100_000:  # bound memory under address churn
                stale = [c for c, d in self._failures.items() if not d]
                for c in stale:
                    del self._failures[c]


class BodySizeLimit:
    """ASGI middleware: 413 for a request body over ``max_bytes``.

    Checks ``Content-Length`` first, then counts the bytes actually received (chunked
    bodies included), so that no handler ever sees more than ``max_bytes``.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _too_large(send, 400, b'{"detail":"invalid Content-Length"}')
                    return
                if declared > self.max_bytes:
                    await _too_large(send, 413, self._message())
                    return
        seen = 0
        started = False
        refused = False

        async def limited() -> Message:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Answer now; the app sees a disconnected client and its answer is dropped.
                    refused = True
                    if not started:
                        await _too_large(send, 413, self._message())
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, limited, guarded_send)

    def _message(self) -> bytes:
        return b'{"detail":"request body larger than %d bytes"}' % self.max_bytes


async def _too_large(send: Send, code: int, body: bytes) -> None:
    headers: list[Any] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
