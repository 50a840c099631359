"""The errors of the checkpoint package, and how a failure reads in a reason.

A holder refuses a shard request with a :class:`ShardRequestError` whose ``code``
(``bad_request``, ``quota``, ``not_owner``, ``not_found``) travels in the error reply;
the client raises the same class again from the code (:func:`error_for_code`). The
owner side raises :class:`CheckpointFailed` when a new checkpoint finds too few
holders, recovery :class:`NoCheckpoint` when no reachable peer holds one.
"""

from __future__ import annotations

from coordinator_free.erasure import CorruptShard, ShardError
from coordinator_free.errors import Refused, TransportError

__all__ = [
    "CheckpointFailed",
    "NoCheckpoint",
    "NotOwner",
    "QuotaExceeded",
    "ShardNotFound",
    "ShardRequestError",
    "describe",
    "error_for_code",
]


class ShardRequestError(ShardError):
    """A holder refused or could not serve a shard request; ``code`` says why."""

    code = "bad_request"

    def __init__(self, message: str, code: str | None = None) -> None:
        if code is not None:
            self.code = code
        super().__init__(message)


class QuotaExceeded(ShardRequestError):
    """The holder's per-owner quota would be exceeded."""

    code = "quota"


class NotOwner(ShardRequestError):
    """The requester is not the owner of the set it asks about."""

    code = "not_owner"


class ShardNotFound(ShardRequestError):
    """The holder has no such set, version or shard."""

    code = "not_found"


_BY_CODE: dict[str, type[ShardRequestError]] = {
    c.code: c for c in (ShardRequestError, QuotaExceeded, NotOwner, ShardNotFound)
}


def error_for_code(code: str) -> type[ShardRequestError]:
    """The error class a holder's reply code stands for (the base class if unknown)."""
    return _BY_CODE.get(code, ShardRequestError)


class CheckpointFailed(ShardError):
    """Fewer than ``k`` shards of a new checkpoint could be placed on live peers."""


class NoCheckpoint(ShardError):
    """No reachable peer holds a checkpoint of the requested set."""


def describe(exc: BaseException) -> str:
    """One short reason for a failed shard request, for logs and error messages."""
    if isinstance(exc, Refused):
        return f"refused ({exc.reason.value})"
    if isinstance(exc, TransportError):
        return f"unreachable ({type(exc).__name__})"
    if isinstance(exc, ShardRequestError):
        return f"{exc.code}: {exc}"
    if isinstance(exc, CorruptShard):
        return "corrupt (hash mismatch)"
    return f"{type(exc).__name__}: {exc}"
