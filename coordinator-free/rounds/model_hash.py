"""After the strategy steps: every participant holds the same next model, or the run stops.

``docs/ARCHITECTURE.md``, "A round", step 6. Each node sends the SHA-256 of its next
model to the round's participants (``round.model``) and compares theirs with its own:
any difference raises :class:`~coordinator_free.rounds.results.ModelHashMismatch`,
which stops the run loudly. Whichever backend summed the round (masked or CKKS), the
check is this one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable

from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.rounds.config import RoundConfig
from coordinator_free.rounds.messenger import Messenger
from coordinator_free.rounds.results import ModelHashMismatch
from coordinator_free.rounds.state import Counters
from coordinator_free.rounds.wire import HASH_BYTES, KIND_MODEL
from coordinator_free.wire import Envelope

__all__ = ["ModelHashes"]


class ModelHashes:
    """The model hashes this node sent and received, by ``(run, round)``.

    ``last_done(run)`` is the newest round of ``run`` the round engine finished: a hash
    far from it is refused, and at most 16 rounds' hashes are held.
    """

    def __init__(
        self,
        net: Messenger,
        config: RoundConfig,
        last_done: Callable[[str], int | None],
    ) -> None:
        self.net = net
        self.config = config
        self.last_done = last_done
        self._hashes: dict[tuple[str, int], dict[str, bytes]] = {}
        self._events: dict[tuple[str, int], asyncio.Event] = {}

    async def on_model(self, env: Envelope) -> bytes:
        """A participant's model hash for a round."""
        if len(env.payload) != HASH_BYTES:
            raise Refused(RefusalReason.MALFORMED, "a model hash is 32 bytes")
        last = self.last_done(env.run)
        if last is not None and not last - 8 <= env.round <= last + self.config.lookahead_rounds:
            raise Refused(RefusalReason.STALE, f"model hash of round {env.round} is out of range")
        key = (env.run, env.round)
        hashes = self._hashes.setdefault(key, {})
        if env.sender in hashes:
            raise Refused(RefusalReason.REPLAY, "second model hash for this round")
        hashes[env.sender] = env.payload
        self._events.setdefault(key, asyncio.Event()).set()
        while len(self._hashes) > 16:
            # the first filed goes, whatever its round number: a run that ended with high
            # round numbers must not push out every hash of the next run's low ones
            oldest = next(iter(self._hashes))
            del self._hashes[oldest]
            self._events.pop(oldest, None)
        return b""

    def forget_run(self, run: str) -> None:
        """``run`` ended here: its hashes go."""
        for key in [k for k in self._hashes if k[0] == run]:
            del self._hashes[key]
            self._events.pop(key, None)

    async def publish(self, run: str, round: int, digest: bytes, peers: Iterable[str]) -> set[str]:
        """Send the SHA-256 of this node's next model to ``peers``; return those not reached."""
        if len(digest) != HASH_BYTES:
            raise ValueError("a model hash is a 32-byte SHA-256 digest")
        return await self.net.broadcast(
            Counters(), sorted(set(peers)), KIND_MODEL, digest, run=run, round=round, stage="model"
        )

    async def compare(
        self, run: str, round: int, digest: bytes, peers: Iterable[str], *, timeout: float
    ) -> frozenset[str]:
        """Wait for ``peers``' model hashes; raise :class:`ModelHashMismatch` on any difference.

        Returns the peers whose hash arrived and matched; a peer that sent nothing
        within ``timeout`` is not a mismatch (it may have dropped out).
        """
        key = (run, round)
        wanted = set(peers) - {self.net.org_id}
        event = self._events.setdefault(key, asyncio.Event())
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            event.clear()
            got = self._hashes.get(key, {})
            differing = {o: d for o, d in got.items() if o in wanted and d != digest}
            if differing:
                for org in sorted(differing):
                    self.net.observe("mismatch", run, round, "model", peer=org, detail="model hash")
                raise ModelHashMismatch(run, round, digest, differing)
            if wanted <= got.keys() or loop.time() >= end:
                return frozenset(o for o in wanted if o in got)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), end - loop.time())

    async def check(
        self, run: str, round: int, digest: bytes, peers: Iterable[str], *, timeout: float
    ) -> frozenset[str]:
        """Publish this node's model hash, then compare with the peers' (both above)."""
        peer_set = set(peers) - {self.net.org_id}
        await self.publish(run, round, digest, peer_set)
        return await self.compare(run, round, digest, peer_set, timeout=timeout)
