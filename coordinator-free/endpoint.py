"""The signed request/reply endpoint that membership, gossip and rounds build on.

``Endpoint.send`` wraps a payload in an :class:`~coordinator_free.wire.Envelope`
(federation, run, round, stage, kind, sender, recipient, seq, sent_at), signs it with
the org's Ed25519 key and hands its bytes to the transport. The receiving endpoint
runs the :class:`~coordinator_free.transport.MessageGuard` checks, dispatches to the
handler registered for the kind and answers with a reply envelope of kind
``KIND.reply``, signed by the receiver, whose payload starts with the SHA-256 of the
request's bytes: the caller verifies the reply with its own guard and checks that
binding, so a reply can be neither forged, replayed, nor swapped between requests.

An optional egress hook (``on_egress``) sees every signed envelope this endpoint is
about to send, request or reply, with its wire bytes, *before* the bytes reach the
transport; the org's audit log records the message there. When the hook raises, the
message is not sent and the exception propagates (fail closed).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.identity import OrgIdentity
from coordinator_free.transport import PROCESS_SEQUENCE, MessageGuard, SequenceCounter, Transport
from coordinator_free.wire import Envelope

__all__ = ["REPLY_SUFFIX", "EgressHook", "Endpoint", "Handler"]

logger = logging.getLogger(__name__)

Handler = Callable[[Envelope], Awaitable[bytes | None]]
"""Handles one verified envelope; returns the reply payload (``None`` for empty)."""

EgressHook = Callable[[Envelope, bytes], None]
"""Sees each outbound signed envelope and its wire bytes before they are sent."""

REPLY_SUFFIX = ".reply"
_DIGEST_SIZE = 32


class Endpoint:
    """An org's signed, replay-protected messaging endpoint over one transport."""

    def __init__(
        self,
        identity: OrgIdentity,
        federation: str,
        transport: Transport,
        members: Callable[[], Mapping[str, bytes]],
        *,
        max_size: int = 64 << 20,
        max_skew_s: float = 300.0,
        clock: Callable[[], float] = time.time,
        sequence: SequenceCounter | None = None,
        on_egress: EgressHook | None = None,
    ) -> None:
        if transport.org_id != identity.org_id:
            raise ValueError(
                f"transport is for {transport.org_id!r}, identity for {identity.org_id!r}"
            )
        self.identity = identity
        self.federation = federation
        self.transport = transport
        self.clock = clock
        self.guard = MessageGuard(
            federation,
            identity.org_id,
            members,
            max_size=max_size,
            max_skew_s=max_skew_s,
            clock=clock,
        )
        self._sequence = sequence or PROCESS_SEQUENCE
        self._handlers: dict[str, Handler] = {}
        self.on_egress = on_egress

    @property
    def org_id(self) -> str:
        """This org's id."""
        return self.identity.org_id

    def on(self, kind: str, handler: Handler) -> None:
        """Register ``handler`` for messages of ``kind`` (one handler per kind)."""
        if kind.endswith(REPLY_SUFFIX):
            raise ValueError(f"kinds ending in {REPLY_SUFFIX!r} are reserved for replies")
        if kind in self._handlers:
            raise ValueError(f"a handler for {kind!r} is already registered")
        self._handlers[kind] = handler

    async def start(self) -> None:
        """Start serving registered handlers."""
        await self.transport.start(self._handle)

    async def close(self) -> None:
        """Stop serving and close the transport."""
        await self.transport.close()

    def _outbound(
        self, peer: str, kind: str, payload: bytes, run: str, round_: int, stage: str
    ) -> bytes:
        """Sign an envelope, show it to the egress hook, and return its wire bytes."""
        env = Envelope(
            federation=self.federation,
            run=run,
            round=round_,
            stage=stage,
            kind=kind,
            sender=self.org_id,
            recipient=peer,
            seq=self._sequence.next(),
            sent_at=float(self.clock()),
            payload=payload,
        )
        signed = env.with_signature(self.identity.sign(env.signing_bytes()))
        wire = signed.to_wire()
        if self.on_egress is not None:
            self.on_egress(signed, wire)
        return wire

    async def send(
        self,
        peer: str,
        kind: str,
        payload: bytes,
        *,
        run: str = "",
        round: int = 0,
        stage: str = "",
        timeout: float = 5.0,
    ) -> bytes:
        """Sign and send a message to ``peer``; return the verified reply payload.

        Raises :class:`~coordinator_free.errors.TransportError` subclasses:
        ``Refused`` when the peer refused the message (or we refused its reply),
        ``PeerUnreachable``, ``RequestTimeout``, ``RemoteError``.
        """
        request = self._outbound(peer, kind, payload, run, round, stage)
        reply_bytes = await self.transport.request(peer, request, timeout=timeout)
        reply = self.guard.check(reply_bytes)
        digest = hashlib.sha256(request).digest()
        if (
            reply.sender != peer
            or reply.kind != kind + REPLY_SUFFIX
            or reply.payload[:_DIGEST_SIZE] != digest
        ):
            raise self.guard.refuse(
                RefusalReason.MALFORMED, f"reply from {reply.sender!r} does not answer {kind!r}"
            )
        return reply.payload[_DIGEST_SIZE:]

    async def _handle(self, data: bytes) -> bytes:
        """The raw handler given to the transport."""
        env = self.guard.check(data)
        handler = self._handlers.get(env.kind)
        if handler is None:
            raise self.guard.refuse(RefusalReason.NO_HANDLER, f"kind {env.kind!r}")
        try:
            result = await handler(env)
        except Refused:
            raise
        except Exception:
            logger.exception("%s: handler for %r failed", self.org_id, env.kind)
            raise
        body = hashlib.sha256(data).digest() + (result or b"")
        return self._outbound(
            env.sender, env.kind + REPLY_SUFFIX, body, env.run, env.round, env.stage
        )
