"""Shared builders for the transport tests: deterministic identities and envelopes."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from coordinator_free.identity import OrgIdentity
from coordinator_free.tls import serve_peer_app
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
def serve_tls(
    app: Any,
    sock: socket.socket,
    identity_dir: Path,
    trust_bundle: Path,
    passphrase: bytes | None = None,
) -> Iterator[None]:
    """Serve ``app`` over mutual TLS on ``sock`` (:func:`serve_peer_app`) in a thread
    with its own event loop; always shut down."""
    listening = threading.Event()
    failures: list[BaseException] = []
    loops: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    async def serve() -> None:
        stop = asyncio.Event()
        loops.append((asyncio.get_running_loop(), stop))
        try:
            async with serve_peer_app(
                app, sock, identity_dir, trust_bundle, passphrase=passphrase, start_timeout_s=20
            ):
                listening.set()
                await stop.wait()
        except BaseException as exc:
            failures.append(exc)
        finally:
            listening.set()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    try:
        if not listening.wait(timeout=30) or failures:
            raise RuntimeError("the TLS test server did not start") from next(iter(failures), None)
        yield
    finally:
        if loops:
            loop, stop = loops[0]
            with contextlib.suppress(RuntimeError):  # the loop has already ended
                loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=20)
        sock.close()
