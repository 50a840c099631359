"""8-bit stochastic quantization into the 16-bit ring, and 64-bit values carried in it.

:class:`Q8Codec` maps each coordinate ``x`` with its range ``R > 0`` (a range every
summand uses: the caller agrees it, it is never one summand's private value) to an
integer level ``q`` in ``[-127, 127]``:

1. clip ``x`` to ``[-R, R]`` and scale: ``v = 127 * x / R``;
2. round stochastically: ``q = floor(v) + [u < v - floor(v)]`` with ``u`` uniform in
   ``[0, 1)`` (32-bit words of an AES-256-CTR keystream keyed by 32 bytes drawn from the
   caller's ``np.random.Generator``), so ``E[q] = v`` and ``|q - v| < 1``;
3. store ``q`` in two's complement mod ``2^16``.

Headroom. ``|q| <= 127``, so a ring sum of up to :data:`MAX_SUMMANDS` (258) encodings
stays within ``2^15 - 1`` and reads back exactly as an int16. Fewer summands need
fewer bits: ``n`` of them fit a ring of :func:`ring_bits_for` ``(n)`` bits (10 for up
to 4, 12 for 16, 14 for 64), and :meth:`Q8Codec.decode` reads a sum modulo that ring,
so the ring may carry only those low bits of each ``uint16`` (``coordinator_free``'s
ring packs them: 1.25 bytes a coordinate for 4 orgs, against a 32-bit ring's 4).

Error bound of the dequantized sum (:meth:`Q8Codec.sum_error_bound`). For ``n``
summands whose inputs lie within their ranges, one coordinate of range ``R``::

    |decode(sum_i encode(x_i)) - sum_i x_i|  <  n * R / 127  (+ float64 rounding)

A few values that need more than 8 bits (a weight, a sum of ranges) travel in the same
16-bit ring as **limbs** (:func:`to_limbs`, :func:`from_limbs`): a 64-bit ring value is
cut into 8 bytes, one per 16-bit coordinate. A sum of up to :data:`MAX_LIMB_SUMMANDS`
(257) such vectors keeps every limb's sum below ``2^16`` (``257 * 255 < 2^16``), so the
64-bit ring sum is recovered exactly as ``sum_j S_j * 2^(8 j) mod 2^64``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ConfigError, RingError
from .prg import expand
from .ring import check_ring

__all__ = [
    "LEVELS",
    "LIMBS",
    "MAX_LIMB_SUMMANDS",
    "MAX_SUMMANDS",
    "Q8Codec",
    "from_limbs",
    "ring_bits_for",
    "to_limbs",
]

LEVELS = 127
"""Levels on each side of zero: an 8-bit signed value ``q`` in ``[-127, 127]``."""
MAX_SUMMANDS = ((1 << 15) - 1) // LEVELS
"""The most summands whose levels sum without wrapping the 16-bit ring (258)."""
LIMBS = 8
"""16-bit ring coordinates (one byte each) per 64-bit value."""
MAX_LIMB_SUMMANDS = ((1 << 16) - 1) // 255
"""The most summands whose limbs sum below ``2^16`` (257)."""


def _check_summands(n: object, most: int, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= most:
        raise ConfigError(f"{what} must be an int in [1, {most}], got {n!r}")
    return n


def _check_ranges(x: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    r = np.asarray(ranges, dtype=np.float64)
    if r.shape != x.shape:
        raise RingError(f"ranges have shape {r.shape}, the vector {x.shape}")
    if r.size and not (np.isfinite(r).all() and (r > 0).all()):
        raise ConfigError("every range must be finite and > 0")
    return r


@dataclass(frozen=True)
class Q8Codec:
    """Stochastic 8-bit quantization into ``Z_2^16`` with per-coordinate ranges."""

    max_summands: int = 1
    """A ring sum of up to this many encodings never wraps (at most :data:`MAX_SUMMANDS`)."""

    bits = 16

    def __post_init__(self) -> None:
        _check_summands(self.max_summands, MAX_SUMMANDS, "max_summands")

    @property
    def ring_bits(self) -> int:
        """The narrowest ring that ``max_summands`` encodings need (:func:`ring_bits_for`):
        the levels are stored as ``uint16`` and the ring may send only these low bits."""
        return ring_bits_for(self.max_summands)

    def encode(self, x: np.ndarray, ranges: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Clip ``x`` to ``[-ranges, ranges]`` and round ``127 * x / ranges`` stochastically.

        Raises:
            RingError: ``x`` is not a one-dimensional float array, holds NaN or Inf, or
                its ranges differ in shape.
            ConfigError: a range is not finite and positive, or ``rng`` is not a
                ``numpy.random.Generator``.
        """
        if not isinstance(x, np.ndarray) or x.dtype not in (np.float32, np.float64):
            raise RingError("encode expects a float32 or float64 numpy array")
        if x.ndim != 1:
            raise RingError(f"encode expects a one-dimensional array, got shape {x.shape}")
        if not np.isfinite(x).all():
            raise RingError("cannot encode NaN or Inf values")
        r = _check_ranges(x, ranges)
        if not isinstance(rng, np.random.Generator):
            raise ConfigError("rng must be a numpy.random.Generator")
        v = np.clip(x.astype(np.float64) / r, -1.0, 1.0) * LEVELS
        low = np.floor(v)
        uniforms = expand(rng.bytes(32), x.shape[0], 32).astype(np.float64) * 2.0**-32
        q = low + (uniforms < v - low)
        levels: np.ndarray = q.astype(np.int16).view(np.uint16)
        return levels

    def decode(self, y: np.ndarray, ranges: np.ndarray) -> np.ndarray:
        """Read a 16-bit ring vector (an encoding, or a sum of up to ``max_summands``)
        modulo ``2^ring_bits``: the bits above, which a narrow ring does not carry, are
        ignored."""
        check_ring(y, 16)
        r = _check_ranges(y, ranges)
        return _signed(y, self.ring_bits).astype(np.float64) * (r / LEVELS)

    def sum_error_bound(self, n_summands: int, ranges: np.ndarray) -> np.ndarray:
        """Largest ``|decoded sum - exact sum|`` per coordinate for in-range inputs:
        ``n * R / 127``, plus float64 rounding of the decoded and the reference sums."""
        n = _check_summands(n_summands, self.max_summands, "n_summands")
        r = np.asarray(ranges, dtype=np.float64)
        return n * r / LEVELS + n * r * 2.0**-50


