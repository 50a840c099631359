"""What finalize removes from the survivors' masked sum, and the secrets it needs for that.

From the UnmaskShares a peer received, :func:`plan_unmasking` works out which secrets
must be reconstructed (the self-mask seed ``b_j`` of each survivor not revealed, the
mask key ``s_sk_k`` of each dropped org some survivor masked with) and which
``(survivor, dropped)`` pairwise masks the sum still carries. :func:`removal_masks`
reconstructs those secrets, checks each against what its owner advertised, and returns
the ``(seed, sign)`` of every mask to subtract (:func:`secure_agg.prg.add_masks`).
A reconstruction that fails raises :class:`CannotUnmask`, which the peer turns into an
abort of the round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from secure_agg import shamir
from secure_agg.errors import ConfigError, SecAggError
from secure_agg.keys import KeyPair, agree, generate_keypair, pairwise_mask_seed
from secure_agg.messages import AdvertiseKeys, UnmaskShares
from secure_agg.protocol.config import SEED_BYTES, ProtocolConfig
from secure_agg.protocol.errors import InconsistentView
from secure_agg.shamir import Share

__all__ = ["CannotUnmask", "Mask", "UnmaskPlan", "plan_unmasking", "removal_masks"]

Mask = tuple[bytes, int]
"""A mask's PRG seed and the sign it is added with."""


class CannotUnmask(Exception):
    """A secret the sum needs cannot be reconstructed, or does not match its owner's keys."""


@dataclass(frozen=True)
class UnmaskPlan:
    """b_shares: survivor -> the released shares of its self-mask seed (only survivors
    whose seed must be reconstructed). s_shares: dropped org -> the released shares of
    its mask key. pairs: dropped org -> the survivors whose pairwise mask with it the
    sum still carries (empty: nothing to remove for it)."""

    b_shares: dict[str, list[Share]]
    s_shares: dict[str, list[Share]]
    pairs: dict[str, list[str]]

    def missing(self, threshold: int) -> dict[str, int]:
        """Per org whose secret is needed: how many more shares must still arrive."""
        need = {j: threshold - len(v) for j, v in self.b_shares.items()}
        need.update(
            {k: threshold - len(self.s_shares.get(k, [])) for k, js in self.pairs.items() if js}
        )
        return {org: n for org, n in sorted(need.items()) if n > 0}


def plan_unmasking(
    config: ProtocolConfig,
    me: str,
    u3: frozenset[str],
    unmasks: Mapping[str, UnmaskShares],
    revealed: Mapping[str, bytes],
) -> UnmaskPlan:
    """The plan for the releases ``unmasks`` (by sender) received so far, given the
    self-mask seeds already ``revealed``; :class:`InconsistentView` when a dropped org's
    pairwise masks cannot be known."""
    views = {s: frozenset(m.received_from) for s, m in unmasks.items()}
    # a survivor's own seed and the revealed ones need no reconstruction
    b_shares: dict[str, list[Share]] = {j: [] for j in u3 if j not in revealed and j != me}
    s_shares: dict[str, list[Share]] = {}
    for m in unmasks.values():
        for owner, share in m.b_shares:
            if owner in b_shares:
                b_shares[owner].append(share)
        for owner, share in m.s_shares:
            s_shares.setdefault(owner, []).append(share)
    dropped = sorted({k for v in views.values() for k in v} - u3)
    pairs = {k: _dangling_with(config, k, u3, views) for k in dropped}
    return UnmaskPlan(b_shares, s_shares, pairs)


def _dangling_with(
    config: ProtocolConfig, k: str, u3: frozenset[str], views: Mapping[str, frozenset[str]]
) -> list[str]:
    """The survivors whose pairwise mask with dropped ``k`` is in the sum: those that
    report holding its shares and, when no reporter lacks them, the silent ones."""
    near = config.graph.neighbours(k)
    have = [r for r, v in sorted(views.items()) if r in near and k in v]
    lack = [r for r, v in sorted(views.items()) if r in near and k not in v]
    silent = sorted((u3 & near) - views.keys())
    if have and lack and silent:
        raise InconsistentView(
            f"dropped {k!r} shared keys with only some of its neighbours, and survivors "
            f"{silent} did not report whether they hold its shares: their masks with it "
            "cannot be removed"
        )
    return sorted({j for j in have if j in u3} | (set() if lack else set(silent)))


def removal_masks(
    config: ProtocolConfig,
    plan: UnmaskPlan,
    known_seeds: Mapping[str, bytes],
    adverts: Mapping[str, AdvertiseKeys],
) -> list[Mask]:
    """Every mask the sum still carries: ``-PRG(b_j)`` for each survivor (its seed known
    or reconstructed from ``plan.b_shares``), then each dangling pairwise mask."""
    b_seeds = dict(known_seeds)
    b_seeds.update(_self_mask_seeds(config, plan, adverts))
    dangling = _dangling_masks(config, plan.pairs, _mask_keys(config, plan, adverts), adverts)
    return [(b_seeds[j], -1) for j in sorted(b_seeds)] + dangling


def _self_mask_seeds(
    config: ProtocolConfig, plan: UnmaskPlan, adverts: Mapping[str, AdvertiseKeys]
) -> dict[str, bytes]:
    """``b_j`` of each survivor in ``plan.b_shares``, checked against its commitment."""
    seeds: dict[str, bytes] = {}
    for j, shares in sorted(plan.b_shares.items()):
        try:
            seeds[j] = shamir.combine(shares, config.threshold, SEED_BYTES, adverts[j].b_commitment)
        except SecAggError as exc:
            raise CannotUnmask(f"cannot reconstruct the self-mask seed of {j!r}: {exc}") from None
    return seeds


def _mask_keys(
    config: ProtocolConfig, plan: UnmaskPlan, adverts: Mapping[str, AdvertiseKeys]
) -> dict[str, KeyPair]:
    """The mask key pair of each dropped org some survivor masked with, checked
    against its advertised ``s_pk``."""
    keys: dict[str, KeyPair] = {}
    for k, js in sorted(plan.pairs.items()):
        if not js:
            continue
        try:
            raw = shamir.combine(plan.s_shares.get(k, []), config.threshold, SEED_BYTES)
            pair = generate_keypair(raw)
        except SecAggError as exc:
            raise CannotUnmask(f"cannot reconstruct the mask key of dropped {k!r}: {exc}") from None
        if pair.public != adverts[k].s_pk:
            raise CannotUnmask(f"reconstructed mask key of dropped {k!r} does not match its s_pk")
        keys[k] = pair
    return keys


def _dangling_masks(
    config: ProtocolConfig,
    pairs: Mapping[str, list[str]],
    keys: Mapping[str, KeyPair],
    adverts: Mapping[str, AdvertiseKeys],
) -> list[Mask]:
    """``-sign(j, k) PRG(s_jk)`` for each survivor j still masked with dropped k."""
    masks: list[Mask] = []
    for k, pair in sorted(keys.items()):
        for j in pairs[k]:
            try:
                shared = agree(pair.private, adverts[j].s_pk)
            except ConfigError:
                raise CannotUnmask(f"survivor {j!r} advertised an unusable s_pk") from None
            masks.append((pairwise_mask_seed(shared, config.ctx, j, k), -config.mask_sign(j, k)))
    return masks
