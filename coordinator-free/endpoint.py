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

Large messages leave the event loop alone. An envelope whose payload is at least
:data:`OFF_LOOP_BYTES` (a ring frame of a large update: up to 16 MiB) is encoded,
signed, shown to the egress hook and hashed in a worker thread, and a received message
of that size is checked (parsed, its signature verified) and hashed there too: at
16 MiB that is about 70 ms of copying and hashing for a send and 35 ms for a receipt,
which on the loop would stall every other message, read and timer of the node. The
sequence number is still taken on the loop, in the order of the sends; the guard's
replay window accepts messages that arrive out of that order, as the network may
deliver them anyway. The hook may therefore be called from a worker thread and must
be safe to call from one (the audit log takes its own lock).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.identity import OrgIdentity
from coordinator_free.transport import PROCESS_SEQUENCE, MessageGuard, SequenceCounter, Transport
from coordinator_free.wire import Envelope

__all__ = ["OFF_LOOP_BYTES", "REPLY_SUFFIX", "EgressHook", "Endpoint", "Handler"]

logger = logging.getLogger(__name__)

Handler = Callable[[Envelope], Awaitable[bytes | None]]
"""Handles one verified envelope; returns the reply payload (``None`` for empty)."""

EgressHook = Callable[[Envelope, bytes], None]
"""Sees each outbound signed envelope and its wire bytes before they are sent; called
from a worker thread for a payload of :data:`OFF_LOOP_BYTES` or more."""

_A = TypeVar("_A")
_R = TypeVar("_R")

REPLY_SUFFIX = ".reply"
_DIGEST_SIZE = 32

#: Payloads of at least this many bytes are signed, checked and hashed off the event
#: loop. Below it the work (2.4 ms to sign a MiB here) costs little more than the hop
#: to a worker thread and back.
OFF_LOOP_BYTES = 1 << 20


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

    def is_member(self, org: str) -> bool:
        """Whether ``org`` is a member now: the endpoint refuses every message of one
        that is not, so nothing should wait for one."""
        return org in self.guard.members()

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

    def _envelope(
        self, peer: str, kind: str, payload: bytes, run: str, round_: int, stage: str
    ) -> Envelope:
        """An unsigned envelope for ``peer``, with the next sequence number."""
        return Envelope(
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

    def _seal(self, env: Envelope) -> bytes:
        """Sign ``env``, show it to the egress hook, and return its wire bytes."""
        signed = env.with_signature(self.identity.sign(env.signing_bytes()))
        wire = signed.to_wire()
        if self.on_egress is not None:
            self.on_egress(signed, wire)
        return wire

    def _seal_and_digest(self, env: Envelope) -> tuple[bytes, bytes]:
        """:meth:`_seal`, and the SHA-256 of the wire bytes (a request's reply carries it)."""
        wire = self._seal(env)
        return wire, hashlib.sha256(wire).digest()

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
        env = self._envelope(peer, kind, payload, run, round, stage)
        request, digest = await _off_loop_if_large(len(payload), self._seal_and_digest, env)
        reply_bytes = await self.transport.request(peer, request, timeout=timeout)
        reply = await _off_loop_if_large(len(reply_bytes), self.guard.check, reply_bytes)
        if (
            reply.sender != peer
            or reply.kind != kind + REPLY_SUFFIX
            or reply.payload[:_DIGEST_SIZE] != digest
        ):
            raise self.guard.refuse(
                RefusalReason.MALFORMED, f"reply from {reply.sender!r} does not answer {kind!r}"
            )
        return reply.payload[_DIGEST_SIZE:]

    def _check_and_digest(self, data: bytes) -> tuple[Envelope, bytes]:
        return self.guard.check(data), hashlib.sha256(data).digest()

    async def _handle(self, data: bytes) -> bytes:
        """The raw handler given to the transport."""
        env, digest = await _off_loop_if_large(len(data), self._check_and_digest, data)
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
        body = digest + (result or b"")
        reply = self._envelope(
            env.sender, env.kind + REPLY_SUFFIX, body, env.run, env.round, env.stage
        )
        return await _off_loop_if_large(len(body), self._seal, reply)


async def _off_loop_if_large(size: int, job: Callable[[_A], _R], arg: _A) -> _R:
    """``job(arg)``: in a worker thread for a message of :data:`OFF_LOOP_BYTES` or more,
    on the loop otherwise."""
    if size >= OFF_LOOP_BYTES:
        return await asyncio.to_thread(job, arg)
    return job(arg)
