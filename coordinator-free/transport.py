"""The transport interface and the receive-side checks every transport shares.

A :class:`Transport` moves opaque bytes: ``request(peer, data)`` returns the peer's
reply bytes. Two implementations exist, HTTPS with mutual TLS between processes
(:mod:`coordinator_free.tls`) and an in-memory network for the simulator and unit tests
(:mod:`coordinator_free.memory`). A raw handler may raise
:class:`~coordinator_free.errors.Refused`; every transport carries the reason back to
the requester, who sees ``Refused(reason)`` too.

:class:`MessageGuard` implements the threat model's message checks (``docs/SECURITY.md``):
a message is refused when it is oversized, malformed, for another federation or
another recipient, from a non-member, badly signed, stale, or replayed. Each refusal
is logged at WARNING with its reason, counted in ``MessageGuard.refusals``, and leaves
every other state untouched (a refused message never advances the replay window).

Sequence numbers are drawn from a counter seeded with the clock in microseconds
(:class:`SequenceCounter`), so a restarted sender continues above the numbers it used
before. A sequence number further ahead of its envelope's send time than
:data:`SEQUENCE_SLACK_US` could not have come from such a counter: it is refused as
stale and does not move the window, so one envelope cannot lock its sender out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol, runtime_checkable

from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.identity import verify_signature
from coordinator_free.wire import Envelope

__all__ = [
    "PROCESS_SEQUENCE",
    "SEQUENCE_SLACK_US",
    "MessageGuard",
    "RawHandler",
    "ReplayWindow",
    "SequenceCounter",
    "Transport",
]

logger = logging.getLogger(__name__)

RawHandler = Callable[[bytes], Awaitable[bytes]]
"""Receives a request's bytes, returns the reply's bytes; may raise ``Refused``."""


@runtime_checkable
class Transport(Protocol):
    """Moves opaque request/reply bytes between orgs."""

    org_id: str

    async def start(self, handler: RawHandler) -> None:
        """Begin serving requests addressed to ``org_id`` with ``handler``."""
        ...

    async def request(self, peer: str, data: bytes, *, timeout: float) -> bytes:
        """Send ``data`` to ``peer`` and return its reply.

        Raises :class:`~coordinator_free.errors.PeerUnreachable`,
        :class:`~coordinator_free.errors.RequestTimeout`,
        :class:`~coordinator_free.errors.Refused` or another
        :class:`~coordinator_free.errors.TransportError`.
        """
        ...

    async def close(self) -> None:
        """Stop serving and release connections."""
        ...


class SequenceCounter:
    """A thread-safe, strictly increasing counter seeded from the clock.

    The seed is the current time in microseconds, so a restarted process starts above
    every number it used before (unless it sent more than a million messages a second).
    """

    def __init__(self, start: int | None = None) -> None:
        self._next = time.time_ns() // 1000 if start is None else start
        if self._next < 0:
            raise ValueError("sequence start must be non-negative")
        self._lock = threading.Lock()

    def next(self) -> int:
        """The next sequence number."""
        with self._lock:
            value = self._next
            self._next += 1
            return value


PROCESS_SEQUENCE = SequenceCounter()
"""The per-process counter every :class:`~coordinator_free.endpoint.Endpoint` draws from."""

SEQUENCE_SLACK_US = 60_000_000
"""How far (in counter steps, microseconds at the seed) a sequence number may lie ahead
of its envelope's send time: a counter runs ahead of the clock only while its process
sends more than a million messages a second."""


def sequence_ceiling(sent_at: float) -> int:
    """The highest sequence number a clock-seeded counter can draw at ``sent_at``."""
    return int(sent_at * 1_000_000) + SEQUENCE_SLACK_US


class ReplayWindow:
    """Per-sender replay protection: highest sequence seen plus a sliding window.

    A sequence number is fresh when it is above the highest seen, or within ``size``
    below it and not seen before (out-of-order delivery). Anything else is a replay.
    """

    def __init__(self, size: int = 4096) -> None:
        if size < 1:
            raise ValueError("replay window size must be positive")
        self.size = size
        self._highest: dict[str, int] = {}
        self._seen: dict[str, set[int]] = {}

    def is_fresh(self, sender: str, seq: int) -> bool:
        """Whether ``seq`` from ``sender`` has not been accepted and is within the window."""
        highest = self._highest.get(sender)
        if highest is None or seq > highest:
            return True
        return seq > highest - self.size and seq not in self._seen[sender]

    def accept(self, sender: str, seq: int) -> None:
        """Record ``seq`` as accepted (call only after ``is_fresh`` and every other check)."""
        seen = self._seen.setdefault(sender, set())
        seen.add(seq)
        highest = self._highest.get(sender)
        if highest is None or seq > highest:
            self._highest[sender] = seq
            if len(seen) > 2 * self.size:
                floor = seq - self.size
                self._seen[sender] = {s for s in seen if s > floor}


class MessageGuard:
    """The receive-side checks shared by every transport.

    ``members()`` maps each current member's org id to its Ed25519 public key; it is
    called on every check so membership changes apply at once. Checks run in order:
    size, format, federation, recipient, membership, signature, staleness (of the send
    time, and of a sequence number ahead of it), replay.
    """

    def __init__(
        self,
        federation: str,
        me: str,
        members: Callable[[], Mapping[str, bytes]],
        *,
        max_size: int,
        max_skew_s: float,
        clock: Callable[[], float] = time.time,
        replay_window: int = 4096,
    ) -> None:
        if max_size <= 0:
            raise ValueError("max_size must be positive")
        if max_skew_s <= 0:
            raise ValueError("max_skew_s must be positive")
        self.federation = federation
        self.me = me
        self.members = members
        self.max_size = max_size
        self.max_skew_s = max_skew_s
        self.clock = clock
        self.refusals: Counter[RefusalReason] = Counter()
        self._replay = ReplayWindow(replay_window)
        self._lock = threading.Lock()
        # the endpoint checks large messages in worker threads: a count of its own, since
        # a replay is refused while ``_lock`` is held
        self._count_lock = threading.Lock()

    def refuse(self, reason: RefusalReason, detail: str) -> Refused:
        """Log and count a refusal; return the exception for the caller to raise."""
        with self._count_lock:
            self.refusals[reason] += 1
        logger.warning("%s refused a message: %s (%s)", self.me, reason.value, detail)
        return Refused(reason, detail)

    def check(self, data: bytes) -> Envelope:
        """Return the verified envelope in ``data``, or raise ``Refused(reason)``."""
        try:
            env = Envelope.from_wire(data, self.max_size)
        except Refused as exc:
            raise self.refuse(exc.reason, exc.detail) from None
        if env.federation != self.federation:
            raise self.refuse(RefusalReason.WRONG_FEDERATION, f"federation {env.federation!r}")
        if env.recipient != self.me:
            raise self.refuse(RefusalReason.WRONG_RECIPIENT, f"recipient {env.recipient!r}")
        key = self.members().get(env.sender)
        if key is None:
            raise self.refuse(RefusalReason.NOT_MEMBER, f"sender {env.sender!r}")
        if not verify_signature(key, env.signing_bytes(), env.signature):
            raise self.refuse(RefusalReason.BAD_SIGNATURE, f"from {env.sender!r}")
        skew = abs(self.clock() - env.sent_at)
        if skew > self.max_skew_s:
            raise self.refuse(RefusalReason.STALE, f"from {env.sender!r}, {skew:.1f}s off")
        if env.seq > sequence_ceiling(env.sent_at):
            raise self.refuse(
                RefusalReason.STALE, f"from {env.sender!r}, seq {env.seq} is ahead of its send time"
            )
        with self._lock:
            if not self._replay.is_fresh(env.sender, env.seq):
                raise self.refuse(RefusalReason.REPLAY, f"from {env.sender!r}, seq {env.seq}")
            self._replay.accept(env.sender, env.seq)
        return env
