"""One interface for a round's secure sum, whatever the backend: :class:`SecureSum`.

The run engine (``org_node``) sums each round's update, and once its statistics,
through one :class:`SecureSum` chosen when it is built: :class:`MaskedSecureSum`, the
masked sum of :class:`~coordinator_free.rounds.RoundEngine` over a fixed-point
encoding, or :class:`~coordinator_free.rounds.ckks.CkksAggregator`, the CKKS sum. It
encodes a float vector once per round (:meth:`SecureSum.encode`), then sums it over as
many protocol rounds as the round needs (:meth:`SecureSum.run_round`, one attempt
each), and compares the next model's hash with the survivors
(:meth:`SecureSum.check_model_hash`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from coordinator_free.rounds.engine import RoundEngine

from secure_agg.codec import FixedPointCodec

__all__ = ["MaskedSecureSum", "SecureSum", "SumResult"]


@dataclass(frozen=True)
class SumResult:
    """One secure sum of a round.

    total: the sum of the survivors' vectors, decoded (float64).
    survivors: the orgs whose vectors are in ``total``.
    dropped: the participants whose vectors are not, sorted.
    bytes_sent: payload bytes this org sent for the sum (0 where the backend does not
        count them).
    ring_bytes_sent: of ``bytes_sent``, the ring's chunks: the summed vector itself
        (0 where the backend does not count them).
    """

    total: np.ndarray
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    bytes_sent: int
    ring_bytes_sent: int = 0


class SecureSum(Protocol):
    """One org's side of the federation's secure sum of a round."""

    @property
    def name(self) -> str:
        """The backend, as a message to the org's admin names it (``masked``, ``CKKS``)."""
        ...

    @property
    def org_id(self) -> str: ...

    def bound_per_participant(self, participants: int) -> float:
        """The largest magnitude of a coordinate one of ``participants`` may add: the
        encoding's clip for the masked sum, the CKKS sum's range shared among them."""
        ...

    def encode(self, vector: np.ndarray) -> np.ndarray:
        """This org's contribution for the float ``vector``, made once per round before
        any attempt (a retry sums the very same contribution)."""
        ...

    async def run_round(
        self,
        run: str,
        round: int,
        contribution: np.ndarray,
        *,
        participants: tuple[str, ...],
        threshold: int,
        deadline: float | None,
        ring_bits: int = 0,
    ) -> SumResult:
        """One attempt at the sum, as protocol round ``round`` of ``run``; raises
        :class:`~coordinator_free.rounds.RoundFailed` when it cannot complete.
        ``deadline`` (clock time) bounds the masked sum's ready stage; the CKKS sum
        needs every one of ``participants`` and waits its own timeout per message.
        ``ring_bits``: the masked sum's narrow ring for a ``uint16`` contribution
        (:meth:`RoundEngine.run_round`); the CKKS sum has no ring and ignores it."""
        ...

    async def check_model_hash(
        self, run: str, round: int, digest: bytes, peers: Iterable[str], *, timeout: float
    ) -> frozenset[str]:
        """Compare the next model's hash with ``peers``' (``round.model``); raises
        :class:`~coordinator_free.rounds.ModelHashMismatch` on any difference."""
        ...


class MaskedSecureSum:
    """:class:`SecureSum` over :class:`RoundEngine`: the vector enters the ring by
    ``encode`` (a fixed-point codec, with the run's DP noise where it has one) and the
    sum leaves it by ``decode``; ``clip`` is the largest coordinate ``encode`` keeps.

    The engine takes its participants from the federation's members and its threshold
    from :class:`~coordinator_free.rounds.RoundConfig`, so ``run_round`` ignores those
    arguments; its survivors are whoever the round agreed on.

    When ``decode`` is a :class:`FixedPointCodec`'s own ``decode`` over a 64-bit ring,
    the round's sum (a new array, this object's alone) is decoded in its own memory,
    ``uint64`` read chunk by chunk into the ``float64`` it becomes: the decoded sum
    costs no second vector.
    """

    name = "masked"

    def __init__(
        self,
        rounds: RoundEngine,
        *,
        clip: float,
        encode: Callable[[np.ndarray], np.ndarray],
        decode: Callable[[np.ndarray], np.ndarray],
    ) -> None:
        self.rounds = rounds
        self.clip = clip
        self._encode = encode
        self._decode = decode
        codec = getattr(decode, "__self__", None)
        self._in_place = (
            isinstance(codec, FixedPointCodec)
            and getattr(decode, "__func__", None) is FixedPointCodec.decode
            and codec.bits == 64
        )

    @classmethod
    def with_codec(
        cls, rounds: RoundEngine, codec: FixedPointCodec, rng: np.random.Generator
    ) -> MaskedSecureSum:
        """Encoded by ``codec`` alone (stochastic rounding drawn from ``rng``)."""
        return cls(
            rounds,
            clip=codec.clip,
            encode=lambda vector: codec.encode(vector, rng),
            decode=codec.decode,
        )

    @property
    def org_id(self) -> str:
        return self.rounds.org_id

    def bound_per_participant(self, participants: int) -> float:
        return self.clip

    def encode(self, vector: np.ndarray) -> np.ndarray:
        return self._encode(vector)

    async def run_round(
        self,
        run: str,
        round: int,
        contribution: np.ndarray,
        *,
        participants: tuple[str, ...],
        threshold: int,
        deadline: float | None,
        ring_bits: int = 0,
    ) -> SumResult:
        result = await self.rounds.run_round(
            run, round, contribution, deadline=deadline, ring_bits=ring_bits
        )
        summed = np.asarray(result.sum)
        if self._in_place and summed.dtype == np.uint64 and summed.flags.c_contiguous:
            total = self._decode(summed, out=summed.view(np.float64))  # type: ignore[call-arg]
        else:
            total = self._decode(summed)
        return SumResult(
            total, result.survivors, result.dropped, result.bytes_sent, result.ring_bytes_sent
        )

    async def check_model_hash(
        self, run: str, round: int, digest: bytes, peers: Iterable[str], *, timeout: float
    ) -> frozenset[str]:
        return await self.rounds.check_model_hash(run, round, digest, peers, timeout=timeout)
