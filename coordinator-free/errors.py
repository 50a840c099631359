"""Exceptions of the coordinator-free layer.

The tree is narrow on purpose: callers of :class:`~coordinator_free.endpoint.Endpoint`
catch :class:`TransportError` and branch on the subclass. A refusal carries the
receiver's :class:`RefusalReason`; it is never retried, unlike a connection failure.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "CoordinatorFreeError",
    "IdentityError",
    "ManifestError",
    "PeerUnreachable",
    "RefusalReason",
    "Refused",
    "RemoteError",
    "RequestTimeout",
    "TransportError",
    "UntrustedPeer",
]


class RefusalReason(StrEnum):
    """Why a receiver refused a message (the threat model's "refused" cases)."""

    REPLAY = "replay"
    STALE = "stale"
    NOT_MEMBER = "not_member"
    BAD_SIGNATURE = "bad_signature"
    MALFORMED = "malformed"
    OVERSIZED = "oversized"
    WRONG_FEDERATION = "wrong_federation"
    WRONG_RECIPIENT = "wrong_recipient"
    NO_HANDLER = "no_handler"
    NOT_ADMITTED = "not_admitted"
    QUOTA = "quota"


class CoordinatorFreeError(Exception):
    """Base of every error raised by ``coordinator_free``."""


class TransportError(CoordinatorFreeError):
    """A request did not produce a verified reply."""


class PeerUnreachable(TransportError):
    """The peer could not be reached (connection refused or reset, partition, dead)."""


class RequestTimeout(TransportError):
    """The peer did not answer within the request's timeout."""


class UntrustedPeer(TransportError):
    """The peer's TLS certificate does not match the fingerprint pinned in the manifest."""


class RemoteError(TransportError):
    """The peer accepted the message but its handler failed."""


class Refused(TransportError):
    """A message was refused, by the peer (on send) or by us (on a reply).

    ``reason`` says why; ``detail`` is a human-readable note for logs only and is
    never sent over the wire.
    """

    def __init__(self, reason: RefusalReason, detail: str = "") -> None:
        self.reason = RefusalReason(reason)
        self.detail = detail
        message = f"refused ({self.reason.value})"
        super().__init__(f"{message}: {detail}" if detail else message)


class IdentityError(CoordinatorFreeError):
    """An identity key or certificate is missing, unreadable or inconsistent."""


class ManifestError(CoordinatorFreeError):
    """A federation manifest version is invalid: no quorum, broken chain, forged or
    foreign signature."""
