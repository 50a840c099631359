"""The passphrase that encrypts a node's secrets at rest: from ``--passphrase-file`` or ``FEDWEAVE_PASSPHRASE``.

``fedweave init --passphrase-file FILE`` encrypts the identity key (PKCS#8 under a
scrypt-derived password), the recovery secret and the recovery backup (AES-256-GCM under
a scrypt key); every command that opens them (``run``, ``federation sign``, ``federation
install``, ``recover``, ``audit report``) reads the passphrase the same way:

1. ``--passphrase-file FILE``: the file's bytes, one trailing newline removed;
2. else the environment variable ``FEDWEAVE_PASSPHRASE`` (for automation);
3. else none: the node's files are in clear (``init`` warns), and an encrypted one is
   refused in one line that says how to give the passphrase.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["HOW_TO_GIVE", "PASSPHRASE_ENV", "PassphraseError", "read_passphrase", "with_hint"]

PASSPHRASE_ENV = "FEDWEAVE_PASSPHRASE"
HOW_TO_GIVE = f"give it with --passphrase-file FILE or {PASSPHRASE_ENV}"
_MAX_BYTES = 4096


class PassphraseError(Exception):
    """The passphrase file cannot be used (the message says why)."""


def read_passphrase(file: Path | None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The passphrase: ``file`` first, then ``FEDWEAVE_PASSPHRASE``; None when neither is
    given. An unreadable, empty or oversized file is a :class:`PassphraseError`."""
    if file is not None:
        try:
            with Path(file).open("rb") as fh:
                raw = fh.read(_MAX_BYTES + 1)
        except OSError as exc:
            raise PassphraseError(
                f"cannot read the passphrase file {file}: {exc.strerror}"
            ) from None
        if len(raw) > _MAX_BYTES:
            raise PassphraseError(f"the passphrase file {file} is over {_MAX_BYTES} bytes")
        value = raw.removesuffix(b"\n").removesuffix(b"\r")
        if not value:
            raise PassphraseError(f"the passphrase file {file} is empty")
        return value
    env = os.environ if environ is None else environ
    given = env.get(PASSPHRASE_ENV, "")
    return given.encode("utf-8") if given else None


def with_hint(message: str) -> str:
    """``message``, followed by how to give the passphrase when it is about one."""
    return f"{message} ({HOW_TO_GIVE})" if "passphrase" in message else message
