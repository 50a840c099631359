"""Masks prepared before their round: the secrets they come from, and the masks of
the usual case (Bonawitz et al., CCS'17, §4: the masks need nothing of the input).

A peer's masks in round ``r`` are its self mask (seed ``b``) and one pairwise mask per
neighbour ``j`` (seed from the agreement of its ``s`` key with ``j``'s). When both
keys of every pair and ``b`` are drawn and advertised before the round, a peer can
expand the sum of those masks while its update is still being computed, and the round
adds the input to that sum instead of expanding the masks. :class:`MaskingSecrets`
are the ``s`` pair and ``b`` drawn ahead (each used in one round only, like the ones a
round draws itself); :func:`usual_masks` is the list of ``(seed, sign)`` a peer adds
when every neighbour it knows a key of is in the round, the same list
:meth:`~secure_agg.protocol.SecAggPeer.premask` hands out in that case.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from secure_agg.errors import ConfigError
from secure_agg.keys import KeyPair, agree, generate_keypair, pairwise_mask_seed
from secure_agg.protocol.config import SEED_BYTES, ProtocolConfig, usable_public_key
from secure_agg.protocol.unmasking import Mask

__all__ = ["MaskingSecrets", "pairwise_masks", "usual_masks"]


@dataclass(frozen=True)
class MaskingSecrets:
    """The ``s`` key pair and self-mask seed ``b`` of a peer's later round, drawn ahead.

    A :class:`~secure_agg.protocol.SecAggPeer` built with them advertises ``s`` and
    commits to ``b`` instead of drawing its own; the caller hands one to one round
    only."""

    s: KeyPair
    b: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.b, bytes) or len(self.b) != SEED_BYTES:
            raise ConfigError(f"b must be {SEED_BYTES} bytes")

    @classmethod
    def draw(cls, s_seed: bytes, b: bytes) -> MaskingSecrets:
        """From 32 random bytes for the ``s`` key and 32 for ``b``."""
        return cls(generate_keypair(s_seed), b)


def pairwise_masks(
    config: ProtocolConfig,
    me: str,
    s: KeyPair,
    s_pks: Mapping[str, bytes],
    others: Iterable[str],
    sign: int = 1,
) -> list[Mask]:
    """``(seed, sign * s_ij)`` of ``me``'s pairwise mask with each of ``others`` (sorted),
    from ``me``'s ``s`` pair and each other's ``s`` public key in ``s_pks``."""
    masks: list[Mask] = []
    for j in sorted(others):
        seed = pairwise_mask_seed(agree(s.private, s_pks[j]), config.ctx, me, j)
        masks.append((seed, sign * config.mask_sign(me, j)))
    return masks


def usual_masks(
    config: ProtocolConfig, me: str, secrets: MaskingSecrets, s_pks: Mapping[str, bytes]
) -> list[Mask]:
    """The masks ``me`` adds to its input in the round of ``config`` when it advertises
    ``secrets`` and every neighbour whose key ``s_pks`` gives (a usable X25519 key) is
    ready with that key: the self mask, then the pairwise masks in neighbour order."""
    known = {j for j, pk in s_pks.items() if usable_public_key(pk)}
    others = (config.graph.neighbours(me) & known) - {me}
    return [(secrets.b, 1), *pairwise_masks(config, me, secrets.s, s_pks, others)]
