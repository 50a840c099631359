"""What the ring puts on the wire, and the names every member derives alike.

Message kinds (``agg.chunk``, ``agg.sum``, ``agg.abort``, ``agg.ping``); the chunk
header (version, phase, ring width, step, chunk index, frame, element count and the
16-byte ring id) and the phases it names; how large a frame may be; and the three
things every member computes from the same inputs to the same result: the ring's
order (:func:`ring_order`), its id (:func:`ring_id`) and the chunks' bounds
(:func:`chunk_bounds`); and how a ring narrower than its storage is packed
(:func:`pack_narrow`, :func:`unpack_narrow`).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

__all__ = [
    "ACK",
    "HEADER",
    "KIND_ABORT",
    "KIND_CHUNK",
    "KIND_PING",
    "KIND_SUM",
    "MAX_FRAME_BYTES",
    "NARROW_BITS",
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
    "pack_narrow",
    "packed_bytes",
    "ring_id",
    "ring_order",
    "unpack_narrow",
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


NARROW_BITS = (8, 10, 12, 14)
"""The widths of a ring narrower than its ``uint16`` storage that travel packed."""
_GROUP = 4
"""Elements per packed group: ``4 b`` bits, ``b / 2`` whole bytes for an even ``b``."""
_BLOCK = 1 << 18
"""Elements packed or unpacked per pass (bounds the ``uint64`` temporaries)."""


def packed_bytes(count: int, bits: int) -> int:
    """The bytes ``count`` elements of a ``bits``-bit ring take packed."""
    if bits == 8:
        return count
    return -(-count // _GROUP) * (bits // 2)


def _lanes(bits: int) -> tuple[np.ndarray, np.uint64]:
    """Each group element's shift and the element mask of a packed ``bits``-bit ring;
    raises ``ValueError`` for a width that does not travel packed."""
    if bits not in NARROW_BITS:
        raise ValueError(f"a packed ring is {NARROW_BITS} bits wide, not {bits}")
    shifts = (np.arange(_GROUP, dtype=np.uint64) * np.uint64(bits)).reshape(1, _GROUP)
    return shifts, np.uint64((1 << bits) - 1)


def pack_narrow(values: np.ndarray, bits: int) -> np.ndarray:
    """The low ``bits`` bits of each ``uint16`` in ``values``, packed little-endian:
    each group of 4 elements becomes ``bits / 2`` bytes (element ``i`` of the group at
    bit ``i * bits``), the last group padded with zeros. Arithmetic modulo ``2^16``
    agrees with arithmetic modulo ``2^bits`` on the low bits, so a ring that stores
    ``uint16`` and adds without reducing sends exactly its ``bits``-bit elements."""
    shifts, mask = _lanes(bits)
    if bits == 8:
        return values.astype(np.uint8)  # the low byte of each element
    count, width = values.shape[0], bits // 2
    out = np.empty(packed_bytes(count, bits), dtype=np.uint8)
    for lo in range(0, count, _BLOCK):
        hi = min(count, lo + _BLOCK)
        groups = -(-(hi - lo) // _GROUP)
        block = np.zeros(groups * _GROUP, dtype=np.uint64)
        block[: hi - lo] = values[lo:hi]
        block &= mask
        lanes = block.reshape(groups, _GROUP)
        words = lanes[:, 0].copy()
        for i in range(1, _GROUP):
            words |= lanes[:, i] << shifts[0, i]
        raw = words.astype("<u8", copy=False).view(np.uint8).reshape(groups, 8)[:, :width]
        start = lo // _GROUP * width
        out[start : start + groups * width] = raw.ravel()
    return out


def unpack_narrow(data: bytes | memoryview, count: int, bits: int) -> np.ndarray:
    """``count`` ``uint16`` elements from :func:`pack_narrow`'s bytes (each below
    ``2^bits``); raises ``ValueError`` when ``data`` is not exactly their size."""
    shifts, mask = _lanes(bits)
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.shape[0] != packed_bytes(count, bits):
        raise ValueError(f"{raw.shape[0]} bytes do not pack {count} elements of {bits} bits")
    if bits == 8:
        return raw.astype(np.uint16)
    width = bits // 2
    out = np.empty(count, dtype=np.uint16)
    for lo in range(0, count, _BLOCK):
        hi = min(count, lo + _BLOCK)
        groups = -(-(hi - lo) // _GROUP)
        start = lo // _GROUP * width
        padded = np.zeros((groups, 8), dtype=np.uint8)
        padded[:, :width] = raw[start : start + groups * width].reshape(groups, width)
        words = padded.view("<u8").astype(np.uint64)  # (groups, 1)
        elements = (words >> shifts) & mask
        out[lo:hi] = elements.ravel()[: hi - lo]
    return out
