"""Fixed-point codec between float vectors and the ring ``Z_2^b`` (b = 16, 32 or 64).

Encoding (Bonawitz et al., CCS'17, Section 4 quantize to ``Z_R``; Agarwal et al.,
NeurIPS'21, Section 4 scale-and-round for distributed discrete noise):

1. clip every coordinate to ``[-clip, clip]``;
2. multiply by ``scale = 2**frac_bits`` (exact: a power of two);
3. round stochastically: ``v`` becomes ``floor(v) + 1`` with probability
   ``v - floor(v)``, else ``floor(v)``, so ``E[q] = v`` (unbiased). The uniforms are
   32-bit words of an AES-256-CTR keystream keyed by 32 bytes drawn from the caller's
   ``np.random.Generator``: reproducible for a fixed seed, and fast (one AES block
   serves four coordinates, no per-element Python);
4. store the signed integer in two's complement, i.e. mod ``2^b``.

Headroom. One encoded coordinate has ``|q| <= ceil(clip * scale)``; a summand may
also carry up to ``noise_bound * scale`` of DP noise. The constructor refuses any
configuration where ``max_summands * (ceil(clip*scale) + ceil(noise_bound*scale))``
exceeds ``2^(b-1) - 1``, so a ring sum of up to ``max_summands`` encoded (and noised)
vectors never wraps and :meth:`FixedPointCodec.decode` reads it back exactly.

Error bound of the dequantized sum (:meth:`FixedPointCodec.sum_error_bound`). For
``n`` summands and one coordinate, with ``c_i`` the clipped inputs::

    |decode(sum_i encode(x_i)) - sum_i c_i|  <=  n / scale  +  n * (clip + 1/scale) * 2^-52

The first term is stochastic rounding (each ``|q_i - c_i*scale| < 1``); the second
covers the float64 rounding of the decoded sum (at most ``2^-53`` relative) and leaves
the same again for the caller's own correctly rounded float64 reference sum.

Unbiasedness holds exactly whenever ``v - floor(v)`` is a multiple of ``2^-32`` (the
resolution of the uniforms), e.g. for every float32 input with ``|v| >= 2^-9``;
otherwise the bias of one coordinate is below ``2^-32`` ring units (``2^-32 / scale``).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from .errors import ConfigError, RingError
from .ring import check_ring, ring_dtype

__all__ = ["FixedPointCodec"]

# Elements per chunk of the encoder: the float64 scratch buffers stay in cache.
_CHUNK = 1 << 15
# Elements per chunk of the decoder: large enough that the per-call cost vanishes,
# small enough that a temporary numpy makes for an aliased ``out`` stays small.
_DECODE_CHUNK = 1 << 16
_TWO_32 = float(1 << 32)
_LITTLE_ENDIAN = sys.byteorder == "little"
_SIGNED: dict[int, np.dtype[Any]] = {
    16: np.dtype(np.int16),
    32: np.dtype(np.int32),
    64: np.dtype(np.int64),
}


def _fits(n: int, clip: float, noise_bound: float, frac_bits: int, limit: int) -> bool:
    """Whether ``n`` summands of the largest magnitude (rounded clip plus noise) fit ``limit``.

    Exact integer arithmetic: ``ceil`` of a finite float is an exact int.
    """
    scale = 2.0**frac_bits
    value, noise = clip * scale, noise_bound * scale
    if not (math.isfinite(value) and math.isfinite(noise)):
        return False
    return n * (math.ceil(value) + math.ceil(noise)) <= limit


def _positive_finite(name: str, value: Any, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be finite and {bound}, got {value!r}")


@dataclass(frozen=True)
class FixedPointCodec:
    """Clip, scale and stochastically round floats into ``Z_2^bits`` with sum headroom.

    After construction ``frac_bits`` holds the resolved value (the largest that fits
    when ``None`` was given).
    """

    bits: int = 32
    """Ring width, 16, 32 or 64."""
    clip: float = 1.0
    """Every coordinate is clipped to ``[-clip, clip]`` before scaling."""
    max_summands: int = 1
    """A ring sum of up to this many encoded vectors never wraps."""
    frac_bits: int | None = None
    """``scale = 2**frac_bits``; ``None`` picks the largest value that leaves the headroom."""
    noise_bound: float = 0.0
    """Extra headroom per summand, in float units, for DP noise added in the ring."""

    def __post_init__(self) -> None:
        ring_dtype(self.bits)  # ConfigError names `bits`
        _positive_finite("clip", self.clip)
        _positive_finite("noise_bound", self.noise_bound, allow_zero=True)
        n = self.max_summands
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"max_summands must be an int >= 1, got {n!r}")
        limit = (1 << (self.bits - 1)) - 1
        fits = [f for f in range(self.bits - 1) if _fits(n, self.clip, self.noise_bound, f, limit)]
        largest = max(fits) if fits else None
        if self.frac_bits is None:
            if largest is None:
                raise ConfigError(
                    f"no frac_bits fits: max_summands * (clip + noise_bound) = "
                    f"{n} * ({self.clip} + {self.noise_bound}) exceeds the {self.bits}-bit "
                    "ring's headroom; lower clip, noise_bound or max_summands, or use bits=64"
                )
            object.__setattr__(self, "frac_bits", largest)
            return
        f = self.frac_bits
        if isinstance(f, bool) or not isinstance(f, int) or not 0 <= f < self.bits - 1:
            raise ConfigError(f"frac_bits must be an int in [0, {self.bits - 2}], got {f!r}")
        if largest is None or f > largest:
            hint = f"lower frac_bits to at most {largest}" if largest is not None else ""
            raise ConfigError(
                f"a sum of max_summands={n} vectors could wrap the {self.bits}-bit ring at "
                f"frac_bits={f} (clip={self.clip}, noise_bound={self.noise_bound}): "
                + (hint + ", or " if hint else "")
                + "lower clip, noise_bound or max_summands, or use bits=64"
            )

    @property
    def scale(self) -> float:
        """``2**frac_bits``: float units to ring units."""
        assert self.frac_bits is not None  # resolved in __post_init__
        return 2.0**self.frac_bits

    def encode(
        self, x: np.ndarray, rng: np.random.Generator, *, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Clip, scale and stochastically round a float32/float64 vector into the ring.

        Randomness: one 32-byte key ``rng.bytes(32)`` keys an AES-256-CTR keystream
        (all-zero counter block) read as little-endian 32-bit uniforms ``r``, one per
        coordinate. The result depends only on ``rng``'s state, never on chunking.
        For ``bits=16`` or ``32`` a coordinate ``v`` becomes ``(floor(v * 2^32) + r) >> 32``;
        for ``bits=64`` it becomes ``floor(v) + [r < frac(v) * 2^32]``. ``out`` (a
        writeable, contiguous ring array of ``x``'s length) receives the result instead
        of a new array.

        Raises:
            RingError: ``x`` is not a one-dimensional float32/float64 array, or holds
                NaN or Inf (then nothing is encoded and ``rng`` is not advanced).
            ConfigError: ``rng`` is not a ``numpy.random.Generator``.
        """
        if not isinstance(x, np.ndarray) or x.dtype not in (np.float32, np.float64):
            raise RingError("encode expects a float32 or float64 numpy array")
        if x.ndim != 1:
            raise RingError(f"encode expects a one-dimensional array, got shape {x.shape}")
        if not isinstance(rng, np.random.Generator):
            raise ConfigError("rng must be a numpy.random.Generator")
        size = x.shape[0]
        dtype = ring_dtype(self.bits)
        if out is not None and (
            not isinstance(out, np.ndarray)
            or out.dtype != dtype
            or out.shape != (size,)
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            raise RingError(f"out must be a writeable, contiguous {dtype} array of length {size}")
        for start in range(0, size, _CHUNK):
            if not np.isfinite(x[start : start + _CHUNK]).all():
                raise RingError("cannot encode NaN or Inf values")
        key = rng.bytes(32)
        keystream = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
        if out is None:
            out = np.empty(size, dtype=dtype)
        signed = out.view(_SIGNED[self.bits])
        m = min(size, _CHUNK)
        v = np.empty(m, dtype=np.float64)
        work = np.empty(m, dtype=np.float64 if self.bits == 64 else np.int64)
        r = np.empty(m, dtype=np.uint32)
        up = np.empty(m, dtype=np.bool_)
        zeros = np.zeros(4 * m, dtype=np.uint8)
        for start in range(0, size, _CHUNK):
            k = min(_CHUNK, size - start)
            rk = r[:k]
            keystream.update_into(zeros[: 4 * k].data, rk.view(np.uint8).data)
            if not _LITTLE_ENDIAN:
                rk.byteswap(inplace=True)
            if self.bits < 64:
                self._round32(x[start : start + k], v[:k], work[:k], rk)
            else:
                self._round64(x[start : start + k], v[:k], work[:k], rk, up[:k])
            np.copyto(signed[start : start + k], work[:k], casting="unsafe")
        return out

    def _round32(self, x: np.ndarray, v: np.ndarray, t: np.ndarray, r: np.ndarray) -> None:
        """``t = (floor(clip(x) * scale * 2^32) + r) >> 32``, exact in int64 for 16- and 32-bit rings.

        Rounds up with probability ``floor(frac * 2^32) / 2^32``.
        """
        wide = self.scale * _TWO_32
        np.multiply(x, wide, out=v)
        np.clip(v, -self.clip * wide, self.clip * wide, out=v)
        np.floor(v, out=v)
        np.copyto(t, v, casting="unsafe")  # |v| < 2^63: exact
        np.add(t, r, out=t)
        np.right_shift(t, 32, out=t)  # arithmetic shift: floor division by 2^32

    def _round64(
        self, x: np.ndarray, v: np.ndarray, f: np.ndarray, r: np.ndarray, up: np.ndarray
    ) -> None:
        """``f = floor(v) + [r < frac(v) * 2^32]`` with ``v = clip(x) * scale``, in float64.

        Rounds up with probability ``ceil(frac * 2^32) / 2^32``; for ``|v| >= 2^52`` the
        fraction is 0 and ``v`` is kept exactly.
        """
        scale = self.scale
        np.multiply(x, scale, out=v)
        np.clip(v, -self.clip * scale, self.clip * scale, out=v)
        np.floor(v, out=f)
        np.subtract(v, f, out=v)  # fractional part, exact
        np.multiply(v, _TWO_32, out=v)  # exact
        np.less(r, v, out=up)
        np.add(f, up, out=f)

    def decode(self, y: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
        """Read a ring vector (one encoding, or a sum of up to ``max_summands``) as float64.

        Each element is its signed value converted to float64 and divided by ``scale``,
        chunk by chunk into the result, so no vector-sized temporary is made: ``out``
        (a contiguous float64 array of ``y``'s length) receives it when given, and may
        be ``y``'s own memory read as float64 (``y.view(np.float64)``, 64-bit rings
        only): each chunk is read before it is overwritten, so the ring vector turns
        into its decoding in place. The values do not depend on the chunking.

        Raises:
            RingError: ``y`` is not a one-dimensional array of this codec's ring dtype,
                or ``out`` is not a writeable, contiguous float64 array of its length.
        """
        check_ring(y, self.bits)
        size = y.shape[0]
        if out is None:
            out = np.empty(size, dtype=np.float64)
        elif (
            not isinstance(out, np.ndarray)
            or out.dtype != np.float64
            or out.shape != (size,)
            or not out.flags.c_contiguous
            or not out.flags.writeable
        ):
            raise RingError(f"out must be a writeable, contiguous float64 array of length {size}")
        signed = y.view(_SIGNED[self.bits])
        scale = self.scale
        for start in range(0, size, _DECODE_CHUNK):
            stop = min(size, start + _DECODE_CHUNK)
            # int64 -> float64 (round to nearest), then / scale: astype(float64) / scale
            np.divide(signed[start:stop], scale, out=out[start:stop])
        return out

    def sum_error_bound(self, n_summands: int) -> float:
        """Largest ``|decoded sum - exact sum of clipped inputs|`` per coordinate.

        See the module docstring: ``n/scale + n*(clip + 1/scale)*2^-52``.

        Raises:
            ConfigError: ``n_summands`` is not in ``[1, max_summands]``.
        """
        n = n_summands
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.max_summands:
            raise ConfigError(f"n_summands must be in [1, {self.max_summands}], got {n!r}")
        return n / self.scale + n * (self.clip + 1.0 / self.scale) * 2.0**-52
