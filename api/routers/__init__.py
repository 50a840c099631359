"""One router per resource, all under ``/v1`` (health and metrics at the root).

Shared here: the error body (:class:`ErrorMessage`), the error responses every router
documents in the OpenAPI spec, and the role sets routes admit.

What it owns: the HTTP shape of each resource (its routes, request and response
models, status codes and role checks); the work is the node's, behind
:class:`org_node.services.NodeServices`, its database and its catalogs.

What it may import: FastAPI, pydantic and SQLModel/SQLAlchemy, the rest of ``api``
(dependencies, idempotency, settings, the dashboard) and ``org_node`` (models and
repositories, services, run states and policies, the audit report) and
``coordinator_free`` (manifests); nothing imports a router but :mod:`api.app`.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException, status
from pydantic import BaseModel

from org_node.db.models import Role, Run
from org_node.run_store import AmbiguousRun, RunNotFound, resolve_run

__all__ = [
    "ADMIN",
    "AUDIT_READERS",
    "ERRORS",
    "READERS",
    "WRITERS",
    "ErrorMessage",
    "InvalidRequest",
    "conflict",
    "not_found",
    "run_or_404",
    "unprocessable",
]

ADMIN = (Role.ADMIN,)
WRITERS = (Role.ADMIN, Role.OPERATOR)
READERS = (Role.ADMIN, Role.OPERATOR, Role.AUDITOR)
AUDIT_READERS = (Role.ADMIN, Role.AUDITOR)


class ErrorMessage(BaseModel):
    """Every 4xx except validation errors: one readable message."""

    detail: str


class InvalidRequest(BaseModel):
    """422: a readable message, or FastAPI's list of field errors (each names the field
    in ``loc`` and says what is wrong in ``msg``)."""

    detail: str | list[dict[str, Any]]


_ERROR_TEXT: dict[int, str] = {
    400: "Malformed request",
    401: "Missing or invalid credentials",
    403: "The token's role may not do this",
    404: "No such resource",
    409: "Conflict with the resource's current state or version",
    413: "Request body too large",
    429: "Too many failed authentication attempts",
}
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorMessage, "description": text} for code, text in _ERROR_TEXT.items()
}
ERRORS[422] = {"model": InvalidRequest, "description": "Invalid request"}
"""Documented on every protected route (422 is FastAPI's validation error or ours)."""


def not_found(what: str) -> HTTPException:
    return HTTPException(status_code=status.HTTP_404_NOT_FOUND, detail=f"{what} not found")


def conflict(message: str) -> HTTPException:
    return HTTPException(status_code=status.HTTP_409_CONFLICT, detail=message)


def run_or_404(session: Any, ref: str) -> Run:
    """The run ``ref`` names (run key, name, unique key prefix or local id): 404 if none
    does, 409 if a prefix starts several."""
    try:
        return resolve_run(session, ref)
    except RunNotFound:
        raise not_found("run") from None
    except AmbiguousRun as exc:
        raise conflict(str(exc)) from None


def unprocessable(message: str) -> HTTPException:
    """422 with one line saying what is wrong with the request's content."""
    return HTTPException(status_code=status.HTTP_422_UNPROCESSABLE_CONTENT, detail=message)