def ring_bits_for(summands: int) -> int:
    """The fewest even bits (at least 8) in which a sum of ``summands`` encodings, or of
    as many limb vectors, reads back exactly: ``255 * summands < 2^b``, which also
    holds the levels' signed sum (``2 * 127 * summands + 1 <= 2^b``). 10 bits for up to
    4 summands, 12 for 16, 14 for 64, 16 from 65 on (:data:`MAX_SUMMANDS` levels,
    :data:`MAX_LIMB_SUMMANDS` limb vectors)."""
    n = _check_summands(summands, MAX_SUMMANDS, "summands")
    bits = 8
    while bits < 16 and 255 * n >= 1 << bits:
        bits += 2
    return bits


def _signed(y: np.ndarray, bits: int) -> np.ndarray:
    """``y`` modulo ``2^bits`` read as two's complement (int32)."""
    if bits == 16:
        return y.view(np.int16).astype(np.int32)
    v = (y & np.uint16((1 << bits) - 1)).astype(np.int32)
    v[v >= 1 << (bits - 1)] -= 1 << bits
    return v


def to_limbs(values: np.ndarray) -> np.ndarray:
    """A 64-bit ring vector as 16-bit ring coordinates, one byte of each value per
    coordinate, least significant first (:data:`LIMBS` per value)."""
    check_ring(values, 64)
    le = values.astype(np.dtype("<u8"), copy=False)
    raw = np.frombuffer(le.tobytes(), dtype=np.uint8)
    return raw.astype(np.uint16)


def from_limbs(limbs: np.ndarray, summands: int = MAX_LIMB_SUMMANDS) -> np.ndarray:
    """The 64-bit ring vector whose limbs, summed over at most ``summands`` vectors of
    :func:`to_limbs`, are ``limbs``: ``sum_j S_j * 2^(8 j) mod 2^64``, exactly."""
    _check_summands(summands, MAX_LIMB_SUMMANDS, "summands")
    check_ring(limbs, 16)
    if limbs.shape[0] % LIMBS:
        raise RingError(f"a limb vector's length is a multiple of {LIMBS}, not {limbs.shape[0]}")
    # modulo the narrowest ring that many summands need (the bits above are not carried)
    bits = ring_bits_for(summands)
    parts = (limbs & np.uint16((1 << bits) - 1)).reshape(-1, LIMBS).astype(np.uint64)
    out = np.zeros(parts.shape[0], dtype=np.uint64)
    for j in range(LIMBS):
        out += parts[:, j] << np.uint64(8 * j)  # wraps mod 2^64, as the ring does
    return out
