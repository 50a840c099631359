"""What the ring puts on the wire, and the names every member derives alike.

Message kinds (``agg.chunk``, ``agg.sum``, ``agg.abort``, ``agg.ping``); the chunk
header (version, phase, ring width, step, chunk index, frame, element count and the
16-byte ring id) and the phases it names; how large a frame may be; and the three
things every member computes from the same inputs to the same result: the ring's
order (:func:`ring_order`), its id (:func:`ring_id`) and the chunks' bounds
(:func:`chunk_bounds`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = [
    "ACK",
    "HEADER",
    "KIND_ABORT",
    "KIND_CHUNK",
    "KIND_PING",
    "KIND_SUM",
    "MAX_FRAME_BYTES",
    "PHASES",
    "PHASE_CHAIN_BROADCAST",
    "PHASE_CHAIN_REDUCE",
    "PHASE_GATHER",
    "PHASE_SCATTER",
    "PHASE_STAR_DOWN",
    "PHASE_STAR_UP",
    "PHASE_SUM",
    "VERSION",
    "chunk_bounds",
    "ring_id",
    "ring_order",
]

KIND_CHUNK = "agg.chunk"
KIND_SUM = "agg.sum"
KIND_ABORT = "agg.abort"
KIND_PING = "agg.ping"

PHASE_SCATTER = 1
PHASE_GATHER = 2
PHASE_CHAIN_REDUCE = 3
PHASE_CHAIN_BROADCAST = 4
PHASE_STAR_UP = 5
PHASE_STAR_DOWN = 6
PHASE_SUM = 7  # the all-gather of the unmasked sum (kind agg.sum, see all_gather_sum)
PHASES = (
    PHASE_SCATTER,
    PHASE_GATHER,
    PHASE_CHAIN_REDUCE,
    PHASE_CHAIN_BROADCAST,
    PHASE_STAR_UP,
    PHASE_STAR_DOWN,
    PHASE_SUM,
)
HEADER = struct.Struct(">BBBIIII16s")
"""version, phase, bits, step, chunk index, frame, element count, ring id (16 bytes)"""
VERSION = 1
MAX_FRAME_BYTES = 16 << 20
"""A chunk larger than this travels as several messages (well under the 64 MiB limit)."""
ACK = b"ok"


def ring_order(members: Sequence[str] | set[str] | frozenset[str], round: int) -> list[str]:
    """Members sorted by ``SHA-256(round || org_id)``: the ring of one round.

    Deterministic from the member set and the round number alone, so every node that
    agrees on the set builds the same ring; a fresh order each round spreads the
    positions (and who holds which partial sum) over the members.
    """
    prefix = struct.pack(">Q", round)

    def key(org: str) -> bytes:
        return hashlib.sha256(prefix + org.encode("utf-8")).digest()

    return sorted(set(members), key=lambda o: (key(o), o))


def ring_id(order: Sequence[str], attempt: int) -> bytes:
    """16 bytes naming one ring (its ordered members and the attempt number).

    Carried by every chunk, so chunks of a different attempt or of a ring built from a
    different view never mix with this one's.
    """
    h = hashlib.sha256(b"fedweave/ring\x00" + struct.pack(">I", attempt))
    for org in order:
        h.update(struct.pack(">I", len(org)) + org.encode("utf-8"))
    return h.digest()[:16]


def chunk_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous ``[start, stop)`` slices covering ``length`` elements, sizes within 1."""
    if n < 1:
        raise ValueError(f"chunk_bounds needs n >= 1, got {n}")
    cuts = [i * length // n for i in range(n + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(n)]
