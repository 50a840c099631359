"""The sums a member serves to the others, and fetches from them, when a ring breaks.

``docs/ARCHITECTURE.md``, "A round", steps 4 and 5. ``round.total``: a member whose
ring completed keeps the masked sum of the attempt, and a member whose ring broke
takes it from one that holds it, piece by piece, instead of running the ring again
(:meth:`SumServer.fetch_total`). ``round.part``: with owner unmasking, a member keeps
the chunks of the unmasked sum it holds, and a member whose all-gather broke takes
each chunk it lacks from its owner, else from the successor that holds its copy
(:meth:`SumServer.fetch_parts`), so a death after the agreement loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from coordinator_free.errors import RefusalReason, Refused, TransportError
from coordinator_free.ring import Scattered
from coordinator_free.rounds.config import RoundConfig
from coordinator_free.rounds.messenger import Messenger
from coordinator_free.rounds.results import RoundFailed
from coordinator_free.rounds.state import (
    Counters,
    RoundState,
    RoundTable,
    forget_run,
    keep_latest,
)
from coordinator_free.rounds.wire import KIND_PART, KIND_TOTAL, PART_REQUEST, TOTAL_REQUEST
from coordinator_free.wire import Envelope

__all__ = ["PIECE_BYTES", "SumServer"]

PIECE_BYTES = 8 << 20
"""The largest piece of a sum one ``round.total`` or ``round.part`` reply carries."""


class _BadPiece(ValueError):
    """A member answered a piece request with the wrong number of bytes."""


@dataclass
class _Parts:
    """The chunks of a round's unmasked sum a node holds (owner unmasking)."""

    attempt: int
    members: frozenset[str]
    scattered: Scattered

    def holds(self, index: int) -> bool:
        return index in self.scattered.filled


