"""Signed chain heads exchanged between orgs (kinds ``audit.head``, ``audit.heads``).

Each org signs its egress log's head and sends it to every member
(:func:`publish_head`); each peer checks that the head is the sender's own, signed by
the sender's key from the federation's member list, and keeps it in its log
(:func:`serve_heads`, :meth:`~org_node.audit.log.EgressLog.hold_peer_head`). A member
may ask a peer for the heads of its own log that the peer holds (``audit.heads``,
:func:`fetch_heads`). The heads peers hold are what
:func:`~org_node.audit.verify.verify_records` compares this org's log with
(``docs/SECURITY.md``, "Privacy audit"): entries cut from the end of a log, or a log
rewritten, no longer match the last head peers hold.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Mapping

from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import RefusalReason, Refused, TransportError
from coordinator_free.peer_json import loads_bounded
from coordinator_free.wire import Envelope

from org_node.audit.log import AuditError, EgressLog, LogFormatError, SignedHead

__all__ = ["HEADS_KIND", "HEAD_KIND", "fetch_heads", "publish_head", "send_head", "serve_heads"]

HEAD_KIND = "audit.head"
HEADS_KIND = "audit.heads"
MAX_HEADS_REPLY = 4096
"""The newest heads of the asker's log a peer answers with, at most."""


def serve_heads(
    endpoint: Endpoint, log: EgressLog, members: Callable[[], Mapping[str, bytes]]
) -> None:
    """Register the ``audit.head`` handler: keep each peer's valid head of its own log."""

    async def on_head(env: Envelope) -> bytes:
        try:
            head = SignedHead.from_bytes(env.payload)
        except LogFormatError as exc:
            raise Refused(RefusalReason.MALFORMED, str(exc)) from None
        if head.org != env.sender:
            raise Refused(RefusalReason.MALFORMED, f"{env.sender!r} sent a head of {head.org!r}")
        key = members().get(head.org)
        if key is None:
            raise Refused(RefusalReason.NOT_MEMBER, f"{head.org!r} is not a member")
        try:
            await asyncio.to_thread(log.hold_peer_head, head, key)  # it fsyncs
        except AuditError as exc:
            raise Refused(RefusalReason.BAD_SIGNATURE, str(exc)) from None
        return b""

    async def on_heads(env: Envelope) -> bytes:
        if env.sender not in members():
            raise Refused(RefusalReason.NOT_MEMBER, f"{env.sender!r} is not a member")
        held = [h for h in log.peer_heads if h.org == env.sender][-MAX_HEADS_REPLY:]
        return json.dumps([h.to_dict() for h in held], separators=(",", ":")).encode()

    endpoint.on(HEAD_KIND, on_head)
    endpoint.on(HEADS_KIND, on_heads)


async def publish_head(
    endpoint: Endpoint,
    log: EgressLog,
    run: str,
    round: int,
    peers: Iterable[str],
    *,
    timeout: float = 5.0,
) -> tuple[SignedHead, set[str]]:
    """Sign the head for ``(run, round)`` and send it to ``peers``; return it and the misses.

    The head covers every message sent before it; the ``audit.head`` messages
    themselves are logged after it and are covered by the next head.
    """
    head = await asyncio.to_thread(log.sign_head, run, round)  # it fsyncs
    return head, await send_head(endpoint, head, peers, timeout=timeout)


async def send_head(
    endpoint: Endpoint, head: SignedHead, peers: Iterable[str], *, timeout: float = 5.0
) -> set[str]:
    """Send a signed head of this org's log to ``peers``; those it did not reach."""
    payload = head.to_bytes()
    failed: set[str] = set()

    async def one(peer: str) -> None:
        try:
            await endpoint.send(
                peer,
                HEAD_KIND,
                payload,
                run=head.run,
                round=head.round,
                stage="audit",
                timeout=timeout,
            )
        except TransportError:
            failed.add(peer)

    await asyncio.gather(*(one(p) for p in sorted(set(peers) - {endpoint.org_id})))
    return failed


async def fetch_heads(
    endpoint: Endpoint,
    peers: Iterable[str],
    public_key: bytes,
    *,
    timeout: float = 10.0,
) -> tuple[list[SignedHead], dict[str, str]]:
    """The heads of this org's log that ``peers`` hold (each signature checked against
    ``public_key``), and why each peer that gave none did not answer."""
    heads: list[SignedHead] = []
    missed: dict[str, str] = {}

    async def one(peer: str) -> None:
        try:
            reply = await endpoint.send(peer, HEADS_KIND, b"", stage="audit", timeout=timeout)
            for raw in loads_bounded(reply, what="audit heads"):
                head = SignedHead.from_dict(raw)
                if head.org == endpoint.org_id and head.verify(public_key):
                    heads.append(head)
        except (TransportError, LogFormatError, ValueError, TypeError) as exc:
            missed[peer] = str(exc) or type(exc).__name__

    await asyncio.gather(*(one(p) for p in sorted(set(peers) - {endpoint.org_id})))
    return sorted(heads, key=lambda h: h.index), missed
