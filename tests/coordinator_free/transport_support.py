"""Shared builders for the transport tests: deterministic identities and envelopes."""

from __future__ import annotations

import hashlib
import time
from dataclasses import replace
from typing import Any

from coordinator_free.identity import OrgIdentity
from coordinator_free.wire import Envelope

FEDERATION = "fed-test"


def identity(org_id: str) -> OrgIdentity:
    """A deterministic identity for ``org_id`` (seed = SHA-256 of the id)."""
    return OrgIdentity.generate(org_id, hashlib.sha256(org_id.encode()).digest())


def signed(sender: OrgIdentity, recipient: str, seq: int, **fields: Any) -> Envelope:
    """An envelope from ``sender`` to ``recipient``, signed; ``fields`` override defaults."""
    env = Envelope(
        federation=fields.pop("federation", FEDERATION),
        run=fields.pop("run", ""),
        round=fields.pop("round", 0),
        stage=fields.pop("stage", ""),
        kind=fields.pop("kind", "echo"),
        sender=fields.pop("sender", sender.org_id),
        recipient=recipient,
        seq=seq,
        sent_at=fields.pop("sent_at", time.time()),
        payload=fields.pop("payload", b"payload"),
    )
    if fields:
        raise TypeError(f"unknown envelope fields {sorted(fields)}")
    return env.with_signature(sender.sign(env.signing_bytes()))


def tampered(env: Envelope, **fields: Any) -> Envelope:
    """``env`` with ``fields`` changed after signing (the signature no longer matches)."""
    return replace(env, **fields)
