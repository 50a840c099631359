"""Where a peer listens and which certificate it must present (:class:`PeerAddress`).

Its own module so that reading a manifest (:mod:`coordinator_free.manifest`) does not
import the TLS transport (httpcore, starlette); :mod:`coordinator_free.tls` re-exports
it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import httpx

__all__ = ["PeerAddress"]

_FINGERPRINT = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class PeerAddress:
    """Where a peer listens and which certificate it must present."""

    url: str
    """Base URL of the peer port, ``https://host:port``."""
    fingerprint: str
    """SHA-256 of the peer's DER certificate, lowercase hex (from the manifest)."""

    def __post_init__(self) -> None:
        try:
            parsed = httpx.URL(self.url)
        except (httpx.InvalidURL, TypeError) as exc:
            raise ValueError(f"invalid peer URL {self.url!r}: {exc}") from None
        if parsed.scheme != "https" or not parsed.host:
            raise ValueError(f"peer URL must be https://host[:port], got {self.url!r}")
        if not _FINGERPRINT.fullmatch(self.fingerprint):
            raise ValueError("fingerprint must be 64 lowercase hex digits")
