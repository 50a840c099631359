"""Shared builders for the transport tests: deterministic identities and envelopes."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import uvicorn
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


def bound_socket() -> socket.socket:
    """A TCP socket bound to a free port on 127.0.0.1, not yet listening."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def serve_tls(app: Any, sock: socket.socket, ssl_options: dict[str, Any]) -> Iterator[None]:
    """Serve ``app`` with uvicorn over TLS on ``sock`` in a thread; always shut down."""
    config = uvicorn.Config(app, lifespan="off", ws="none", log_level="warning", **ssl_options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the TLS test server did not start")
            time.sleep(0.01)
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        sock.close()
