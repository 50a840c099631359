"""One aggregation interface over the two backends: masked ring sums and CKKS sums.

A participant *protects* its float vector into an opaque payload, anyone *adds*
payloads (along the ring, in any order and grouping), and the sum is *opened* back to
floats. :class:`MaskedBackend` adapts the masked-sum protocol
(:class:`secure_agg.protocol.SecAggPeer`, Bonawitz et al. CCS'17 §4) and the
fixed-point codec; :class:`CkksBackend` adapts :mod:`secure_agg.ckks`. Both are thin:
the protocol's stages (key advertisement, share exchange, unmasking) stay with the
protocol's state machine, and the caller drives them.

What ``open`` means differs, and is the one thing a caller must know:

* masked: the payload is the survivors' masked sum; :meth:`MaskedBackend.open` removes
  the masks with the shares the peer collected in its UNMASK stage
  (:meth:`SecAggPeer.finalize`) and decodes. Every survivor can open.
* CKKS: only the round's key holder opens, once, an aggregate of at least ``t``
  contributors (:meth:`CkksKeyHolder.decrypt_sum`); everyone else gets the result from
  it. :meth:`CkksBackend.open` raises :class:`KeyHolderRefusal` elsewhere.
"""

from __future__ import annotations

import struct
from typing import Protocol, runtime_checkable

import numpy as np

from .ckks import CkksKeyHolder, CkksPublicContext, KeyHolderRefusal, ckks_add, ckks_encrypt
from .codec import FixedPointCodec
from .errors import ConfigError, RingError
from .protocol import SecAggPeer
from .ring import check_ring, ring_add, ring_dtype

__all__ = [
    "AggregationBackend",
    "CkksBackend",
    "MaskedBackend",
    "ring_from_bytes",
    "ring_to_bytes",
]

_RING_MAGIC = b"FWMR"
_RING_HEADER = struct.Struct(">4sBQ")  # magic, ring bits, element count


@runtime_checkable
class AggregationBackend(Protocol):
    """Protect a vector, add protected vectors, open a sum."""

    @property
    def name(self) -> str:
        """Short backend name (``"masked"`` or ``"ckks"``)."""
        ...

    def protect(self, x: np.ndarray) -> bytes:
        """This participant's float vector as a payload that reveals nothing alone."""
        ...

    def add(self, a: bytes, b: bytes) -> bytes:
        """The payload of the sum of two payloads; needs no secret."""
        ...

    def open(self, total: bytes) -> np.ndarray:
        """The float64 sum inside an aggregate payload (see the module docstring)."""
        ...


def ring_to_bytes(y: np.ndarray) -> bytes:
    """Frame a ring array: ``"FWMR" | bits u8 | count u64 | little-endian words``."""
    bits = y.dtype.itemsize * 8
    check_ring(y, bits)
    body = y.astype(y.dtype.newbyteorder("<"), copy=False).tobytes()
    return _RING_HEADER.pack(_RING_MAGIC, bits, y.shape[0]) + body


def ring_from_bytes(data: bytes, bits: int, length: int | None = None) -> np.ndarray:
    """Parse :func:`ring_to_bytes`; a writeable native array of ``Z_2^bits``.

    Raises:
        RingError: bad magic, another ring width or length, or a truncated body.
    """
    dtype = ring_dtype(bits)
    if len(data) < _RING_HEADER.size:
        raise RingError("ring payload is truncated")
    magic, got_bits, count = _RING_HEADER.unpack_from(data)
    if magic != _RING_MAGIC:
        raise RingError("not a ring payload (bad magic)")
    if got_bits != bits:
        raise RingError(f"ring payload is {got_bits}-bit, expected {bits}-bit")
    if length is not None and count != length:
        raise RingError(f"ring payload holds {count} elements, expected {length}")
    if len(data) - _RING_HEADER.size != count * dtype.itemsize:
        raise RingError("ring payload length does not match its element count")
    body = np.frombuffer(data, dtype=dtype.newbyteorder("<"), offset=_RING_HEADER.size)
    return body.astype(dtype, copy=True)


class MaskedBackend:
    """Masked ring sums: encode with the codec, mask with the peer, add mod ``2^b``.

    Args:
        peer: this participant's protocol state machine, past ``close_shares()``
            (stage MASKED_INPUT) when :meth:`protect` is called.
        codec: the fixed-point codec every participant of the round shares; its
            ``bits`` must match the protocol's ring width.
        rng: randomness of the codec's stochastic rounding.
    """

    name = "masked"

    def __init__(self, peer: SecAggPeer, codec: FixedPointCodec, rng: np.random.Generator) -> None:
        if codec.bits != peer.config.bits:
            raise ConfigError(
                f"codec bits={codec.bits} differs from the protocol's bits={peer.config.bits}"
            )
        self.peer = peer
        self.codec = codec
        self.rng = rng

    @property
    def bits(self) -> int:
        return self.codec.bits

    @property
    def length(self) -> int:
        return self.peer.config.vector_length

    def protect(self, x: np.ndarray) -> bytes:
        """``y = encode(x) + PRG(b) + sum of signed pairwise masks`` (the peer's round 2)."""
        encoded = self.codec.encode(x, self.rng)
        return ring_to_bytes(self.peer.masked_input(encoded, out=encoded))

    def add(self, a: bytes, b: bytes) -> bytes:
        """Ring sum of two masked payloads."""
        ya = ring_from_bytes(a, self.bits, self.length)
        ring_add(ya, ring_from_bytes(b, self.bits, self.length), out=ya)
        return ring_to_bytes(ya)

    def open(self, total: bytes) -> np.ndarray:
        """Unmask the survivors' sum (the peer must be in UNMASK with enough shares)."""
        z = self.peer.finalize(ring_from_bytes(total, self.bits, self.length), in_place=True)
        return self.codec.decode(z)


class CkksBackend:
    """CKKS sums under the round's public context.

    Args:
        public: the public context the key holder published for the round.
        me: this participant's id, recorded as the contributor of its payload.
        key_holder: this participant's :class:`CkksKeyHolder` when it is the round's
            key holder, else None.
    """

    name = "ckks"

    def __init__(
        self, public: CkksPublicContext, me: str, key_holder: CkksKeyHolder | None = None
    ) -> None:
        if key_holder is not None and key_holder.public.fingerprint != public.fingerprint:
            raise ConfigError("key_holder belongs to another public context")
        if not me:
            raise ConfigError("me must be a non-empty participant id")
        self.public = public
        self.me = me
        self.key_holder = key_holder

    def protect(self, x: np.ndarray) -> bytes:
        return ckks_encrypt(self.public, x, contributor=self.me)

    def add(self, a: bytes, b: bytes) -> bytes:
        return ckks_add(self.public, a, b)

    def open(self, total: bytes) -> np.ndarray:
        """Decrypt the aggregate; only on the key holder, once per round."""
        if self.key_holder is None:
            raise KeyHolderRefusal(f"{self.me} is not the round's key holder and cannot open sums")
        return self.key_holder.decrypt_sum(total)
