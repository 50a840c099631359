"""One org's compressor of its packed updates: the run's agreed seed, the random-k
support, q8 levels, the error-feedback residual and q8's agreed ranges.

What each compression does and why is in :mod:`org_node.compression`; this module is
what the run engine (:class:`~org_node.engine.RunEngine`) calls each round:
:meth:`Compressor.local_start` (where the org's local job starts: the agreed model
plus its residual), :meth:`Compressor.start_round` (over the global model),
:meth:`Compressor.encode` (the org's ring vector), :meth:`Compressor.decode` (the ring
sum back to a packed sum) and :meth:`Compressor.commit` (the round completed: keep the
residual, its scale and the ranges).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from coordinator_free.sealed import SealedError, pack_parts, unpack_parts

from org_node.compression import Compression, CompressionError
from org_node.run_config import EngineError, RunPlan
from secure_agg.codec import FixedPointCodec
from secure_agg.prg import add_masks
from secure_agg.q8 import MAX_LIMB_SUMMANDS, Q8Codec, from_limbs, to_limbs

__all__ = ["Compressor", "compressor_for", "run_seed", "support", "window"]

_SEED_DOMAIN = b"fedweave/compression/random-k/v2\x00"
_SUPPORT_CHUNK = 1 << 20
"""Coordinates whose phases :func:`support` draws and compares at a time."""
_RANGE_FLOOR = 1e-30
"""The smallest q8 range: a tensor whose maxima summed to 0 still divides by a range."""


def run_seed(run_key: str) -> bytes:
    """The run's agreed support seed: SHA-256 of the run key, which every participant
    holds (the hash of the spec it accepted)."""
    return hashlib.sha256(_SEED_DOMAIN + run_key.encode()).digest()


def window(fraction: float) -> int:
    """The width of a round's window of phases: ``fraction`` of the 64-bit circle."""
    return min(2**64 - 1, max(1, int(fraction * 2.0**64)))


def support(seed: bytes, round: int, total: int, fraction: float) -> np.ndarray:
    """The sorted indices every org sends in round ``round``, of ``total`` coordinates.

    Coordinate ``i`` has a phase: the ``i``-th 64-bit word of one AES-CTR expansion of
    ``seed`` (:func:`secure_agg.prg.expand`). Round ``r`` sends the coordinates whose
    phase lies in ``[r W, (r + 1) W)`` modulo ``2^64``, ``W`` = :func:`window`: the
    windows tile the circle, so every coordinate is sent once a lap of ``1 / fraction``
    rounds (``floor`` or ``ceil`` of it apart), never twice in a lap and never left out
    of one: sampling without replacement. A pure function of ``seed`` and ``round`` on
    every platform, computed a chunk at a time."""
    width = window(fraction)
    start = np.uint64(int(round) * width % 2**64)
    phases = np.empty(min(int(total), _SUPPORT_CHUNK), dtype=np.uint64)
    out: list[np.ndarray] = []
    for offset in range(0, int(total), _SUPPORT_CHUNK):
        part = phases[: min(_SUPPORT_CHUNK, int(total) - offset)]
        part.fill(0)
        add_masks(part, [(seed, 1)], offset=offset)
        part -= start  # modulo 2^64: the phase's distance past the window's start
        out.append(np.flatnonzero(part < np.uint64(width)) + offset)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


@dataclass
class _Round:
    """One round's plan: the support (None: every coordinate), each sent coordinate's
    tensor, whether the body goes as q8 levels, and what encode left for decode."""

    index: np.ndarray | None
    tensor_of: np.ndarray
    starts: np.ndarray
    q8: bool
    scale: float = 1.0
    residual: np.ndarray | None = None
    range_sums: np.ndarray | None = None
    sent: np.ndarray | None = None


