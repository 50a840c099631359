"""CKKS homomorphic sums (TenSEAL) for the secure aggregation interface.

Cheon, Kim, Kim and Song, "Homomorphic Encryption for Arithmetic of Approximate
Numbers" (ASIACRYPT 2017) is the scheme; TenSEAL (Benaissa et al., 2021) over
Microsoft SEAL is the implementation. Aggregation needs only ciphertext + ciphertext
additions, so the parameters are *addition-only* (see :class:`CkksParams`).

TenSEAL has no threshold decryption. The trust model implemented here is a
**per-round key holder** (``docs/SECURITY.md``, "CKKS backend (TenSEAL)"):

* :func:`choose_key_holder` picks one participant per round as a pure function of
  the round context and the participant set, rotating over rounds.
* The key holder (:class:`CkksKeyHolder`) makes a fresh key pair for the round and
  publishes the public context only (no secret key).
* Every participant encrypts its vector with :func:`ckks_encrypt`; ciphertexts are
  summed along a chain with :func:`ckks_add` (public context only). The chain
  (:func:`ring_order`) starts at the key holder, which sends its own ciphertext on,
  and ends back at it, so the key holder never receives an individual ciphertext or a
  partial sum, only the final aggregate bundle, which
  :meth:`CkksKeyHolder.decrypt_sum` opens once, and only if it is marked as the sum of
  at least ``threshold`` distinct participants.

:func:`simulate_round` runs this flow in process and returns the transcript of
messages, which is what the tests inspect.

SEAL draws its encryption randomness from the operating system; TenSEAL exposes no
seed, so ciphertexts cannot be byte-exact test vectors. The framing
(:class:`CkksBundle`) and the key-holder choice are pure and have fixed vectors.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import tenseal as ts

from .errors import ConfigError, ProtocolError, RingError
from .keys import RoundContext

__all__ = [
    "CkksBundle",
    "CkksKeyHolder",
    "CkksParams",
    "CkksPublicContext",
    "CkksRoundResult",
    "KeyHolderRefusal",
    "Message",
    "choose_key_holder",
    "ckks_add",
    "ckks_encrypt",
    "ckks_sum",
    "ring_order",
    "simulate_round",
]

#: Largest total coefficient-modulus bit count for 128-bit classical security, per
#: polynomial degree (HomomorphicEncryption.org security standard, Table 1, as used by
#: SEAL's ``CoeffModulus::MaxBitCount``).
_MAX_BITS_128: dict[int, int] = {2048: 54, 4096: 109, 8192: 218, 16384: 438, 32768: 881}

_BUNDLE_MAGIC = b"FWCK"
_CONTEXT_MAGIC = b"FWCP"
_VERSION = 1
_HOLDER_DOMAIN = b"fedweave/ckks-key-holder\x00"
_ORDER_DOMAIN = b"fedweave/ckks-ring-order\x00"


class KeyHolderRefusal(ProtocolError):
    """The key holder refused to decrypt: not an aggregate of enough participants,
    someone outside the round, or a second decryption in the same round."""


@dataclass(frozen=True)
class CkksParams:
    """Addition-only CKKS parameters.

    A ciphertext lives at the first ("data") level only; the last prime of the chain
    is SEAL's special prime, used only for key switching, which aggregation never
    performs. With no multiplication there is no rescaling, so one data prime is
    enough, and each extra prime would only add wire bytes.

    The defaults, ``N = 4096`` with ``(50, 20)`` and scale ``2^30``, were measured with
    TenSEAL 0.3.18 (SEAL's zstd-compressed serialization) on uniform inputs in
    ``[-1, 1]``:

    ======  ============  =====  =======  ============  =================
    N       chain         scale  B/param  max err, one  max err, sum of 20
    ======  ============  =====  =======  ============  =================
    8192    (60, 40, 60)  2^40   57.4     7e-9          3e-8
    4096    (40, 20, 40)  2^20   39.5     4e-3          1e-2
    4096    (60, 20)      2^40   32.1     4e-9          2e-8
    4096    (50, 20)      2^30   28.8     3e-6          1e-5
    4096    (40, 20)      2^25   24.0     1e-4          5e-4
    ======  ============  =====  =======  ============  =================

    ``(50, 20)`` at ``2^30`` is the most precise chain measured under 32 wire bytes per
    parameter (``(60, 20)`` is just over), about ``3e-6`` per summand, with room for
    sums up to ``2^18`` in magnitude (:attr:`max_abs_sum`); ``N = 4096`` encrypts slightly faster
    per parameter than 8192 and wastes fewer slots on short vectors. 70 bits of
    modulus is far below the 109 allowed at ``N = 4096`` for 128-bit security.

    Attributes:
        poly_modulus_degree: ``N``, a power of two in 2048..32768; ``N/2`` slots per
            ciphertext.
        coeff_mod_bit_sizes: bit sizes of the modulus chain; all primes but the last
            are data primes, the last is the special prime. At least two entries,
            each in 14..60.
        global_scale_bits: ``log2`` of the encoding scale; must leave at least two bits
            of headroom under the data modulus.
    """

    poly_modulus_degree: int = 4096
    coeff_mod_bit_sizes: tuple[int, ...] = (50, 20)
    global_scale_bits: int = 30

    def __post_init__(self) -> None:
        n = self.poly_modulus_degree
        if isinstance(n, bool) or n not in _MAX_BITS_128:
            raise ConfigError(
                f"poly_modulus_degree must be one of {sorted(_MAX_BITS_128)}, got {n!r}"
            )
        sizes = self.coeff_mod_bit_sizes
        if not isinstance(sizes, tuple) or len(sizes) < 2:
            raise ConfigError(
                "coeff_mod_bit_sizes must be a tuple of at least two bit sizes "
                "(data primes then the special prime)"
            )
        if any(isinstance(b, bool) or not isinstance(b, int) or not 14 <= b <= 60 for b in sizes):
            raise ConfigError(f"coeff_mod_bit_sizes entries must be ints in 14..60, got {sizes}")
        if sum(sizes) > _MAX_BITS_128[n]:
            raise ConfigError(
                f"coeff_mod_bit_sizes total {sum(sizes)} bits exceeds {_MAX_BITS_128[n]}, "
                f"the 128-bit security limit for poly_modulus_degree={n}"
            )
        s = self.global_scale_bits
        top = sum(sizes[:-1]) - 2
        if isinstance(s, bool) or not isinstance(s, int) or not 10 <= s <= top:
            raise ConfigError(
                f"global_scale_bits must be an int in 10..{top} "
                f"(at least two bits under the data modulus), got {s!r}"
            )

    @property
    def slots(self) -> int:
        """Values packed per ciphertext: ``N / 2``."""
        return self.poly_modulus_degree // 2

    @property
    def global_scale(self) -> float:
        """The encoding scale ``2^global_scale_bits``."""
        return float(2**self.global_scale_bits)

    @property
    def max_abs_sum(self) -> float:
        """Bound on ``|value|`` of any slot of a ciphertext or of a sum of them.

        A slot decodes correctly while ``|value| * scale`` stays under half the data
        modulus (the product of the data primes); one more bit is kept for the noise.
        """
        data_bits = sum(self.coeff_mod_bit_sizes[:-1])
        return float(2 ** (data_bits - self.global_scale_bits - 2))

    def to_bytes(self) -> bytes:
        """Canonical encoding: N (u32), scale bits (u8), chain length (u8), bit sizes."""
        sizes = self.coeff_mod_bit_sizes
        return struct.pack(
            f">IBB{len(sizes)}B",
            self.poly_modulus_degree,
            self.global_scale_bits,
            len(sizes),
            *sizes,
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> tuple[CkksParams, int]:
        """Parse :meth:`to_bytes` at the start of ``data``; return params and bytes used."""
        if len(data) < 6:
            raise ConfigError("CKKS parameters are truncated")
        n, scale_bits, count = struct.unpack_from(">IBB", data)
        end = 6 + count
        if len(data) < end:
            raise ConfigError("CKKS parameters are truncated")
        return cls(n, tuple(data[6:end]), scale_bits), end


def _new_context(params: CkksParams) -> ts.Context:
    ctx = ts.context(
        ts.SCHEME_TYPE.CKKS,
        params.poly_modulus_degree,
        coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes),
        n_threads=1,
    )
    ctx.global_scale = params.global_scale
    return ctx


class CkksPublicContext:
    """A round's public CKKS context: encrypts and adds, cannot decrypt.

    The wire form is ``"FWCP" | version | params | TenSEAL public context``. The
    :attr:`fingerprint` (SHA-256 of the wire form) names the round key in every
    bundle, so that ciphertexts under different keys are never mixed.
    """

    def __init__(self, params: CkksParams, context: ts.Context, wire: bytes) -> None:
        if context.is_private():
            raise ConfigError("a public CKKS context must not hold the secret key")
        self.params = params
        self.context = context
        self.wire = wire
        self.fingerprint = hashlib.sha256(wire).digest()

    @classmethod
    def from_bytes(cls, data: bytes) -> CkksPublicContext:
        """Load a public context; refuse malformed data or one carrying a secret key."""
        data = bytes(data)
        if data[:4] != _CONTEXT_MAGIC or len(data) < 5 or data[4] != _VERSION:
            raise ConfigError("not a fedweave CKKS public context (bad magic or version)")
        params, used = CkksParams.from_bytes(data[5:])
        try:
            context = ts.context_from(data[5 + used :])
        except Exception as exc:  # TenSEAL raises bare ValueError/RuntimeError
            raise ConfigError(f"cannot parse the TenSEAL public context: {exc}") from exc
        return cls(params, context, data)

    def to_bytes(self) -> bytes:
        """The wire form (also what :attr:`fingerprint` hashes)."""
        return self.wire


def _as_public(public_context: CkksPublicContext | bytes) -> CkksPublicContext:
    if isinstance(public_context, CkksPublicContext):
        return public_context
    return CkksPublicContext.from_bytes(public_context)


@dataclass(frozen=True)
class CkksBundle:
    """A vector encrypted as consecutive ciphertexts of ``N/2`` slots each.

    Wire form (big-endian): ``"FWCK" | version u8 | context fingerprint (32) |
    length u64 | contributor count u16 | each contributor (u16 length, UTF-8) |
    chunk count u32 | each chunk (u32 length, TenSEAL ciphertext bytes)``.

    Attributes:
        fingerprint: SHA-256 of the public context the chunks are encrypted under.
        length: number of plaintext values (the last chunk may be partly used).
        contributors: the participants whose vectors were added into this bundle,
            sorted and distinct.
        chunks: serialized TenSEAL CKKS vectors.
    """

    fingerprint: bytes
    length: int
    contributors: tuple[str, ...]
    chunks: tuple[bytes, ...] = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.fingerprint) != 32:
            raise ConfigError("fingerprint must be 32 bytes")
        if self.length < 1:
            raise ConfigError(f"a bundle must hold at least one value, got length {self.length}")
        if not self.contributors or any(not c for c in self.contributors):
            raise ConfigError("contributors must be non-empty participant ids")
        if list(self.contributors) != sorted(set(self.contributors)):
            raise ConfigError("contributors must be sorted and distinct")

    def to_bytes(self) -> bytes:
        """Serialize to the wire form."""
        parts = [
            _BUNDLE_MAGIC,
            bytes([_VERSION]),
            self.fingerprint,
            struct.pack(">QH", self.length, len(self.contributors)),
        ]
        for c in self.contributors:
            raw = c.encode()
            parts.append(struct.pack(">H", len(raw)))
            parts.append(raw)
        parts.append(struct.pack(">I", len(self.chunks)))
        for chunk in self.chunks:
            parts.append(struct.pack(">I", len(chunk)))
            parts.append(chunk)
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> CkksBundle:
        """Parse the wire form; :class:`ConfigError` on any malformed input."""
        view = memoryview(data)
        try:
            if bytes(view[:4]) != _BUNDLE_MAGIC or view[4] != _VERSION:
                raise ConfigError("not a fedweave CKKS bundle (bad magic or version)")
            fingerprint = bytes(view[5:37])
            length, count = struct.unpack_from(">QH", view, 37)
            pos = 47
            contributors = []
            for _ in range(count):
                (size,) = struct.unpack_from(">H", view, pos)
                contributors.append(bytes(view[pos + 2 : pos + 2 + size]).decode())
                pos += 2 + size
            (n_chunks,) = struct.unpack_from(">I", view, pos)
            pos += 4
            chunks = []
            for _ in range(n_chunks):
                (size,) = struct.unpack_from(">I", view, pos)
                if pos + 4 + size > len(view):
                    raise ConfigError("CKKS bundle is truncated")
                chunks.append(bytes(view[pos + 4 : pos + 4 + size]))
                pos += 4 + size
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise ConfigError(f"malformed CKKS bundle: {exc}") from exc
        if pos != len(view):
            raise ConfigError(f"CKKS bundle has {len(view) - pos} trailing bytes")
        return cls(fingerprint, length, tuple(contributors), tuple(chunks))

    def check_for(self, public: CkksPublicContext) -> None:
        """Raise :class:`ConfigError` unless this bundle fits ``public``'s key and slots."""
        if self.fingerprint != public.fingerprint:
            raise ConfigError(
                "CKKS bundle was encrypted under another public context (fingerprint mismatch)"
            )
        expected = -(-self.length // public.params.slots)
        if len(self.chunks) != expected:
            raise ConfigError(
                f"CKKS bundle of length {self.length} must have {expected} chunks "
                f"of {public.params.slots} slots, has {len(self.chunks)}"
            )


def _check_vector(vector: np.ndarray, params: CkksParams) -> np.ndarray:
    x = np.asarray(vector)
    if x.ndim != 1 or x.shape[0] == 0:
        raise RingError(f"expected a non-empty one-dimensional vector, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating) and not np.issubdtype(x.dtype, np.integer):
        raise RingError(f"expected a real-valued vector, got dtype {x.dtype}")
    x = x.astype(np.float64, copy=False)
    if not np.all(np.isfinite(x)):
        raise RingError("the vector holds NaN or Inf")
    peak = float(np.max(np.abs(x)))
    if peak > params.max_abs_sum:
        raise ConfigError(
            f"|value| {peak:g} exceeds {params.max_abs_sum:g}; lower global_scale_bits "
            f"or widen the first coeff_mod_bit_sizes entry"
        )
    return x


def _load_chunk(context: ts.Context, bundle: CkksBundle, index: int, slots: int) -> ts.CKKSVector:
    """Chunk ``index`` of ``bundle`` as a TenSEAL vector; ConfigError if it is not one
    of the expected size."""
    expected = min(slots, bundle.length - index * slots)
    try:
        vec = ts.ckks_vector_from(context, bundle.chunks[index])
    except Exception as exc:  # TenSEAL raises bare ValueError/RuntimeError
        raise ConfigError(f"chunk {index} is not a TenSEAL CKKS vector: {exc}") from exc
    if vec.size() != expected:
        raise ConfigError(f"chunk {index} holds {vec.size()} values, expected {expected}")
    return vec


def ckks_encrypt(
    public_context: CkksPublicContext | bytes, vector: np.ndarray, *, contributor: str
) -> bytes:
    """Encrypt ``vector`` (any length) into a bundle of ``ceil(len / (N/2))`` ciphertexts.

    Args:
        public_context: the round's public context (or its wire bytes).
        vector: one-dimensional real vector; ``|value| <= params.max_abs_sum``.
        contributor: the encrypting participant's id, recorded in the bundle so that the
            key holder can count distinct contributions.
    """
    public = _as_public(public_context)
    x = _check_vector(vector, public.params)
    slots = public.params.slots
    chunks = tuple(
        ts.ckks_vector(public.context, x[i : i + slots]).serialize()
        for i in range(0, x.shape[0], slots)
    )
    return CkksBundle(public.fingerprint, x.shape[0], (contributor,), chunks).to_bytes()


def ckks_sum(public_context: CkksPublicContext | bytes, bundles: Iterable[bytes]) -> bytes:
    """Homomorphically add bundles with the public context only.

    Raises:
        ConfigError: a bundle is under another key, malformed, or two bundles share a
            contributor (the same vector would be counted twice).
        RingError: lengths differ.
    """
    public = _as_public(public_context)
    parsed = [CkksBundle.from_bytes(b) for b in bundles]
    if not parsed:
        raise RingError("ckks_sum needs at least one bundle")
    first = parsed[0]
    contributors: set[str] = set()
    for bundle in parsed:
        bundle.check_for(public)
        if bundle.length != first.length:
            raise RingError(
                f"cannot add CKKS bundles of lengths {first.length} and {bundle.length}"
            )
        overlap = contributors.intersection(bundle.contributors)
        if overlap:
            raise ConfigError(f"contributors {sorted(overlap)} would be counted twice")
        contributors.update(bundle.contributors)
    chunks = []
    for i in range(len(first.chunks)):
        acc = _load_chunk(public.context, first, i, public.params.slots)
        for bundle in parsed[1:]:
            acc.add_(_load_chunk(public.context, bundle, i, public.params.slots))
        chunks.append(acc.serialize())
    return CkksBundle(
        public.fingerprint, first.length, tuple(sorted(contributors)), tuple(chunks)
    ).to_bytes()


def ckks_add(public_context: CkksPublicContext | bytes, a: bytes, b: bytes) -> bytes:
    """Add two bundles with the public context only (see :func:`ckks_sum`)."""
    return ckks_sum(public_context, (a, b))


class CkksKeyHolder:
    """The round's key holder: makes the key, publishes the public context, opens one sum.

    Args:
        params: CKKS parameters for the round.
        threshold: least number of distinct contributors in a bundle it will decrypt
            (at least 2: a "sum" of one is an individual vector).
        participants: the round's participant set; a bundle naming anyone else is refused.
    """

    def __init__(
        self, params: CkksParams, *, threshold: int, participants: Collection[str]
    ) -> None:
        members = frozenset(participants)
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 2:
            raise ConfigError(f"threshold must be an int >= 2, got {threshold!r}")
        if threshold > len(members):
            raise ConfigError(f"threshold {threshold} exceeds the {len(members)} participants")
        self.params = params
        self.threshold = threshold
        self.participants = members
        self._secret = _new_context(params)
        public = self._secret.copy()
        public.make_context_public()
        wire = _CONTEXT_MAGIC + bytes([_VERSION]) + params.to_bytes() + public.serialize()
        self.public = CkksPublicContext(params, public, wire)
        self._opened = False

    def public_context_bytes(self) -> bytes:
        """The public context to hand to every participant (no secret key inside)."""
        return self.public.to_bytes()

    def decrypt_sum(self, bundle_bytes: bytes) -> np.ndarray:
        """Decrypt the round's aggregate, once; return float64 values.

        Each chunk gets a fresh encryption of zero added before it is decrypted, so the
        released values are not the exact decryption of a ciphertext the sender knows
        (the passive key-recovery attack on CKKS, Li and Micciancio, EUROCRYPT 2021).

        Raises:
            KeyHolderRefusal: fewer than ``threshold`` contributors, a contributor outside
                the round, or a second call (two sums over different sets would reveal
                their difference).
            ConfigError: the bundle is malformed or under another key.
        """
        bundle = CkksBundle.from_bytes(bundle_bytes)
        bundle.check_for(self.public)
        outsiders = set(bundle.contributors) - self.participants
        if outsiders:
            raise KeyHolderRefusal(f"bundle names non-participants {sorted(outsiders)}")
        if len(bundle.contributors) < self.threshold:
            raise KeyHolderRefusal(
                f"bundle sums {len(bundle.contributors)} contribution(s); "
                f"the key holder opens only sums of at least {self.threshold}"
            )
        if self._opened:
            raise KeyHolderRefusal("the key holder opens one aggregate per round")
        slots = self.params.slots
        vectors = [_load_chunk(self._secret, bundle, i, slots) for i in range(len(bundle.chunks))]
        self._opened = True
        out = np.empty(len(bundle.chunks) * slots, dtype=np.float64)
        zeros = np.zeros(slots)
        pos = 0
        for vec in vectors:
            # Re-randomize before decrypting (Li and Micciancio, EUROCRYPT 2021): the
            # released result then carries fresh noise that whoever built the aggregate
            # ciphertext does not know, so (ciphertext, result) is no linear equation in
            # the secret key. See docs/SECURITY.md, "CKKS backend (TenSEAL)".
            vec.add_(ts.ckks_vector(self._secret, zeros[: vec.size()]))
            values = np.asarray(vec.decrypt(), dtype=np.float64)
            out[pos : pos + values.shape[0]] = values
            pos += values.shape[0]
        return out[: bundle.length].copy()


def _lp(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _check_participants(participants: Collection[str]) -> list[str]:
    members = sorted(set(participants))
    if len(members) != len(participants) or not members or any(not p for p in members):
        raise ConfigError("participants must be distinct, non-empty ids (at least one)")
    return members


def choose_key_holder(ctx: RoundContext, participants: Collection[str]) -> str:
    """The round's key holder: a pure, rotating function of the round and participants.

    ``base = SHA-256(domain | federation | run | sorted participants) mod n`` and the
    holder is ``sorted(participants)[(base + round) mod n]``: for a stable participant
    set every member holds the key exactly once in any ``n`` consecutive rounds, and no
    member can steer the choice without changing the (signed) participant set.
    """
    members = _check_participants(participants)
    h = hashlib.sha256(_HOLDER_DOMAIN)
    h.update(_lp(ctx.federation.encode()))
    h.update(_lp(ctx.run.encode()))
    for m in members:
        h.update(_lp(m.encode()))
    base = int.from_bytes(h.digest(), "big")
    return members[(base + ctx.round) % len(members)]


def ring_order(ctx: RoundContext, participants: Collection[str]) -> list[str]:
    """The chain for the round: the key holder first, then the others by
    ``SHA-256(domain | round context | id)``.

    The key holder encrypts first and the last peer delivers the total to it, so the
    key holder receives exactly one ciphertext bundle in the round: the aggregate.
    """
    members = _check_participants(participants)
    holder = choose_key_holder(ctx, members)
    prefix = _ORDER_DOMAIN + _lp(ctx.to_bytes())
    others = sorted(
        (m for m in members if m != holder),
        key=lambda m: hashlib.sha256(prefix + _lp(m.encode())).digest(),
    )
    return [holder, *others]


@dataclass(frozen=True)
class Message:
    """One message of a simulated round: ``kind`` is ``public_context``, ``partial``
    (a running sum along the chain), ``aggregate`` (the total, to the key holder) or
    ``result`` (the decrypted float64 sum, from the key holder)."""

    sender: str
    recipient: str
    kind: str
    payload: bytes = field(repr=False)


@dataclass(frozen=True)
class CkksRoundResult:
    """Outcome of :func:`simulate_round`."""

    key_holder: str
    contributors: tuple[str, ...]
    total: np.ndarray
    transcript: tuple[Message, ...]


def simulate_round(
    ctx: RoundContext,
    inputs: Mapping[str, np.ndarray],
    *,
    threshold: int,
    params: CkksParams | None = None,
    drop: Collection[str] = (),
) -> CkksRoundResult:
    """Run one CKKS aggregation round in process and record every message.

    The flow, over :func:`ring_order`: the key holder sends the public context to
    everyone; it encrypts its own vector and sends it to the next peer; each peer adds
    its own ciphertext and forwards the running sum; the last peer sends the
    ``aggregate`` to the key holder, which decrypts it and sends the ``result`` to every
    contributor. Peers in ``drop`` leave before contributing and are skipped.

    Raises:
        ProtocolError: the key holder dropped (the round must be retried with a new
            participant set, hence a new key holder).
        KeyHolderRefusal: fewer than ``threshold`` peers contributed.
    """
    params = params or CkksParams()
    members = list(inputs)
    order = ring_order(ctx, members)
    holder_id = order[0]
    if holder_id in drop:
        raise ProtocolError(f"key holder {holder_id!r} dropped; retry the round without it")
    alive = [p for p in order if p not in drop]
    if len(alive) < threshold:
        raise KeyHolderRefusal(
            f"only {len(alive)} participant(s) left; the round needs at least {threshold}"
        )
    holder = CkksKeyHolder(params, threshold=threshold, participants=members)
    public_bytes = holder.public_context_bytes()
    transcript: list[Message] = [
        Message(holder_id, peer, "public_context", public_bytes) for peer in order[1:]
    ]
    public = CkksPublicContext.from_bytes(public_bytes)
    running = ckks_encrypt(public, inputs[holder_id], contributor=holder_id)
    for i, peer in enumerate(alive[1:], start=1):
        transcript.append(Message(alive[i - 1], peer, "partial", running))
        own = ckks_encrypt(public, inputs[peer], contributor=peer)
        running = ckks_add(public, running, own)
    transcript.append(Message(alive[-1], holder_id, "aggregate", running))
    total = holder.decrypt_sum(running)
    result = total.astype("<f8").tobytes()
    transcript.extend(Message(holder_id, peer, "result", result) for peer in alive[1:])
    return CkksRoundResult(holder_id, tuple(sorted(alive)), total, tuple(transcript))
