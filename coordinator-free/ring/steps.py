"""The steps of the ring variants, as one member takes them over its :class:`Link`.

A ring step sends one chunk to the successor while it receives another from the
predecessor (:func:`ring_step`); :func:`reduce_scatter` and :func:`all_gather` are the
``n - 1`` steps of each half of the bandwidth-optimal all-reduce (or the part of them
a variant runs). :func:`chain` sums a short vector along the ring order and passes the
total on; :func:`star` sums through one hub. Each works in place on ``acc``, the
member's copy of the vector, and raises :class:`RingBroken` on a failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from coordinator_free.ring.link import Link, RingBroken
from coordinator_free.ring.wire import (
    PHASE_CHAIN_BROADCAST,
    PHASE_CHAIN_REDUCE,
    PHASE_GATHER,
    PHASE_SCATTER,
    PHASE_STAR_DOWN,
    PHASE_STAR_UP,
    PHASE_SUM,
    chunk_bounds,
)

__all__ = [
    "InputFeed",
    "LostHook",
    "Place",
    "RingBroken",
    "StepHook",
    "all_gather",
    "chain",
    "reduce_scatter",
    "ring_step",
    "star",
]

StepHook = Callable[[str, int], Awaitable[None]]
"""``on_step(phase, step)``, awaited before each step (``"scatter"`` or ``"gather"``)."""

LostHook = Callable[[int], Awaitable[None]]
"""``on_lost(step)``: the all-gather's send to the successor failed at ``step`` (1 or later)."""


class InputFeed(Protocol):
    """A part of a member's input that arrives while its ring runs (the masks a helper
    process expands, :mod:`coordinator_free.rounds.mask_helper`), chunk by chunk in the
    order the reduce-scatter first sends them. The ring adds chunk ``c``'s part to the
    vector it sums (``acc``) with :meth:`add` just before the chunk first leaves this
    member (or, for the chunk it reduces last, before the reduce-scatter returns), so
    every chunk carries it when it is sent and nothing is added twice. A ring whose
    chunks are not the feed's (another member set, a chain, a star) takes the whole of
    it with :meth:`add_all` before it starts."""

    def fits(self, bounds: Sequence[tuple[int, int]]) -> bool:
        """Whether the feed's chunks are ``bounds`` (the ring's)."""
        ...

    async def add(self, acc: np.ndarray, chunk: int) -> None:
        """Add the feed's part of ``chunk`` to ``acc``, once it is there."""
        ...

    async def add_all(self, acc: np.ndarray) -> None:
        """Add to ``acc`` every part not yet added."""
        ...


_STEP_NAMES = {PHASE_SCATTER: "scatter", PHASE_GATHER: "gather", PHASE_SUM: "gather"}


@dataclass(frozen=True)
class Place:
    """Where one member stands in a ring of ``order``, and the chunks of its vector."""

    order: Sequence[str]
    pos: int
    bounds: list[tuple[int, int]]

    @classmethod
    def of(cls, order: Sequence[str], me: str, length: int) -> Place:
        return cls(order, order.index(me), chunk_bounds(length, len(order)))

    @property
    def n(self) -> int:
        return len(self.order)

    @property
    def ends(self) -> tuple[str, str]:
        """The successor and the predecessor."""
        n, pos = self.n, self.pos
        return self.order[(pos + 1) % n], self.order[(pos - 1) % n]


async def ring_step(
    link: Link,
    acc: np.ndarray,
    place: Place,
    phase: int,
    step: int,
    indices: tuple[int, int],
    on_step: StepHook | None,
    wait: float,
    *,
    send: bool = True,
    keeping: bool = False,
) -> RingBroken | None:
    """One ring step: send chunk ``indices[0]`` of ``acc`` to the successor while
    receiving chunk ``indices[1]`` from the predecessor, which is added in the
    reduce-scatter and copied in the all-gathers. Without ``send`` it only receives.
    With ``keeping`` neither failure cuts the other short
    (:meth:`~.link.Link.exchange_keeping`): a failed send is returned once the chunk
    is in (else ``None``), and a failed receive raised once the send has finished."""
    if on_step is not None:
        await on_step(_STEP_NAMES[phase], step)
    succ, pred = place.ends
    send_index, recv_index = indices
    slo, shi = place.bounds[send_index]
    rlo, rhi = place.bounds[recv_index]
    receiving = link.receive(pred, phase, step, recv_index, rhi - rlo, wait)
    failure: RingBroken | None = None
    if not send:
        chunk = await receiving
    else:
        sending = link.send(succ, phase, step, send_index, acc[slo:shi])
        if keeping:
            chunk, failure = await link.exchange_keeping(sending, receiving)
        else:
            chunk = await link.exchange(sending, receiving)
    if phase == PHASE_SCATTER:
        np.add(acc[rlo:rhi], chunk, out=acc[rlo:rhi])
    else:
        acc[rlo:rhi] = chunk
    return failure


