"""Shamir t-of-n secret sharing of short byte strings over the field ``GF(2^521 - 1)``.

Shamir, "How to share a secret", CACM 1979: a random polynomial ``f`` of degree
``t - 1`` with ``f(0) = secret``; holder ``i`` (1-based) receives ``(i, f(i))``. Any
``t`` shares determine ``f`` by Lagrange interpolation; fewer reveal nothing. The
Mersenne prime ``p = 2^521 - 1`` holds any secret of up to 64 bytes (512 bits).

:func:`combine` never silently returns a wrong secret for the cases it can detect:
too few shares, duplicated or out-of-field indices, shares beyond ``t`` that do not
lie on the interpolated polynomial, a reconstructed value that does not fit
``secret_len`` bytes, or a mismatch with a published :func:`commitment`. With exactly
``t`` shares and no commitment a wrong share cannot be detected (any ``t`` points
define a polynomial), so protocols should pass the commitment or more than ``t`` shares.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .errors import ConfigError, ShareError

__all__ = [
    "MAX_SECRET_BYTES",
    "PRIME",
    "SHARE_BYTES",
    "Share",
    "combine",
    "commitment",
    "split",
]

#: The field modulus, the Mersenne prime ``2^521 - 1``.
PRIME = (1 << 521) - 1
#: Longest secret that can be shared.
MAX_SECRET_BYTES = 64
_Y_BYTES = 66
_MAX_X = 0xFFFF
#: Serialized size of a :class:`Share`: 2-byte x then 66-byte y, both big-endian.
SHARE_BYTES = 2 + _Y_BYTES
_COMMIT_TAG = b"fedweave/shamir-commitment/v1\x00"


@dataclass(frozen=True)
class Share:
    """One point ``(x, y = f(x))`` of the sharing polynomial."""

    x: int
    """The holder's 1-based index, ``1 <= x <= 65535``."""
    y: int
    """The polynomial's value at ``x``, ``0 <= y < PRIME``."""

    def __post_init__(self) -> None:
        if isinstance(self.x, bool) or not isinstance(self.x, int) or not 1 <= self.x <= _MAX_X:
            raise ShareError(f"share index x must be an int in [1, {_MAX_X}], got {self.x!r}")
        if isinstance(self.y, bool) or not isinstance(self.y, int) or not 0 <= self.y < PRIME:
            raise ShareError("share value y must be an int in [0, 2**521 - 1)")

    def to_bytes(self) -> bytes:
        """Fixed-size encoding: 2-byte big-endian x, then 66-byte big-endian y."""
        return struct.pack(">H", self.x) + self.y.to_bytes(_Y_BYTES, "big")

    @classmethod
    def from_bytes(cls, data: bytes) -> Share:
        """Parse :meth:`to_bytes` output.

        Raises:
            ShareError: wrong length, ``x == 0`` or ``y`` outside the field.
        """
        if not isinstance(data, bytes | bytearray) or len(data) != SHARE_BYTES:
            raise ShareError(f"a serialized share is {SHARE_BYTES} bytes")
        (x,) = struct.unpack(">H", data[:2])
        return cls(x=x, y=int.from_bytes(data[2:], "big"))


def commitment(secret: bytes) -> bytes:
    """SHA-256 of a domain-separation prefix and ``secret``.

    Binding, and hiding only because the secrets it is used for (mask seeds, private
    keys) are 32 uniformly random bytes: never publish it for a guessable secret.
    """
    return hashlib.sha256(_COMMIT_TAG + bytes(secret)).digest()


_commit = commitment  # `combine` has a parameter named `commitment`


def _field_element(rng: Callable[[int], bytes]) -> int:
    """A uniform element of ``[0, PRIME)`` by rejection sampling 521-bit integers."""
    while True:
        raw = rng(_Y_BYTES)
        if not isinstance(raw, bytes) or len(raw) != _Y_BYTES:
            raise ConfigError(f"rng({_Y_BYTES}) must return {_Y_BYTES} bytes")
        value = int.from_bytes(raw, "big") & PRIME
        if value != PRIME:
            return value


def _check_t(t: int) -> None:
    if isinstance(t, bool) or not isinstance(t, int) or t < 1:
        raise ConfigError(f"threshold t must be an int >= 1, got {t!r}")


