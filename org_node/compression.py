"""Compressed secure updates: the run spec's ``compression``, parsed and checked.

This module is light (no numpy: the run spec imports it); the compressor itself, which
the run engine calls each round, is :class:`org_node.compressor.Compressor`.

A run may ask (run spec ``compression``) that every org compress its packed update
(:func:`org_node.strategies.pack_weighted`: the model's coordinates, then the weight
and FedNova's ``w * tau``) before it is masked. The compression is the same at every
node, and nothing in it depends on one org's private values:

``random-k=F``
    every org sends the same coordinates, a fraction ``F`` of them each round: each
    coordinate has a pseudo-random phase drawn from the run's agreed seed
    (:func:`org_node.compressor.run_seed`: SHA-256 of the run key every participant
    holds), and round ``r`` sends the coordinates whose phases fall in its window, the
    ``r``-th of ``1 / F`` windows that tile the circle (:func:`org_node.compressor.support`).
    So every coordinate is sent once a lap of about ``1 / F`` rounds, never twice, and
    never waits longer: sampling without replacement. The support is public and
    independent of any org's data, so sparsity reveals nothing about which of an org's
    values were large (per-org top-k would, under secure aggregation). The selected
    values are sent **unscaled**: the sum is a biased estimate for one round, and the
    rest of each org's update stays in its **error-feedback residual** (Stich et al.,
    "Sparsified SGD with memory", NeurIPS 2018), so nothing is lost, only delayed: over
    rounds, what an org sent plus its residual equals what it meant to send.
``q8``
    each sent model coordinate becomes an 8-bit level (:class:`secure_agg.q8.Q8Codec`:
    stochastic rounding, unbiased within range) summed in the **narrowest ring** the
    participants' sum needs (:func:`secure_agg.q8.ring_bits_for`: 10 bits for up to
    4 orgs, 12 for 16, 14 for 64, 16 beyond), packed on the wire: 1.25 to 2 bytes
    instead of the dense codec's 4 or 8
    (:meth:`org_node.compressor.Compressor.ring_bits`); at most
    :data:`Q8_MAX_PARTICIPANTS` (257) participants fit its headroom (the spec refuses
    more). The range of tensor ``t`` in round ``r`` is the mean over the survivors of
    round ``r - 1`` of each org's largest ``|value|`` sent in that tensor (a tensor
    random-k sent nothing of in ``r - 1`` keeps its range): each org adds its
    maxima to the round's secure sum, so the range is an aggregate every survivor
    decodes identically, never one org's value. Round 0 has no such range yet: it is
    sent with the run's dense codec (a calibration round). A value beyond the range is
    clipped to it, and the quantization error and the clipped part go to the residual.
    The weight, ``w * tau`` and the maxima need more than 8 bits: they travel exactly,
    as 64-bit fixed-point values cut into byte limbs (:func:`secure_agg.q8.to_limbs`).

**Each org's local job starts from the agreed model plus its residual**, in the
model's units (:meth:`org_node.compressor.Compressor.local_start`): a coordinate the
org has not sent holds its progress on it, and each update adds only what is new.
Restarted from the agreed model instead (Stich et al.'s form), a coordinate left out
for ``k`` rounds carries ``k`` copies of nearly the same step, an overshoot once the
local job runs long (DiLoCo's). Carried, it drifts toward the org's own data until
it is sent, at most ``ceil(1 / F)`` rounds, which sampling without replacement bounds
(drawn afresh each round, a coordinate can wait many times that).
``python -m bench.compression`` measures the outcome; ARCHITECTURE records the forms
measured and not kept (restarting, and a support drawn afresh each round). Nothing of
it leaves the org: it changes only where its local job starts, never what is sent or
how it is summed. (``carry``, the option that asked for this before it became how every
compressed run works, is still accepted and changes nothing.)

Both ``random-k`` and ``q8`` combine (``random-k=0.1,q8``: 0.125 bytes per parameter
for 4 orgs).

The residual and the ranges are kept in the engine state (persisted every round). The
ranges are agreed state that a model alone does not carry, so a run with ``q8`` cannot
catch a node up by adopting the federation's model (:meth:`RunEngine.try_catch_up`);
with ``random-k`` alone it can (the node keeps the residual of its own state: what it
has not sent yet is still its to send).

Not with DP: the distributed noise is calibrated to the dense codec's ring, and the
summed maxima would be released without noise; a spec with both an ``epsilon`` and a
``compression`` is refused, as is one with the CKKS backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["COMPRESSION_NONE", "Q8_MAX_PARTICIPANTS", "Compression", "CompressionError"]

COMPRESSION_NONE = "none"
"""The run spec's default: the dense codec, and no entry in the run key."""