async def reduce_scatter(
    link: Link,
    acc: np.ndarray,
    place: Place,
    on_step: StepHook | None,
    start_grace: float,
    feed: InputFeed | None = None,
) -> None:
    """The ``n - 1`` reduce-scatter steps: chunk ``pos + 1`` of ``acc`` ends complete.
    The first wait is ``start_grace`` longer (the members do not all start at once).
    With ``feed``, each chunk of ``acc`` takes the feed's part just before it first
    leaves (step ``s`` sends chunk ``pos - s``), and chunk ``pos + 1`` at the end."""
    n, pos = place.n, place.pos
    if feed is not None and not feed.fits(place.bounds):
        await feed.add_all(acc)
        feed = None
    for s in range(n - 1):
        wait = link.timeout + (start_grace if s == 0 else 0.0)
        indices = ((pos - s) % n, (pos - s - 1) % n)
        if feed is not None:
            await feed.add(acc, indices[0])
        await ring_step(link, acc, place, PHASE_SCATTER, s, indices, on_step, wait)
    if feed is not None:
        await feed.add(acc, (pos + 1) % n)


async def all_gather(
    link: Link,
    acc: np.ndarray,
    place: Place,
    on_step: StepHook | None,
    steps: range,
    *,
    phase: int = PHASE_GATHER,
    filled: set[int] | None = None,
    on_lost: LostHook | None = None,
) -> None:
    """All-gather ``steps`` (of ``0 .. n - 2``): each passes a complete chunk on and
    copies the predecessor's into ``acc``, noted in ``filled``.

    With ``on_lost`` a failure stops only the members it cuts off. The chunk a member
    receives at step ``k`` is the one it sends at step ``k + 1``, and no chunk it
    receives passed through its successor. So a send that fails at step ``s >= 1``
    does not break this member: it sends nothing more to its successor, keeps
    receiving, and completes, while ``on_lost(s)`` tells the member after the
    successor that its chunks stop at step ``s``. A receive that fails at step ``k``
    is raised once this step's send has finished, with ``cut_at = k``: the member
    ``e`` places after this one misses its chunk from step ``k + e`` on (for ``e``
    up to ``n - 2 - k``), and it must stop there, not before: until then it passes
    on chunks that the members after it need, and that never came through this one.
    At step 0 no member can complete, this one included: a failed send there breaks
    the ring at once."""
    n, pos = place.n, place.pos
    lost: asyncio.Future[None] | None = None
    try:
        for s in steps:
            indices = ((pos + 1 - s) % n, (pos - s) % n)
            keeping = on_lost is not None and s >= 1
            try:
                failure = await ring_step(
                    link,
                    acc,
                    place,
                    phase,
                    s,
                    indices,
                    on_step,
                    link.timeout,
                    send=lost is None,
                    keeping=keeping,
                )
            except RingBroken as exc:
                if keeping:
                    exc.cut_at = s
                raise
            if failure is not None and on_lost is not None:
                lost = asyncio.ensure_future(on_lost(s))
            if filled is not None:
                filled.add((pos - s) % n)
    finally:
        if lost is not None:
            await lost


async def chain(
    link: Link, acc: np.ndarray, place: Place, on_step: StepHook | None, start_grace: float
) -> None:
    """Reduce along the chain ``order[0] -> ... -> order[n-1]``, then the total goes
    ``order[n-1] -> order[0] -> ... -> order[n-2]``; a wait is bounded by one timeout
    per hop that must happen before it (the sender is pinged meanwhile)."""
    n, pos, length, timeout = place.n, place.pos, acc.shape[0], link.timeout
    succ, pred = place.ends
    if on_step is not None:
        await on_step("scatter", 0)
    if pos > 0:
        wait = timeout * pos + start_grace
        part = await link.receive(pred, PHASE_CHAIN_REDUCE, 0, 0, length, wait)
        np.add(acc, part, out=acc)
    if pos < n - 1:
        await link.send(succ, PHASE_CHAIN_REDUCE, 0, 0, acc)
    if on_step is not None:
        await on_step("gather", 0)
    if pos < n - 1:
        wait = timeout * (n + pos) + start_grace
        acc[:] = await link.receive(pred, PHASE_CHAIN_BROADCAST, 0, 0, length, wait)
    if pos < n - 2 or pos == n - 1:
        await link.send(succ, PHASE_CHAIN_BROADCAST, 0, 0, acc)


async def star(link: Link, acc: np.ndarray, place: Place, start_grace: float) -> None:
    """Every member sends its vector to the hub ``order[0]``, which adds them and sends
    the total back to each."""
    order, length = place.order, acc.shape[0]
    wait = link.timeout * place.n + start_grace
    if place.pos != 0:
        await link.send(order[0], PHASE_STAR_UP, 0, 0, acc)
        acc[:] = await link.receive(order[0], PHASE_STAR_DOWN, 0, 0, length, wait)
        return

    async def collect(member: str) -> None:
        part = await link.receive(member, PHASE_STAR_UP, 0, 0, length, wait)
        np.add(acc, part, out=acc)

    await asyncio.gather(*(collect(m) for m in order[1:]))
    await asyncio.gather(*(link.send(m, PHASE_STAR_DOWN, 0, 0, acc) for m in order[1:]))
