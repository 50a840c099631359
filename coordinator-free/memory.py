"""An in-memory network of transports, for the simulator and unit tests only.

Every org gets an :class:`InMemoryTransport` from one :class:`InMemoryNetwork`. The
network can delay messages (``latency_s`` each way, plus serialization time at
``bandwidth_bps`` **bits** per second on the sender's uplink, shared by its concurrent
sends), lose them (``loss``, drawn from a seeded RNG), partition the orgs into groups
and kill orgs. A dropped message surfaces at once as
:class:`~coordinator_free.errors.PeerUnreachable`, like a reset connection, so that
simulations do not wait out timeouts; a slow peer surfaces as
:class:`~coordinator_free.errors.RequestTimeout`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Iterable

from coordinator_free.errors import (
    PeerUnreachable,
    Refused,
    RemoteError,
    RequestTimeout,
)
from coordinator_free.transport import RawHandler

__all__ = ["InMemoryNetwork", "InMemoryTransport"]

logger = logging.getLogger(__name__)


class InMemoryNetwork:
    """A simulated network joining :class:`InMemoryTransport` instances."""

    def __init__(
        self,
        *,
        latency_s: float = 0.0,
        bandwidth_bps: float | None = None,
        loss: float = 0.0,
        seed: int = 0,
    ) -> None:
        if latency_s < 0:
            raise ValueError("latency_s must be non-negative")
        if bandwidth_bps is not None and bandwidth_bps <= 0:
            raise ValueError("bandwidth_bps must be positive")
        if not 0.0 <= loss < 1.0:
            raise ValueError("loss must be in [0, 1)")
        self.latency_s = latency_s
        self.bandwidth_bps = bandwidth_bps
        self.loss = loss
        self._rng = random.Random(seed)
        self._handlers: dict[str, RawHandler] = {}
        self._transports: dict[str, InMemoryTransport] = {}
        self._groups: dict[str, int] | None = None
        self._dead: set[str] = set()
        self._uplinks: dict[str, asyncio.Lock] = {}
        self.bytes_sent: Counter[str] = Counter()
        self.messages_sent: Counter[str] = Counter()

    def transport(self, org_id: str) -> InMemoryTransport:
        """The transport of ``org_id`` on this network (one open transport per org)."""
        if org_id in self._transports:
            raise ValueError(f"{org_id!r} already has a transport on this network")
        transport = InMemoryTransport(self, org_id)
        self._transports[org_id] = transport
        return transport

    def partition(self, *groups: Iterable[str]) -> None:
        """Split the orgs into ``groups``; messages between groups are dropped.

        An org named in no group is cut off from everyone. ``heal`` undoes this.
        """
        assignment: dict[str, int] = {}
        for index, group in enumerate(groups):
            for org in group:
                if org in assignment:
                    raise ValueError(f"{org!r} is in more than one partition group")
                assignment[org] = index
        self._groups = assignment

    def heal(self) -> None:
        """Remove every partition."""
        self._groups = None

    def kill(self, org_id: str) -> None:
        """``org_id`` stops answering and sending until :meth:`revive`."""
        self._dead.add(org_id)

    def revive(self, org_id: str) -> None:
        """Undo :meth:`kill`."""
        self._dead.discard(org_id)

    def _linked(self, a: str, b: str) -> bool:
        """Whether the link between ``a`` and ``b`` is up (neither dead, same group)."""
        if a in self._dead or b in self._dead:
            return False
        if self._groups is None:
            return True
        ga, gb = self._groups.get(a), self._groups.get(b)
        return ga is not None and ga == gb

    async def _transmit(self, sender: str, size: int) -> None:
        """Account for and delay one message of ``size`` bytes from ``sender``."""
        self.bytes_sent[sender] += size
        self.messages_sent[sender] += 1
        if self.bandwidth_bps is not None:
            uplink = self._uplinks.setdefault(sender, asyncio.Lock())
            async with uplink:
                await asyncio.sleep(size * 8 / self.bandwidth_bps)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)

    def _lost(self) -> bool:
        return self.loss > 0 and self._rng.random() < self.loss

    async def _deliver(self, sender: str, peer: str, data: bytes) -> bytes:
        if peer not in self._handlers or not self._linked(sender, peer):
            raise PeerUnreachable(f"{peer!r} is unreachable from {sender!r}")
        if self._lost():
            raise PeerUnreachable(f"message from {sender!r} to {peer!r} was lost")
        await self._transmit(sender, len(data))
        handler = self._handlers.get(peer)
        if handler is None or not self._linked(sender, peer):
            raise PeerUnreachable(f"{peer!r} went away")
        try:
            reply = await handler(data)
        except Refused as exc:
            raise Refused(exc.reason) from None
        except Exception as exc:
            logger.exception("handler of %s failed", peer)
            raise RemoteError(f"{peer!r} failed to handle the message") from exc
        if not self._linked(peer, sender) or self._lost():
            raise PeerUnreachable(f"the reply from {peer!r} to {sender!r} was lost")
        await self._transmit(peer, len(reply))
        return reply


class InMemoryTransport:
    """One org's end of an :class:`InMemoryNetwork` (implements ``Transport``)."""

    def __init__(self, network: InMemoryNetwork, org_id: str) -> None:
        self.network = network
        self.org_id = org_id

    async def start(self, handler: RawHandler) -> None:
        """Serve requests addressed to this org."""
        self.network._handlers[self.org_id] = handler

    async def request(self, peer: str, data: bytes, *, timeout: float) -> bytes:
        """Send ``data`` to ``peer``; return its reply (see the module docstring)."""
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        try:
            return await asyncio.wait_for(
                self.network._deliver(self.org_id, peer, bytes(data)), timeout
            )
        except TimeoutError:
            raise RequestTimeout(f"{peer!r} did not answer within {timeout}s") from None

    async def close(self) -> None:
        """Stop serving; requests to this org then fail with ``PeerUnreachable``."""
        self.network._handlers.pop(self.org_id, None)
        if self.network._transports.get(self.org_id) is self:
            del self.network._transports[self.org_id]
