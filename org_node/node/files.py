"""The node's files that commands read and write without starting a node: the recovery
secret and the manifest chain.

Light on purpose: ``fedweave init``, ``federation sign`` and ``federation install``
import this module, never the node's layers (which import torch).
"""

from __future__ import annotations

import json
from pathlib import Path

from coordinator_free.errors import ManifestError
from coordinator_free.manifest import Manifest, dump_chain, load_chain
from coordinator_free.sealed import (
    RecoverySecret,
    atomic_write,
    open_with_passphrase,
    seal_with_passphrase,
)

from org_node.passphrase import with_hint

__all__ = ["SECRET_FORMAT", "NodeError", "load_secret", "read_chain", "save_secret", "write_chain"]


class NodeError(Exception):
    """The node cannot start or act as asked (the message says why)."""


SECRET_FORMAT = "fedweave-recovery-secret/v1"
"""The format of a passphrase-protected ``recovery.secret`` (a JSON envelope)."""


def save_secret(path: Path, secret: RecoverySecret, passphrase: bytes | None = None) -> None:
    """Write the recovery secret with mode 0600: hex, or with ``passphrase`` a JSON
    envelope, AES-256-GCM under a scrypt key (:func:`seal_with_passphrase`)."""
    if not passphrase:
        atomic_write(path, secret.hex().encode() + b"\n", mode=0o600)
        return
    body = {"format": SECRET_FORMAT} | seal_with_passphrase(
        secret.value, passphrase, SECRET_FORMAT.encode()
    )
    atomic_write(path, json.dumps(body, sort_keys=True).encode() + b"\n", mode=0o600)


def load_secret(path: Path, passphrase: bytes | None = None) -> RecoverySecret:
    """The recovery secret ``save_secret`` wrote; NodeError in one line when it cannot be
    read, or its passphrase is missing or wrong."""
    try:
        text = path.read_text().strip()
        if not text.startswith("{"):
            return RecoverySecret.from_hex(text)
        obj = json.loads(text)
        if not isinstance(obj, dict) or obj.get("format") != SECRET_FORMAT:
            raise ValueError("not a recovery secret envelope")
        value = open_with_passphrase(
            obj, passphrase, SECRET_FORMAT.encode(), what="the recovery secret", error=NodeError
        )
        return RecoverySecret(value)
    except (OSError, ValueError) as exc:
        raise NodeError(with_hint(f"cannot read the recovery secret {path}: {exc}")) from None


def read_chain(path: Path) -> list[Manifest]:
    """Read and verify a manifest chain file."""
    try:
        versions = load_chain(path.read_bytes())
        Manifest.verify_chain(versions)
    except (OSError, ManifestError) as exc:
        raise NodeError(f"cannot use the federation manifest {path}: {exc}") from None
    return versions


def write_chain(path: Path, versions: list[Manifest]) -> None:
    """Write a manifest chain file (readable by every local user, like the manifest)."""
    atomic_write(path, dump_chain(versions), mode=0o644)
