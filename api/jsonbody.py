"""JSON request bodies with ``NaN``, ``Infinity`` or a number too large for a float are refused with 422.

Python's ``json`` (which FastAPI parses bodies with) accepts the non-standard constants
``NaN``, ``Infinity`` and ``-Infinity`` and turns ``1e999`` into ``inf``; such a value
would then reach a route, a pydantic model or the database and end in a 500.
:class:`FiniteJsonBodies` reads a JSON body (the body-size limit has bounded it
already), parses it once with those values refused, and answers 422 naming the value;
a body that is not JSON at all is left to FastAPI's own 422, and the body is handed on
unchanged otherwise.
"""

from __future__ import annotations

import json
import math
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["FiniteJsonBodies", "NonFiniteNumber", "check_finite_json"]


class NonFiniteNumber(ValueError):
    """A JSON text holds ``NaN``, ``Infinity`` or a number beyond a float's range."""


def _constant(name: str) -> Any:
    raise NonFiniteNumber(f"{name} is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise NonFiniteNumber(f"{text[:40]} is out of range for a number")
    return value


def check_finite_json(body: bytes) -> None:
    """Raise :class:`NonFiniteNumber` when ``body`` is JSON with a non-finite number;
    nothing for finite JSON or for what is not JSON (FastAPI reports that itself)."""
    try:
        json.loads(body, parse_constant=_constant, parse_float=_float)
    except NonFiniteNumber:
        raise
    except (ValueError, RecursionError):
        return


def _is_json(scope: Scope) -> bool:
    """FastAPI parses a body as JSON without a content type, or with ``*/json``/``+json``."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            kind = bytes(value).split(b";", 1)[0].strip().lower()
            return kind == b"application/json" or (
                kind.startswith(b"application/") and kind.endswith(b"+json")
            )
    return True


class FiniteJsonBodies:
    """ASGI middleware: 422 for a JSON body holding a non-finite number (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD") or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if body:
            try:
                check_finite_json(body)
            except NonFiniteNumber as exc:
                await _refuse(send, str(exc))
                return
        whole: Message = {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, _replay([whole], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replay() -> Message:
        if messages:
            return messages.pop(0)
        return await receive()

    return replay


async def _refuse(send: Send, reason: str) -> None:
    body = json.dumps(
        {"detail": f"the request body is not valid JSON for this API: {reason}"}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 422,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