class Compressor:
    """One org's compression of its packed updates (see the module docstring).

    ``codec`` is the run's dense codec (random-k alone, and q8's calibration round);
    ``tail_clip`` bounds the values that travel as 64-bit limbs under q8 (the weight,
    ``w * tau`` and the summed maxima): the engine's clip.
    """

    def __init__(
        self, compression: Compression, *, participants: int, codec: FixedPointCodec
    ) -> None:
        self.compression = compression
        self.n = participants
        self.codec = codec
        self.q8 = Q8Codec(max_summands=participants) if compression.q8 else None
        self.tail = FixedPointCodec(bits=64, clip=codec.clip, max_summands=participants)
        self.residual: np.ndarray | None = None
        self.scale = 1.0
        """The packed body's units per model unit in the round that left ``residual``
        (the org's weight, divided by its steps under FedNova)."""
        self.ranges: np.ndarray | None = None
        self.sizes: list[int] = []
        self._round: _Round | None = None

    @property
    def keeps_agreed_state(self) -> bool:
        """Whether the rounds depend on state agreed earlier (q8's ranges)."""
        return self.q8 is not None

    # -- one round --------------------------------------------------------------------

    def local_start(self, model: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Where this org's local job starts: the agreed ``model`` plus its residual in
        the model's units (each tensor keeps its dtype and the model's order). A
        coordinate not sent for some rounds holds this org's progress on it, and the
        next update, taken from there, adds only what is new. (Restarted from the
        agreed model, as in Stich et al., the residual would add up nearly the same
        step once a round for every round the coordinate waited: an overshoot.)"""
        if self.residual is None or self.scale == 0:
            return dict(model)
        names = sorted(model)
        sizes = [int(np.size(model[k])) for k in names]
        if self.residual.shape != (sum(sizes),):
            raise CompressionError("the saved residual does not fit the model")
        out: dict[str, np.ndarray] = {}
        offset = 0
        for name, size in zip(names, sizes, strict=True):
            value = np.asarray(model[name])
            part = self.residual[offset : offset + size].reshape(value.shape) / self.scale
            out[name] = (value + part).astype(value.dtype)
            offset += size
        return {k: out[k] for k in model}

    def start_round(
        self, run_key: str, round: int, model: Mapping[str, np.ndarray], scale: float = 1.0
    ) -> None:
        """Plan round ``round`` over the global ``model`` (tensors by sorted name);
        ``scale``: the packed body's units per model unit this round (the org's weight,
        divided by its steps under FedNova), for :meth:`local_start` after it."""
        names = sorted(model)
        self.sizes = [int(np.size(model[k])) for k in names]
        total = sum(self.sizes)
        if self.residual is not None and self.residual.shape != (total,):
            raise CompressionError("the saved residual does not fit the model")
        if self.ranges is not None and self.ranges.shape != (len(names),):
            raise CompressionError("the saved q8 ranges do not fit the model")
        starts = np.cumsum([0, *self.sizes[:-1]]).astype(np.int64)
        fraction = self.compression.fraction
        if fraction is None:
            index = None
            tensor_of = np.repeat(np.arange(len(names)), self.sizes)
        else:
            index = support(run_seed(run_key), round, total, fraction)
            tensor_of = np.searchsorted(starts, index, side="right") - 1
        q8 = self.q8 is not None and self.ranges is not None
        self._round = _Round(index, tensor_of, starts, q8, float(scale))

    def _plan(self) -> _Round:
        if self._round is None:
            raise CompressionError("start_round comes before encode and decode")
        return self._round

    def encode(self, packed: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """This org's ring vector for ``packed`` (its residual added), and the residual
        that remains once it is sent (kept until :meth:`commit`)."""
        plan = self._plan()
        body_size = sum(self.sizes)
        body, extras = packed[:body_size], packed[body_size:]
        target = body if self.residual is None else body + self.residual
        sent = target if plan.index is None else target[plan.index]
        maxima = self._maxima(sent, plan) if self.q8 is not None else np.zeros(0)
        if plan.q8:
            assert self.q8 is not None and self.ranges is not None
            ranges = self.ranges[plan.tensor_of]
            levels = self.q8.encode(sent, ranges, rng)
            own = self.q8.decode(levels, ranges)
            tail = self.tail.encode(np.concatenate([extras, maxima]), rng)
            vector = np.concatenate([levels, to_limbs(tail)])
            own_extras = self.tail.decode(tail)[: extras.shape[0]]
        else:
            vector = self.codec.encode(np.concatenate([sent, extras, maxima]), rng)
            decoded = self.codec.decode(vector)
            own = decoded[: sent.shape[0]]
            own_extras = decoded[sent.shape[0] : sent.shape[0] + extras.shape[0]]
        left = target.copy()
        contribution = np.zeros(packed.shape[0])
        if plan.index is None:
            left -= own
            contribution[:body_size] = own
        else:
            left[plan.index] -= own
            contribution[plan.index] = own
        contribution[body_size:] = own_extras
        plan.residual, plan.sent = left, contribution
        return vector

    def ring_bits(self) -> int:
        """The narrow ring this round's vector sums in: q8's (:attr:`Q8Codec.ring_bits`,
        the fewest bits the participants' levels and limbs need, packed on the wire),
        or 0 (the dense codec's ring: random-k alone, and q8's calibration round)."""
        plan = self._plan()
        return self.q8.ring_bits if plan.q8 and self.q8 is not None else 0

    def contribution(self) -> np.ndarray:
        """What this org's last encoded vector carries, as a packed vector: its own
        decoding (zeros where nothing was sent). The ring sum decodes to the sum of
        these over the survivors, up to float rounding (the harness's plaintext check)."""
        plan = self._plan()
        if plan.sent is None:
            raise CompressionError("encode comes before contribution")
        return plan.sent

    def _maxima(self, sent: np.ndarray, plan: _Round) -> np.ndarray:
        """This org's largest ``|value|`` sent in each tensor."""
        out = np.zeros(len(self.sizes))
        np.maximum.at(out, plan.tensor_of, np.abs(sent))
        return np.minimum(out, self.codec.clip)

    def decode(self, total: np.ndarray) -> np.ndarray:
        """The summed packed vector (zeros where nothing was sent) from the ring sum."""
        plan = self._plan()
        sent = plan.tensor_of.shape[0]
        if plan.q8:
            assert self.q8 is not None and self.ranges is not None
            body = self.q8.decode(total[:sent], self.ranges[plan.tensor_of])
            tail = self.tail.decode(from_limbs(total[sent:], min(self.n, MAX_LIMB_SUMMANDS)))
        else:
            values = self.codec.decode(total)
            body, tail = values[:sent], values[sent:]
        tensors = len(self.sizes) if self.q8 is not None else 0
        extras = tail[: tail.shape[0] - tensors]
        plan.range_sums = tail[tail.shape[0] - tensors :] if tensors else None
        out = np.zeros(sum(self.sizes) + extras.shape[0])
        if plan.index is None:
            out[:sent] = body
        else:
            out[plan.index] = body
        out[sum(self.sizes) :] = extras
        return out

    def commit(self, survivors: int) -> None:
        """The round completed with ``survivors`` orgs' vectors in its sum: keep the
        residual encode left and, under q8, the next round's ranges (the survivors'
        mean of their maxima)."""
        plan = self._plan()
        self.residual, self.scale = plan.residual, plan.scale
        if plan.range_sums is not None:
            fresh = np.maximum(plan.range_sums / max(1, survivors), _RANGE_FLOOR)
            if self.ranges is not None:  # a tensor random-k sent none of keeps its range
                sent = np.bincount(plan.tensor_of, minlength=len(self.sizes)) > 0
                fresh = np.where(sent, fresh, self.ranges)
            self.ranges = fresh
        self._round = None

    # -- persistence ------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        parts: dict[str, bytes] = {"meta": str(self.compression).encode()}
        for name, value in (("residual", self.residual), ("ranges", self.ranges)):
            if value is not None:
                parts[name] = np.ascontiguousarray(value, dtype="<f8").tobytes()
        parts["scale"] = np.array([self.scale], dtype="<f8").tobytes()
        return pack_parts(parts)

    def load(self, data: bytes) -> None:
        """Continue from :meth:`to_bytes` of the same run's compressor."""
        try:
            parts = unpack_parts(data)
            kept = parts["meta"].decode()
            same = str(Compression.parse(kept)) == str(self.compression)  # in canonical form
        except (SealedError, KeyError, UnicodeDecodeError, CompressionError) as exc:
            raise CompressionError(f"unreadable compressor state: {exc}") from None
        if not same:
            raise CompressionError(f"compressor state of {kept!r}, not {self.compression}")

        def array(name: str) -> np.ndarray | None:
            raw = parts.get(name)
            if raw is None:
                return None
            if len(raw) % 8:
                raise CompressionError(f"unreadable compressor state: {name}")
            return np.frombuffer(raw, dtype="<f8").astype(np.float64)

        self.residual, self.ranges = array("residual"), array("ranges")
        scale = array("scale")
        if scale is not None and (scale.shape != (1,) or not 0 <= scale[0] < math.inf):
            raise CompressionError("unreadable compressor state: scale")
        self.scale = 1.0 if scale is None else float(scale[0])


def compressor_for(plan: RunPlan, codec: FixedPointCodec) -> Compressor | None:
    """The run's compressor over its dense ``codec``, or None for ``none``; raises
    :class:`~org_node.run_config.EngineError` (field ``compression``) for a compression
    the run cannot take (CKKS, an epsilon, too many participants for q8)."""
    try:
        compression = Compression.parse(plan.compression)
        compression.check_run(
            participants=len(plan.participants), backend=plan.backend, epsilon=plan.epsilon
        )
    except CompressionError as exc:
        raise EngineError("compression", str(exc)) from None
    if compression.none:
        return None
    return Compressor(compression, participants=len(plan.participants), codec=codec)