def split(secret: bytes, t: int, n: int, rng: Callable[[int], bytes] | None = None) -> list[Share]:
    """Split ``secret`` (1 to 64 bytes) into ``n`` shares, any ``t`` of which recover it.

    ``rng(k)`` returns ``k`` random bytes (default ``os.urandom``); each of the ``t - 1``
    coefficients of degree 1, 2, ... is drawn in turn from ``rng(66)`` masked to 521 bits
    (redrawn on the single value equal to ``PRIME``). Share ``i`` has ``x = i``.

    Raises:
        ConfigError: empty or too long secret, or not ``1 <= t <= n <= 65535``.
    """
    if not isinstance(secret, bytes | bytearray) or not 1 <= len(secret) <= MAX_SECRET_BYTES:
        raise ConfigError(f"secret must be 1 to {MAX_SECRET_BYTES} bytes")
    _check_t(t)
    if isinstance(n, bool) or not isinstance(n, int) or not t <= n <= _MAX_X:
        raise ConfigError(f"n must be an int with t <= n <= {_MAX_X}, got {n!r}")
    draw = os.urandom if rng is None else rng
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [_field_element(draw) for _ in range(t - 1)]
    shares = []
    for x in range(1, n + 1):
        y = 0
        for c in reversed(coefficients):  # Horner
            y = (y * x + c) % PRIME
        shares.append(Share(x=x, y=y))
    return shares


def _batch_inverse(values: Sequence[int]) -> list[int]:
    """Inverses mod PRIME of non-zero ``values`` with one exponentiation (Montgomery's trick)."""
    prefix = [1]
    for v in values:
        prefix.append(prefix[-1] * v % PRIME)
    inverse = pow(prefix[-1], -1, PRIME)
    out = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        out[i] = inverse * prefix[i] % PRIME
        inverse = inverse * values[i] % PRIME
    return out


@functools.lru_cache(maxsize=64)
def _weights(xs: tuple[int, ...]) -> tuple[int, ...]:
    """Barycentric weights ``1 / prod_{j != i} (x_i - x_j)`` of the points ``xs``."""
    denominators = []
    for i, xi in enumerate(xs):
        d = 1
        for j, xj in enumerate(xs):
            if i != j:
                d = d * (xi - xj) % PRIME
        denominators.append(d)
    return tuple(_batch_inverse(denominators))


@functools.lru_cache(maxsize=1024)
def _lagrange_at(xs: tuple[int, ...], at: int) -> tuple[int, ...]:
    """The Lagrange basis of the points ``xs`` evaluated at ``at`` (not one of ``xs``):
    ``p(at) = sum_i L_i * y_i`` for the polynomial through ``(xs[i], y_i)``."""
    gaps = [(at - x) % PRIME for x in xs]
    node = 1
    for g in gaps:
        node = node * g % PRIME
    return tuple(
        node * w % PRIME * inv % PRIME
        for w, inv in zip(_weights(xs), _batch_inverse(gaps), strict=True)
    )


class _Interpolant:
    """The polynomial through ``points`` in barycentric form (Berrut and Trefethen, 2004).

    The weights and the basis at each evaluation point depend on the ``x`` of the
    points only, which are the same for every secret one set of holders releases
    (every org's self-mask seed in an unmasking): they are computed once per set of
    ``x`` (``O(t^2)`` and one inversion, then ``O(t)`` and one inversion per point) and
    cached, so each further secret costs ``O(t)`` multiplications per evaluation.
    """

    def __init__(self, points: Sequence[Share]) -> None:
        self.xs = tuple(p.x for p in points)
        self.ys = [p.y for p in points]

    def __call__(self, at: int) -> int:
        if at in self.xs:
            return self.ys[self.xs.index(at)]
        total = 0
        for basis, y in zip(_lagrange_at(self.xs, at), self.ys, strict=True):
            total += basis * y
        return total % PRIME


def combine(
    shares: Sequence[Share], t: int, secret_len: int, commitment: bytes | None = None
) -> bytes:
    """Recover the ``secret_len``-byte secret from at least ``t`` shares.

    The first ``t`` shares (in the order given) define the polynomial; every further
    share must lie on it. When ``commitment`` is given the result must match it.

    Raises:
        ShareError: fewer than ``t`` shares, a duplicated ``x``, a share beyond ``t``
            inconsistent with the others, a value that does not fit ``secret_len``
            bytes, or a commitment mismatch.
        ConfigError: invalid ``t`` or ``secret_len``.
    """
    _check_t(t)
    if not isinstance(secret_len, int) or not 1 <= secret_len <= MAX_SECRET_BYTES:
        raise ConfigError(f"secret_len must be 1 to {MAX_SECRET_BYTES}, got {secret_len!r}")
    if len(shares) < t:
        raise ShareError(f"need at least {t} shares, got {len(shares)}")
    for share in shares:
        if not isinstance(share, Share):
            raise ShareError(f"expected Share objects, got {type(share).__name__}")
    xs = [share.x for share in shares]
    if len(set(xs)) != len(xs):
        raise ShareError("duplicated share index x")
    polynomial = _Interpolant(shares[:t])
    for extra in shares[t:]:
        if polynomial(extra.x) != extra.y:
            raise ShareError(f"share x={extra.x} is inconsistent with the other shares")
    value = polynomial(0)
    if value >= 1 << (8 * secret_len):
        raise ShareError("shares do not reconstruct a secret of the expected length")
    secret = value.to_bytes(secret_len, "big")
    if commitment is not None and not hmac.compare_digest(_commit(secret), commitment):
        raise ShareError("reconstructed secret does not match its commitment")
    return secret
