"""Exception hierarchy of :mod:`secure_agg`.

Every error raised by the library derives from :class:`SecAggError`. Errors about
caller-supplied values also derive from :class:`ValueError`, so that code written
against the standard library keeps working. :class:`DecryptionError` is the one
opaque error at a trust boundary: its message never says why decryption failed.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DecryptionError",
    "ProtocolError",
    "RingError",
    "SecAggError",
    "ShareError",
]


class SecAggError(Exception):
    """Root of every error raised by :mod:`secure_agg`."""


class ConfigError(SecAggError, ValueError):
    """Invalid parameters; the message names the parameter to change."""


class RingError(SecAggError, ValueError):
    """An array has the wrong dtype, shape, length or ring width, or holds NaN/Inf."""


class ShareError(SecAggError):
    """Shamir shares are too few, duplicated, malformed, inconsistent or wrong."""


class DecryptionError(SecAggError):
    """Authenticated decryption failed (wrong key, nonce, AAD or a tampered blob).

    The message is deliberately opaque: it never reveals which check failed.
    """


class ProtocolError(SecAggError):
    """Base class of errors raised by the secure aggregation protocol state machines."""
