"""Gossip of signed chain heads (kind ``audit.head``) between orgs.

Every round each org signs its egress log's head and sends it to the round's peers
(:func:`publish_head`); each peer checks that the head is the sender's own, signed by
the sender's key from the federation's member list, and keeps it in its log
(:func:`serve_heads`, :meth:`~org_node.audit.log.EgressLog.hold_peer_head`). The heads
a peer holds are what :func:`~org_node.audit.verify.verify_records` compares this
org's log with (``docs/SECURITY.md``, "Privacy audit").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping

from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import RefusalReason, Refused, TransportError
from coordinator_free.wire import Envelope

from org_node.audit.log import AuditError, EgressLog, LogFormatError, SignedHead

__all__ = ["HEAD_KIND", "publish_head", "serve_heads"]

HEAD_KIND = "audit.head"


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
            log.hold_peer_head(head, key)
        except AuditError as exc:
            raise Refused(RefusalReason.BAD_SIGNATURE, str(exc)) from None
        return b""

    endpoint.on(HEAD_KIND, on_head)


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
    head = log.sign_head(run, round)
    payload = head.to_bytes()
    failed: set[str] = set()

    async def one(peer: str) -> None:
        try:
            await endpoint.send(
                peer, HEAD_KIND, payload, run=run, round=round, stage="audit", timeout=timeout
            )
        except TransportError:
            failed.add(peer)

    await asyncio.gather(*(one(p) for p in sorted(set(peers) - {endpoint.org_id})))
    return head, failed
