"""A round's masks expanded before it starts, while the org's update trains.

``docs/ARCHITECTURE.md``, "Masks prepared a round ahead". Every ready advertises the
``s`` key of its org's next round of the run (:mod:`~coordinator_free.rounds.ahead`),
and that round's self-mask seed ``b`` is drawn with it. So when a round completes, a
node knows every key its next round's masks come from: it expands the sum of the
masks of the usual case (every member ready, with the key it advertised) into one
ring array, off its event loop, while the caller computes the next update
(:class:`MaskPreparer`). The next round adds its input to that array instead of
expanding the masks (:meth:`~coordinator_free.rounds.session.MaskedSum.premask`).

The prepared masks are a guess that is checked, never trusted: the round computes
its own list of masks from the advertisements it received and adds the difference
(a mask the guess lacks, or takes off one the guess has that the round does not), so
its masked input is exactly the one it would have made without them. A round whose
list shares too little with the guess (another protocol round, other members)
ignores the array.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from secure_agg import prg
from secure_agg.protocol.unmasking import Mask

__all__ = ["MaskList", "MaskPreparer", "PreparedMasks", "correction"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedMasks:
    """The sum of ``masks`` (each ``(seed, sign)``) over a ring array, made for
    protocol round ``round``."""

    round: int
    masks: tuple[Mask, ...]
    array: np.ndarray


def correction(prepared: Sequence[Mask], wanted: Sequence[Mask]) -> list[Mask] | None:
    """The masks that turn the sum of ``prepared`` into the sum of ``wanted``: each
    wanted mask the prepared ones lack, and each prepared mask not wanted, with its
    sign turned. ``None`` when that is as many masks as ``wanted`` (the prepared array
    saves nothing)."""
    have, want = Counter(prepared), Counter(wanted)
    missing = list((want - have).elements())
    extra = [(seed, -sign) for seed, sign in (have - want).elements()]
    fix = missing + extra
    return None if len(fix) >= len(wanted) else fix


MaskList = tuple[list[Mask], np.dtype, int]
"""The masks of a round, and the dtype and length of the ring array they are added to."""
Expanded = tuple[tuple[Mask, ...], np.ndarray] | None
"""The masks and their sum over a ring array; ``None``: not expanded (too large)."""


def _expand(make: Callable[[], MaskList], cap: int) -> Expanded:
    """The masks ``make`` gives and their sum over a new ring array; ``None`` when that
    array would take more than ``cap`` bytes."""
    masks, dtype, length = make()
    if length * np.dtype(dtype).itemsize > cap:
        return None
    array = np.zeros(length, dtype=dtype)
    prg.add_masks(array, masks)
    return tuple(masks), array


class MaskPreparer:
    """The masks each run's next round prepares: one expansion at a time per run, in a
    worker thread; the round takes it (:meth:`take`), or a caller waits for it
    (:meth:`settled`)."""

    def __init__(self) -> None:
        self._jobs: dict[str, tuple[int, asyncio.Future[Expanded]]] = {}

    def start(self, run: str, round: int, make: Callable[[], MaskList], cap: int) -> None:
        """Work out the masks of protocol round ``round`` of ``run`` (``make``: their
        key agreements) and expand them, off the loop, into an array of at most ``cap``
        bytes, in place of whatever was prepared for the run before."""
        self.forget_run(run)
        job = asyncio.ensure_future(asyncio.to_thread(_expand, make, cap))
        job.add_done_callback(_retrieved)
        self._jobs[run] = (round, job)

    async def take(self, run: str, round: int) -> PreparedMasks | None:
        """What was prepared for protocol round ``round`` of ``run``, once it is expanded
        (the round waits for it: it would do the same work); ``None`` when nothing was,
        for that round, or the expansion failed. Handed out once."""
        found = self._jobs.pop(run, None)
        if found is None or found[0] != round:
            if found is not None:
                found[1].cancel()
            return None
        try:
            done = await found[1]
        except Exception as exc:  # the round masks as it would without them
            logger.warning("masks prepared for round %d of %r failed: %s", round, run, exc)
            return None
        return None if done is None else PreparedMasks(round, *done)

    def pending(self, run: str) -> int | None:
        """The protocol round of ``run`` masks are prepared for, if any."""
        found = self._jobs.get(run)
        return None if found is None else found[0]

    async def settled(self, run: str) -> None:
        """Once the masks being prepared for ``run`` are expanded (or failed)."""
        found = self._jobs.get(run)
        if found is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(found[1])

    def forget_run(self, run: str) -> None:
        """Drop what was prepared for ``run``."""
        found = self._jobs.pop(run, None)
        if found is not None:
            found[1].cancel()


def _retrieved(job: asyncio.Future[Expanded]) -> None:
    """Mark a failed expansion's error as seen: :meth:`MaskPreparer.take` reports it."""
    if not job.cancelled():
        job.exception()
