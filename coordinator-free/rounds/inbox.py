"""The messages of one round, filed by key and sender, and the waits on them.

Every handler files what it takes under a key (``("ready",)``, ``("view", tag,
attempt)``, ...); the stages wait until what they need is filed or a deadline
passes. A wait names the key and the senders it expects, which is what
:meth:`Inbox.missing` reports (:meth:`~coordinator_free.rounds.RoundEngine.progress`).

What peers make an inbox keep is bounded (:class:`InboxLimits`): each message costs
its payload plus :data:`ENTRY_OVERHEAD` bytes against its sender's share and the
round's; a message past either cap is refused as ``Refused(OVERSIZED)`` and not kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass

from coordinator_free.errors import RefusalReason, Refused

__all__ = ["ENTRY_OVERHEAD", "Inbox", "InboxLimits"]

ENTRY_OVERHEAD = 256
"""What one kept message costs beyond its payload (its key, sender and dict slots)."""


@dataclass(frozen=True)
class InboxLimits:
    """Bytes one round's inbox keeps from peers: per sender, and in all.

    A sender's share of a round (its ready, shares, views, tokens, releases and seeds)
    is a few hundred bytes per member; 8 MiB holds that for thousands of members.
    """

    per_sender: int = 8 << 20
    per_round: int = 256 << 20


_EMPTY: dict[str, bytes] = {}


class Inbox:
    """Messages of one round by key and sender; first message per (key, sender) wins."""

    def __init__(self, owner: str = "", limits: InboxLimits | None = None) -> None:
        self.owner = owner
        self.limits = limits or InboxLimits()
        self._held: Counter[str] = Counter()
        self._total = 0  # the sum of ``_held``, kept as it grows (not summed per message)
        self._items: dict[tuple[str, ...], dict[str, bytes]] = {}
        self._events: dict[tuple[str, ...], asyncio.Event] = {}
        # what the round waits for now: an inbox key and whose message under it
        self.awaiting: tuple[tuple[str, ...], frozenset[str]] | None = None

    def missing(self) -> tuple[str, ...]:
        """The senders the current wait still expects (sorted); () when none."""
        if self.awaiting is None:
            return ()
        key, wanted = self.awaiting
        return tuple(sorted(wanted - self.senders(key)))

    def held(self, sender: str | None = None) -> int:
        """The bytes kept from ``sender`` (from every peer when ``None``)."""
        return self._total if sender is None else self._held[sender]

    def put(self, key: tuple[str, ...], sender: str, payload: bytes) -> bool:
        """File ``payload``; ``False`` when ``sender`` filed under ``key`` already.

        Raises ``Refused(OVERSIZED)`` (and keeps nothing) when a peer's message would
        take its sender or the round past :class:`InboxLimits`; this node's own
        messages (``owner``) are not counted.
        """
        box = self._items.get(key)
        if box is not None and sender in box:
            return False
        if sender != self.owner:
            cost = len(payload) + ENTRY_OVERHEAD
            if self._held[sender] + cost > self.limits.per_sender:
                raise Refused(
                    RefusalReason.OVERSIZED,
                    f"{sender!r} would have more than {self.limits.per_sender} bytes kept "
                    "in this round",
                )
            if self._total + cost > self.limits.per_round:
                raise Refused(
                    RefusalReason.OVERSIZED,
                    f"the round would keep more than {self.limits.per_round} bytes",
                )
            self._held[sender] += cost
            self._total += cost
        box = self._items.setdefault(key, {})
        box[sender] = payload
        event = self._events.get(key)
        if event is None:  # made once per key, not once per message
            event = self._events[key] = asyncio.Event()
        event.set()
        return True

    def get(self, key: tuple[str, ...]) -> dict[str, bytes]:
        return dict(self._items.get(key, {}))

    def item(self, key: tuple[str, ...], sender: str) -> bytes | None:
        return self._items.get(key, _EMPTY).get(sender)

    def since(self, key: tuple[str, ...], start: int) -> list[tuple[str, bytes]]:
        """The messages filed under ``key`` after the first ``start``, in arrival order."""
        return list(itertools.islice(self._items.get(key, _EMPTY).items(), start, None))

    def senders(self, key: tuple[str, ...]) -> Set[str]:
        """The senders filed under ``key`` so far: a live view, not a copy (checks run
        on every arrival, so copying the box each time would cost ``O(n)`` apiece)."""
        return self._items.get(key, _EMPTY).keys()

    async def wait_any(
        self,
        keys: Iterable[tuple[str, ...]],
        done: Callable[[], bool],
        deadline: float,
        expect: tuple[tuple[str, ...], Iterable[str]] | None = None,
    ) -> None:
        """Wait until ``done()`` holds, checked whenever one of ``keys`` gets a message;
        ``expect`` (an inbox key and its senders) is what :meth:`missing` reports."""
        if expect is not None:
            self.awaiting = (expect[0], frozenset(expect[1]))
        events = [self._events.setdefault(k, asyncio.Event()) for k in keys]
        loop = asyncio.get_running_loop()
        while True:
            for event in events:
                event.clear()
            remaining = deadline - loop.time()
            if done() or remaining <= 0:
                return
            waiters = [asyncio.ensure_future(e.wait()) for e in events]
            try:
                await asyncio.wait(waiters, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()

    async def wait(
        self, key: tuple[str, ...], senders: Iterable[str], deadline: float
    ) -> dict[str, bytes]:
        """What ``senders`` posted under ``key`` once all did, or at ``deadline`` (loop time)."""
        wanted = set(senders)
        self.awaiting = (key, frozenset(wanted))
        event = self._events.setdefault(key, asyncio.Event())
        loop = asyncio.get_running_loop()
        while True:
            event.clear()
            box = self._items.get(key, {})
            if wanted <= box.keys():
                break
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), remaining)
        box = self._items.get(key, {})
        return {s: box[s] for s in wanted if s in box}