Q8_MAX_PARTICIPANTS = 257
"""The most participants of a q8 run: their 8-bit levels and byte limbs sum in the
16-bit ring without wrapping (``min`` of :data:`secure_agg.q8.MAX_SUMMANDS` and
:data:`secure_agg.q8.MAX_LIMB_SUMMANDS`)."""


_CHOICES = "choose none, random-k=F, q8, or both joined by a comma (e.g. random-k=0.1,q8)"


class CompressionError(ValueError):
    """A compression the run spec cannot take, or a compressor state that is unreadable."""


@dataclass(frozen=True)
class Compression:
    """A parsed ``compression``: the random-k fraction (None: every coordinate) and q8."""

    fraction: float | None = None
    q8: bool = False

    @classmethod
    def parse(cls, text: object) -> Compression:
        """``none``, or ``random-k=F`` (``0 < F < 1``) and ``q8``, either or both, joined by
        commas (in any order, each at most once). ``carry`` may join them: every
        compressed run carries its residual now, so it changes nothing and is not kept."""
        if not isinstance(text, str) or not text.strip():
            raise CompressionError(f"compression must be a string: {_CHOICES}")
        if text.strip() == COMPRESSION_NONE:
            return cls()
        fraction: float | None = None
        q8 = carry = False
        for raw in text.split(","):
            part = raw.strip()
            if part == "q8" and not q8:
                q8 = True
            elif part == "carry" and not carry:
                carry = True
            elif part.startswith("random-k=") and fraction is None:
                fraction = _fraction(part.removeprefix("random-k="))
            else:
                again = part in ("q8", "carry") or part.startswith("random-k=")
                raise CompressionError(
                    f"compression {text!r}: {part!r} "
                    + ("comes more than once" if again else "is not random-k=F or q8")
                    + f"; {_CHOICES}"
                )
        if carry and fraction is None and not q8:
            raise CompressionError(
                f"compression {text!r}: carry keeps a residual that only random-k or q8 "
                "leaves; add one of them, or drop carry"
            )
        return cls(fraction, q8)

    @property
    def none(self) -> bool:
        return self.fraction is None and not self.q8

    def __str__(self) -> str:
        """The canonical text (what the run spec stores and the run key hashes)."""
        parts = [] if self.fraction is None else [f"random-k={self.fraction!r}"]
        parts += ["q8"] if self.q8 else []
        return ",".join(parts) or COMPRESSION_NONE

    def check_run(self, *, participants: int, backend: str, epsilon: float | None) -> None:
        """Refuse a run this compression cannot serve (CKKS, DP, too many for q8)."""
        if self.none:
            return
        if backend != "masked":
            raise CompressionError(
                f"compression {self}: the {backend} backend sums ciphertexts, not ring "
                "vectors; compression needs the masked backend (or compression none)"
            )
        if epsilon is not None:
            raise CompressionError(
                f"compression {self} with an epsilon: the DP noise is calibrated to the "
                "dense codec's ring and q8's ranges would be released without noise; "
                "use compression none for a run with DP"
            )
        if self.q8 and participants > Q8_MAX_PARTICIPANTS:
            raise CompressionError(
                f"compression q8: {participants} participants exceed the {Q8_MAX_PARTICIPANTS} "
                "whose 8-bit levels the 16-bit ring can sum; drop q8"
            )


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise CompressionError(f"random-k={text}: the fraction is not a number") from None
    if not (math.isfinite(value) and 0.0 < value < 1.0):
        raise CompressionError(f"random-k={text}: the fraction must lie strictly between 0 and 1")
    return value
