"""How the round engine talks and reports: counted sends, broadcasts, observations.

Every stage sends through one :class:`Messenger`, which counts what a round sends
(:class:`~coordinator_free.rounds.state.Counters`) and reports to the engine's
observers what it saw (:class:`~coordinator_free.rounds.results.RoundObservation`):
an observer that raises is logged and never affects the round.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import RefusalReason, Refused, TransportError
from coordinator_free.rounds.config import RoundConfig
from coordinator_free.rounds.results import Counters, RoundObservation, RoundObserver

from secure_agg.errors import SecAggError

__all__ = ["Messenger", "refusal_kind", "retrieved"]

logger = logging.getLogger(__name__)


def refusal_kind(exc: Refused) -> str:
    """``stale`` for a message of a round already closed on one side or a second copy
    of one (a send retried after a lost reply), else ``refused``."""
    return "stale" if exc.reason in (RefusalReason.STALE, RefusalReason.REPLAY) else "refused"


def retrieved(done: asyncio.Future[Any]) -> None:
    """A done-callback: take the outcome of work the round may end before awaiting (so
    its exception is never reported as not retrieved)."""
    if not done.cancelled():
        done.exception()


class Messenger:
    """Sends for the round engine over its endpoint, and reports what it saw."""

    def __init__(
        self, endpoint: Endpoint, config: RoundConfig, observers: list[RoundObserver]
    ) -> None:
        self.endpoint = endpoint
        self.config = config
        self.observers = observers
        self._background: set[asyncio.Future[Any]] = set()

    @property
    def org_id(self) -> str:
        return self.endpoint.org_id

    # -- observation --------------------------------------------------------------------

    def observe(
        self,
        kind: str,
        run: str,
        round: int,
        stage: str,
        *,
        peer: str = "",
        seconds: float = 0.0,
        bytes: int = 0,
        detail: str = "",
    ) -> None:
        """Report one :class:`RoundObservation` to every observer."""
        if not self.observers:
            return
        obs = RoundObservation(kind, run, round, stage, peer, seconds, bytes, detail)
        for observer in list(self.observers):
            try:
                observer(obs)
            except Exception:  # an observer never affects the round
                logger.exception("%s: round observer failed on %s", self.org_id, kind)

    def arrival(
        self,
        run: str,
        round: int,
        stage: str,
        peer: str,
        size: int,
        *,
        started: float | None,
        at: float | None = None,
    ) -> None:
        """Report that ``peer``'s message of ``stage`` arrived (by request, or in the
        reply to this node's own), in seconds since this node ``started`` the round."""
        if not self.observers:
            return
        now = asyncio.get_running_loop().time() if at is None else at
        since = 0.0 if started is None else now - started
        self.observe("arrival", run, round, stage, peer=peer, seconds=max(0.0, since), bytes=size)

    def accept(
        self,
        receive: Callable[[str, bytes], object],
        sender: str,
        data: bytes,
        what: str,
        run: str = "",
        round: int = -1,
    ) -> bool:
        """Hand one message to the session; a refused one is logged and left out."""
        try:
            receive(sender, data)
        except (SecAggError, ValueError) as exc:
            logger.warning("%s: refused the %s of %s: %s", self.org_id, what, sender, exc)
            self.observe("refused", run, round, what, peer=sender, detail=str(exc))
            return False
        return True

    # -- sending ------------------------------------------------------------------------

    async def send(
        self,
        counters: Counters,
        peer: str,
        kind: str,
        payload: bytes,
        *,
        run: str,
        round: int,
        stage: str,
        timeout: float | None = None,
    ) -> bytes:
        """Send one message and return the reply; transport errors as they come."""
        counters.bytes_sent += len(payload)
        counters.messages_sent += 1
        return await self.endpoint.send(
            peer,
            kind,
            payload,
            run=run,
            round=round,
            stage=stage,
            timeout=timeout or self.config.send_timeout,
        )

    async def broadcast(
        self,
        counters: Counters,
        peers: Iterable[str],
        kind: str,
        payload: bytes | Mapping[str, bytes],
        *,
        run: str,
        round: int,
        stage: str,
        timeout: float | None = None,
        on_reply: Callable[[str, bytes], None] | None = None,
        on_refused: Callable[[str, Refused], None] | None = None,
    ) -> set[str]:
        """Send to every peer at once (``payload``: one for all, or one per peer); return
        the peers that failed to take it. ``on_reply(peer, data)`` gets each non-empty
        reply, ``on_refused(peer, error)`` each refusal."""
        failed: set[str] = set()

        async def one(peer: str) -> None:
            data = payload if isinstance(payload, bytes) else payload[peer]
            try:
                reply = await self.send(
                    counters, peer, kind, data, run=run, round=round, stage=stage, timeout=timeout
                )
                if reply and on_reply is not None:
                    on_reply(peer, reply)
            except TransportError as exc:
                logger.info("%s: %s to %s failed: %s", self.org_id, kind, peer, exc)
                failed.add(peer)
                if on_refused is not None and isinstance(exc, Refused):
                    on_refused(peer, exc)
                self.observe(
                    refusal_kind(exc) if isinstance(exc, Refused) else "unreachable",
                    run,
                    round,
                    stage,
                    peer=peer,
                    detail=f"{type(exc).__name__}: {exc}",
                )

        await asyncio.gather(*(one(p) for p in peers if p != self.org_id))
        return failed

    def spawn(self, work: Awaitable[object]) -> None:
        """Run ``work`` in the background (a reply or a relay that no stage waits for)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
