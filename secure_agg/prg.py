"""Mask expansion: a 32-byte seed becomes a vector of ring elements.

The pseudorandom generator is AES-256 in counter mode (NIST SP 800-38A, Section 6.5)
from `cryptography`, keyed with the seed, with an all-zero initial counter block.
This is the ``PRG`` of Bonawitz et al. (CCS'17, Section 4): every seed is used for
exactly one expansion (pairwise seeds come from HKDF bound to the round and the pair,
self-mask seeds are fresh per round), so a fixed counter start is safe.

The keystream is read as little-endian 16-, 32- or 64-bit words, so ``expand(seed, n, 32)``
is a prefix of the same byte stream as ``expand(seed, n // 2, 64)``. It is written with
``update_into`` straight into the destination (or into one reused scratch buffer),
in chunks of :data:`CHUNK_BYTES`: no full-size temporary and no per-element Python.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes

from .errors import ConfigError, RingError
from .ring import check_ring, ring_dtype

__all__ = ["CHUNK_BYTES", "FUSED_CHUNK_BYTES", "SEED_BYTES", "add_mask", "add_masks", "expand"]

#: Length of a PRG seed (an AES-256 key).
SEED_BYTES = 32
#: Bytes of keystream produced per ``update_into`` call; a multiple of every word size.
CHUNK_BYTES = 1 << 20

_ZERO_COUNTER = bytes(16)
_ZEROS = np.zeros(CHUNK_BYTES, dtype=np.uint8)
_ZEROS.flags.writeable = False
_LITTLE_ENDIAN = sys.byteorder == "little"
_BITS = {np.dtype(np.uint16): 16, np.dtype(np.uint32): 32, np.dtype(np.uint64): 64}


def _keystream(seed: bytes, start: int = 0) -> CipherContext:
    """The keystream of ``seed`` from its byte ``start`` on (CTR mode seeks for free:
    the counter block of byte ``start`` is ``start // 16``)."""
    if not isinstance(seed, bytes | bytearray) or len(seed) != SEED_BYTES:
        raise ConfigError(f"seed must be {SEED_BYTES} bytes")
    if not start:
        return Cipher(algorithms.AES(bytes(seed)), modes.CTR(_ZERO_COUNTER)).encryptor()
    block, skip = divmod(start, 16)
    encryptor = Cipher(
        algorithms.AES(bytes(seed)), modes.CTR(block.to_bytes(16, "big"))
    ).encryptor()
    if skip:
        encryptor.update(bytes(skip))
    return encryptor


def _fill(encryptor: CipherContext, dest: np.ndarray) -> None:
    """Write ``dest.nbytes`` keystream bytes into the contiguous array ``dest``."""
    raw = dest.view(np.uint8)
    for start in range(0, raw.shape[0], CHUNK_BYTES):
        part = raw[start : start + CHUNK_BYTES]
        encryptor.update_into(_ZEROS[: part.shape[0]].data, part.data)
    if not _LITTLE_ENDIAN:
        dest.byteswap(inplace=True)


def expand(seed: bytes, length: int, bits: int) -> np.ndarray:
    """Expand a 32-byte ``seed`` into ``length`` uniformly random elements of ``Z_2^bits``.

    Raises:
        ConfigError: the seed is not 32 bytes, ``length`` is negative or ``bits`` is
            not 16, 32 or 64.
    """
    dtype = ring_dtype(bits)
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ConfigError(f"length must be a non-negative int, got {length!r}")
    encryptor = _keystream(seed)
    out = np.empty(length, dtype=dtype)
    _fill(encryptor, out)
    return out


def add_mask(target: np.ndarray, seed: bytes, sign: int = 1) -> None:
    """Add ``sign * expand(seed, len(target), bits)`` to ``target`` in place, mod ``2^bits``.

    The keystream is produced chunk by chunk into one scratch buffer and folded into
    ``target`` with ``np.add``/``np.subtract`` (``out=``), so the cost stays close to
    that of the raw AES-CTR keystream. See :func:`add_masks` for several seeds at once.

    Raises:
        RingError: ``target`` is not a contiguous, writeable one-dimensional ring array.
        ConfigError: ``sign`` is not +1 or -1, or the seed is not 32 bytes.
    """
    add_masks(target, [(seed, sign)])


#: Words of ``target`` processed per pass of :func:`add_masks`: small enough that the
#: slice stays in the L2 cache while every mask is folded into it.
FUSED_CHUNK_BYTES = 1 << 18


def add_masks(
    target: np.ndarray,
    masks: Sequence[tuple[bytes, int]],
    *,
    base: np.ndarray | None = None,
    offset: int = 0,
) -> None:
    """Add ``sum(sign * expand(seed))`` over ``masks`` to ``target`` in place, mod ``2^bits``.

    With ``base`` (a ring array of the same dtype and length), ``target`` receives
    ``base + sum(...)`` instead, and its previous contents are ignored: the first mask
    is folded straight from ``base``, which saves the caller a copy pass.

    With ``offset``, ``target`` is the part of a longer vector that starts at element
    ``offset``: it receives elements ``[offset, offset + len(target))`` of each
    expansion, and the keystream before them is skipped, not computed.

    Equal to calling :func:`add_mask` once per ``(seed, sign)``, but fused: ``target``
    is walked once, in cache-sized slices, and each slice receives the next keystream
    block of every mask before the walk moves on. The target's memory traffic is paid
    once instead of once per mask, which keeps a peer's whole masking step (a self
    mask plus one pairwise mask per neighbour) close to the cost of the AES-CTR
    keystream alone.

    Raises:
        RingError: ``target`` is not a contiguous, writeable one-dimensional ring array.
        ConfigError: a ``sign`` is not +1 or -1, or a seed is not 32 bytes.
    """
    if not isinstance(target, np.ndarray) or target.dtype not in _BITS:
        raise RingError("target must be a uint16, uint32 or uint64 numpy array")
    bits = _BITS[target.dtype]
    check_ring(target, bits)
    if not target.flags.c_contiguous or not target.flags.writeable:
        raise RingError("target must be C-contiguous and writeable")
    if base is not None:
        check_ring(base, bits, target.shape[0])
        if base.dtype != target.dtype:
            raise RingError("base must have the target's dtype")
    for _, sign in masks:
        if isinstance(sign, bool) or sign not in (1, -1):
            raise ConfigError(f"sign must be +1 or -1, got {sign!r}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ConfigError(f"offset must be a non-negative int, got {offset!r}")
    start = offset * target.dtype.itemsize
    streams = [
        (_keystream(seed, start).update_into, np.add if sign == 1 else np.subtract)
        for seed, sign in masks
    ]
    length = target.shape[0]
    if not streams or length == 0:
        if base is not None:
            np.copyto(target, base)
        return
    # The hot loop makes two C calls per mask and slice (keystream into the scratch
    # buffer, fold into the target); everything else is hoisted out of it.
    words_per_chunk = FUSED_CHUNK_BYTES // target.dtype.itemsize
    scratch = np.empty(min(words_per_chunk, length), dtype=target.dtype)
    zeros = _ZEROS.data if scratch.nbytes <= _ZEROS.nbytes else memoryview(bytes(scratch.nbytes))
    mask, mask_bytes, zero_bytes = scratch, scratch.view(np.uint8).data, zeros[: scratch.nbytes]
    for start in range(0, length, words_per_chunk):
        stop = min(start + words_per_chunk, length)
        part = target[start:stop]
        if stop - start != mask.shape[0]:  # the last, shorter slice
            mask = scratch[: stop - start]
            mask_bytes, zero_bytes = mask.view(np.uint8).data, zeros[: mask.nbytes]
        first = part if base is None else base[start:stop]
        for update_into, op in streams:
            update_into(zero_bytes, mask_bytes)
            if not _LITTLE_ENDIAN:
                mask.byteswap(inplace=True)
            op(first, mask, out=part)
            first = part
