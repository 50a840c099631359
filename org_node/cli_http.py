"""A small HTTP/1.1 JSON client on the standard library, for the ``fedweave`` client
commands.

A client command sends one to three requests to its node's admin API and exits;
importing httpx and httpcore (which pull in trio and anyio for their async pools) would
cost it more than all the rest of its run. :class:`HttpClient` has the surface
:class:`~org_node.cli_common.ApiClient` uses (``request(method, path, json=, params=)``
and ``close()``, answers with ``status_code``, ``reason_phrase``, ``headers``,
``content``, ``text`` and ``json()``), so tests can still swap in an httpx-style client.
It opens one connection per request (loopback, a few requests) and does not use HTTP
proxies: the admin API is the node's own, usually on loopback.
"""

from __future__ import annotations

import http.client
import json as jsonlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode, urlsplit

__all__ = ["ConnectFailed", "HttpClient", "HttpError", "Response", "TimedOut"]


class HttpError(Exception):
    """A request that got no answer (the message says why)."""


class ConnectFailed(HttpError):
    """Nothing accepted the connection (refused, unknown host, unreachable)."""


class TimedOut(HttpError):
    """The connection or the answer took longer than the timeout."""


@dataclass(frozen=True)
class Response:
    """An answer: status, headers (names lower-cased) and body."""

    status_code: int
    reason_phrase: str
    headers: Mapping[str, str] = field(default_factory=dict)
    content: bytes = b""

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        """The body as JSON; ValueError when it is not."""
        return jsonlib.loads(self.content)


def _query_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class HttpClient:
    """Requests to ``base_url`` (``http://`` or ``https://``, optionally with a path
    prefix), each with ``headers``, each on a connection of its own."""

    def __init__(
        self, base_url: str, headers: Mapping[str, str] | None = None, timeout: float = 30.0
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.scheme = url.scheme
        self.host = url.hostname
        try:
            self.port = url.port or (443 if url.scheme == "https" else 80)
        except ValueError:
            raise ValueError(f"not an http(s) URL: {base_url!r}") from None
        self.prefix = url.path.rstrip("/")
        self.headers = {"Accept": "application/json", "User-Agent": "fedweave-cli"} | dict(
            headers or {}
        )
        self.timeout = timeout

    def _connection(self) -> http.client.HTTPConnection:
        if self.scheme == "https":
            import ssl

            return http.client.HTTPSConnection(
                self.host, self.port, timeout=self.timeout, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
    ) -> Response:
        """Send one request and read the whole answer; :class:`HttpError` if none came."""
        target = self.prefix + path
        if params:
            query = {k: _query_value(v) for k, v in params.items() if v is not None}
            target += "?" + urlencode(query)
        headers = dict(self.headers)
        body: bytes | None = None
        if json is not None:
            body = jsonlib.dumps(
                json, ensure_ascii=False, separators=(",", ":"), allow_nan=False
            ).encode("utf-8")
            headers["Content-Type"] = "application/json"
        conn = self._connection()
        try:
            try:
                conn.connect()
            except TimeoutError:
                raise TimedOut(f"connecting to {self.host}:{self.port} timed out") from None
            except OSError as exc:
                raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {exc}") from None
            try:
                conn.request(method, target, body=body, headers=headers)
                answer = conn.getresponse()
                content = answer.read()
            except TimeoutError:
                raise TimedOut(f"{method} {path}: no answer in {self.timeout:g} s") from None
            except (OSError, http.client.HTTPException) as exc:
                raise HttpError(f"{method} {path}: {exc or type(exc).__name__}") from None
        finally:
            conn.close()
        return Response(
            answer.status,
            answer.reason,
            {k.lower(): v for k, v in answer.getheaders()},
            content,
        )

    def get(self, path: str, **params: Any) -> Response:
        return self.request("GET", path, params=params)

    def close(self) -> None:
        """Nothing stays open between requests."""