class SumServer:
    """The sums this node serves to members whose ring broke, and fetches from others.

    ``round.total``: the masked sum of this node's latest completed ring attempt, for a
    member whose ring broke after another's completed. ``round.part``: with owner
    unmasking, the chunks of the unmasked sum this node holds, for a member whose
    all-gather broke. Each is kept for the latest round of each run only, so a node
    holds one vector more than the round itself needs.
    """

    def __init__(self, net: Messenger, table: RoundTable, config: RoundConfig) -> None:
        self.net = net
        self.table = table
        self.config = config
        self._totals: dict[tuple[str, int], tuple[int, frozenset[str], np.ndarray]] = {}
        self._total_events: dict[tuple[str, int], asyncio.Event] = {}
        self._parts: dict[tuple[str, int], _Parts] = {}
        self._part_events: dict[tuple[str, int], asyncio.Event] = {}

    def forget_waits(self, run: str, round: int) -> None:
        """The round ended: nobody waits any more for a sum it never kept."""
        if (run, round) not in self._totals:
            self._total_events.pop((run, round), None)
        if (run, round) not in self._parts:
            self._part_events.pop((run, round), None)

    def forget_run(self, run: str) -> None:
        """``run`` ended here: its kept sums go."""
        forget_run(self._totals, self._total_events, run)
        forget_run(self._parts, self._part_events, run)

    # -- round.total --------------------------------------------------------------------

    async def on_total(self, env: Envelope) -> bytes:
        """A piece of this node's masked sum of a completed ring attempt, for a member
        whose ring broke: ``(attempt, lo, hi)`` in, the elements ``[lo, hi)`` out."""
        try:
            attempt, lo, hi = TOTAL_REQUEST.unpack(env.payload)
        except struct.error:
            raise Refused(RefusalReason.MALFORMED, "a sum request is (attempt, lo, hi)") from None
        key = (env.run, env.round)
        held = self._totals.get(key)
        if held is None and key in self.table.running:
            state = self.table.get(env.run, env.round)
            decided = state.agreement.decided if state is not None else {}
            if decided.get(f"reduce:{attempt}", ((), False))[1]:
                # settled as completed, still taking the sum from another member
                event = self._total_events.setdefault(key, asyncio.Event())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), self.config.step_timeout)
                held = self._totals.get(key)
        if held is None or held[0] != attempt:
            raise Refused(RefusalReason.STALE, f"no completed sum of ring attempt {attempt} here")
        if env.sender not in held[1]:
            raise Refused(
                RefusalReason.NOT_MEMBER, f"{env.sender!r} is not in ring attempt {attempt}"
            )
        total = held[2]
        if not lo < hi <= len(total) or (hi - lo) * total.itemsize > PIECE_BYTES:
            raise Refused(RefusalReason.MALFORMED, f"sum piece [{lo}, {hi}) out of range")
        return total[lo:hi].tobytes()

    def keep_total(
        self, run: str, round: int, attempt: int, members: frozenset[str], total: np.ndarray
    ) -> None:
        """Keep a completed attempt's masked sum for its members whose ring broke (the
        session unmasks into a new array and leaves ``total`` as it is)."""
        keep_latest(self._totals, self._total_events, run, round, (attempt, members, total))

    async def fetch_total(
        self,
        state: RoundState,
        counters: Counters,
        tag: str,
        attempt: int,
        like: np.ndarray,
        *,
        into: bool = False,
    ) -> np.ndarray:
        """The masked sum of ring attempt ``attempt`` from a member that holds it (its
        ring completed, or it took the sum already), piece by piece: in a new array
        like ``like``, or with ``into`` in ``like`` itself (a vector the broken ring
        left holding partial sums)."""
        total = like if into else np.empty_like(like)
        for org in sorted(state.agreement.completers.get(tag, set()) - {self.net.org_id}):
            request = functools.partial(TOTAL_REQUEST.pack, attempt)
            try:
                await self._take_pieces(
                    state, counters, org, KIND_TOTAL, request, total, (0, len(total)), tag
                )
            except (TransportError, _BadPiece) as exc:
                self.net.observe(
                    "unreachable", state.run, state.round, "reduce", peer=org, detail=str(exc)
                )
                continue
            self.net.observe(
                "retry",
                state.run,
                state.round,
                "reduce",
                peer=org,
                detail="took the masked sum from a member whose ring completed",
            )
            return total
        raise RoundFailed(
            "reduce", "the ring completed elsewhere, but no member could send its sum here"
        )

    # -- round.part ---------------------------------------------------------------------

    async def on_part(self, env: Envelope) -> bytes:
        """A piece of a chunk of this node's unmasked sum (owner unmasking), for a member
        whose all-gather broke: ``(attempt, chunk, lo, hi)`` in, elements ``[lo, hi)``
        of that chunk out. A node still unmasking is waited for, up to a stage."""
        try:
            attempt, index, lo, hi = PART_REQUEST.unpack(env.payload)
        except struct.error:
            raise Refused(
                RefusalReason.MALFORMED, "a part request is (attempt, chunk, lo, hi)"
            ) from None
        key = (env.run, env.round)
        parts = self._parts.get(key)
        if parts is None and key in self.table.running:
            event = self._part_events.setdefault(key, asyncio.Event())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), self.config.stage_timeout)
            parts = self._parts.get(key)
        if parts is None or parts.attempt != attempt:
            raise Refused(RefusalReason.STALE, f"no unmasked sum of ring attempt {attempt} here")
        if env.sender not in parts.members:
            raise Refused(
                RefusalReason.NOT_MEMBER, f"{env.sender!r} is not in ring attempt {attempt}"
            )
        bounds = parts.scattered.bounds
        if index >= len(bounds):
            raise Refused(RefusalReason.MALFORMED, f"no chunk {index} in {len(bounds)}")
        if not parts.holds(index):
            raise Refused(RefusalReason.STALE, f"chunk {index} of the sum is not held here")
        clo, chi = bounds[index]
        acc = parts.scattered.acc
        if not clo <= lo < hi <= chi or (hi - lo) * acc.itemsize > PIECE_BYTES:
            raise Refused(RefusalReason.MALFORMED, f"part [{lo}, {hi}) is not in chunk {index}")
        return acc[lo:hi].tobytes()

    def keep_parts(
        self, run: str, round: int, attempt: int, members: frozenset[str], scattered: Scattered
    ) -> None:
        """Serve the unmasked chunks of ``scattered`` (those it holds, growing as the
        all-gather fills it) to the attempt's members."""
        keep_latest(self._parts, self._part_events, run, round, _Parts(attempt, members, scattered))

    async def fetch_parts(
        self,
        state: RoundState,
        counters: Counters,
        order: list[str],
        attempt: int,
        scattered: Scattered,
    ) -> None:
        """Fill the chunks of ``scattered`` that a broken all-gather left empty, each from
        its owner, else the successor that holds its copy, else any member that
        gathered it; :class:`RoundFailed` when no member can send one."""
        n = len(order)
        for index in range(n):
            if index in scattered.filled:
                continue
            owner = (index - 1) % n
            holders = [order[(owner + i) % n] for i in range(n)]
            for org in [o for o in holders if o != self.net.org_id]:
                if await self._fetch_chunk(state, counters, org, attempt, index, scattered):
                    break
            else:
                raise RoundFailed(
                    "gather",
                    f"chunk {index} of the sum is lost: neither its owner {holders[0]} nor "
                    f"{holders[1]}, which held its copy, nor any other member could send it",
                )

    async def _fetch_chunk(
        self,
        state: RoundState,
        counters: Counters,
        org: str,
        attempt: int,
        index: int,
        scattered: Scattered,
    ) -> bool:
        """Chunk ``index`` of the sum from ``org``; whether it came."""
        run, rnd = state.run, state.round
        request = functools.partial(PART_REQUEST.pack, attempt, index)
        try:
            await self._take_pieces(
                state,
                counters,
                org,
                KIND_PART,
                request,
                scattered.acc,
                scattered.bounds[index],
                "gather",
            )
        except Refused:
            return False  # alive, but it does not hold that chunk: no fault of its
        except _BadPiece as exc:
            self.net.observe("refused", run, rnd, "gather", peer=org, detail=str(exc))
            return False
        except TransportError as exc:
            self.net.observe("unreachable", run, rnd, "gather", peer=org, detail=str(exc))
            return False
        scattered.filled.add(index)
        self.net.observe(
            "retry",
            run,
            rnd,
            "gather",
            peer=org,
            detail=f"took chunk {index} of the sum from a member that holds it",
        )
        return True

    async def _take_pieces(
        self,
        state: RoundState,
        counters: Counters,
        org: str,
        kind: str,
        request: Callable[[int, int], bytes],
        into: np.ndarray,
        span: tuple[int, int],
        stage: str,
    ) -> None:
        """Fill ``into[lo:hi]`` (``span``) from ``org``'s answers to ``request(start,
        stop)``, in pieces of at most :data:`PIECE_BYTES`; :class:`_BadPiece` when an
        answer has the wrong size, a transport error as it comes."""
        lo, hi = span
        step = max(1, PIECE_BYTES // into.itemsize)
        for start in range(lo, hi, step):
            stop = min(hi, start + step)
            piece = await self.net.send(
                counters,
                org,
                kind,
                request(start, stop),
                run=state.run,
                round=state.round,
                stage=stage,
            )
            if len(piece) != (stop - start) * into.itemsize:
                raise _BadPiece(f"{kind}: a piece [{start}, {stop}) of the wrong size")
            into[start:stop] = np.frombuffer(piece, dtype=into.dtype)
