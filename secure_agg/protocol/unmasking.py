"""What finalize removes from the survivors' masked sum, and the secrets it needs for that.

Which pairwise masks with a dropped org the sum carries depends on each survivor's
``U2``, the orgs whose shares it held when it masked. The survivors agree on those
views before any share is released (:func:`agreed_views` checks them), and
:func:`dangling_pairs` reads the masks off them; :func:`unremovable` names a dropped
org whose masks too few survivors can help remove. Without agreed views only the
views the releases report are known, and a silent survivor next to a dropped org
makes the plan fail rather than guess.

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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from secure_agg import shamir
from secure_agg.errors import ConfigError, SecAggError
from secure_agg.keys import KeyPair, agree, generate_keypair, pairwise_mask_seed
from secure_agg.messages import AdvertiseKeys, UnmaskShares
from secure_agg.protocol.config import SEED_BYTES, ProtocolConfig
from secure_agg.protocol.errors import InconsistentView
from secure_agg.shamir import Share

__all__ = [
    "CannotUnmask",
    "Mask",
    "UnmaskPlan",
    "Views",
    "agreed_views",
    "dangling_pairs",
    "plan_unmasking",
    "removal_masks",
    "unremovable",
]

Mask = tuple[bytes, int]
"""A mask's PRG seed and the sign it is added with."""

Views = dict[str, frozenset[str]]
"""Per survivor, its ``U2``: the orgs whose shares it held when it masked (itself
included), hence the dropped orgs whose pairwise masks its masked input carries."""


class CannotUnmask(Exception):
    """A secret the sum needs cannot be reconstructed, or does not match its owner's keys."""


@dataclass(frozen=True)
class UnmaskPlan:
    """b_shares: survivor -> the released shares of its self-mask seed (only survivors
    whose seed must be reconstructed). s_shares: dropped org -> the released shares of
    its mask key. pairs: dropped org -> the survivors whose pairwise mask with it the
    sum still carries (empty: nothing to remove for it). undecided: without agreed
    views, dropped org -> the survivors next to it that did not report whether they
    masked with it (their masks with it cannot be known until they do)."""

    b_shares: dict[str, list[Share]]
    s_shares: dict[str, list[Share]]
    pairs: dict[str, list[str]]
    undecided: dict[str, list[str]] = field(default_factory=dict)

    def missing(self, threshold: int) -> dict[str, int]:
        """Per org whose secret is needed: how many more shares must still arrive (for
        an undecided dropped org, at least the reports of its silent neighbours)."""
        need = {j: threshold - len(v) for j, v in self.b_shares.items()}
        need.update(
            {k: threshold - len(self.s_shares.get(k, [])) for k, js in self.pairs.items() if js}
        )
        for k, silent in self.undecided.items():
            need[k] = max(need.get(k, 0), len(silent))
        return {org: n for org, n in sorted(need.items()) if n > 0}


def agreed_views(
    config: ProtocolConfig,
    u1: frozenset[str],
    u3: frozenset[str],
    views: Mapping[str, Iterable[str]],
) -> Views:
    """The agreed ``U2`` view of every survivor in ``u3``, checked: each holds its
    owner, lies in its owner's neighbourhood within ``u1``, and covers the survivors
    of that neighbourhood (whose masks with it cancel); :class:`InconsistentView`
    otherwise. Views of non-survivors are not kept."""
    out: Views = {}
    missing = sorted(u3 - views.keys())
    if missing:
        raise InconsistentView(f"no agreed U2 view of survivors {missing}")
    for j in sorted(u3):
        view = frozenset(views[j])
        near = config.graph.closed(j)
        if j not in view or not view <= near & u1:
            raise InconsistentView(f"the agreed U2 view of {j!r} is impossible: {sorted(view)}")
        lacking = sorted((near & u3) - view)
        if lacking:
            raise InconsistentView(
                f"survivor {j!r} holds no shares of survivors {lacking}: masks would not cancel"
            )
        out[j] = view
    return out


def dangling_pairs(u3: frozenset[str], views: Mapping[str, frozenset[str]]) -> dict[str, list[str]]:
    """Per dropped org some survivor masked with: those survivors, sorted (every one of
    them holds a share of its mask key, and no other survivor does)."""
    pairs: dict[str, list[str]] = {}
    for j in sorted(u3):
        for k in views[j] - u3:
            pairs.setdefault(k, []).append(j)
    return dict(sorted(pairs.items()))


def unremovable(
    config: ProtocolConfig, u3: frozenset[str], views: Mapping[str, frozenset[str]]
) -> str | None:
    """Why the masks of a dropped org can never come off the sum, naming it: fewer than
    ``t`` survivors hold shares of its mask key (only a survivor releases); ``None``
    when every dropped org's key can be reconstructed from the survivors' releases."""
    t = config.threshold
    for k, holders in dangling_pairs(u3, views).items():
        if len(holders) < t:
            return (
                f"the pairwise masks of dropped {k!r} with survivors {holders} are in the "
                f"sum, and only those {len(holders)} survivors hold shares of its mask key, "
                f"fewer than the threshold t={t}: they cannot be removed"
            )
    return None


def plan_unmasking(
    config: ProtocolConfig,
    me: str,
    u3: frozenset[str],
    unmasks: Mapping[str, UnmaskShares],
    revealed: Mapping[str, bytes],
    *,
    agreed: Mapping[str, frozenset[str]] | None = None,
    u1: frozenset[str] = frozenset(),
) -> UnmaskPlan:
    """The plan for the releases ``unmasks`` (by sender) received so far, given the
    self-mask seeds already ``revealed`` and the survivors' ``agreed`` U2 views.
    Without agreed views, the views the releases report: a survivor that did not
    report leaves each org of ``u1`` that dropped next to it undecided."""
    # a survivor's own seed and the revealed ones need no reconstruction
    b_shares: dict[str, list[Share]] = {j: [] for j in u3 if j not in revealed and j != me}
    s_shares: dict[str, list[Share]] = {}
    for m in unmasks.values():
        for owner, share in m.b_shares:
            if owner in b_shares:
                b_shares[owner].append(share)
        for owner, share in m.s_shares:
            s_shares.setdefault(owner, []).append(share)
    if agreed is not None:
        return UnmaskPlan(b_shares, s_shares, dangling_pairs(u3, agreed))
    views = {s: frozenset(m.received_from) for s, m in unmasks.items()}
    pairs: dict[str, list[str]] = {}
    undecided: dict[str, list[str]] = {}
    for k in sorted(({k for v in views.values() for k in v} | u1) - u3):
        # a survivor next to k that did not report may or may not have masked with it
        # (k may have reached it alone before dropping): that is never guessed
        near = config.graph.neighbours(k)
        silent = sorted((u3 & near) - views.keys())
        if silent:
            undecided[k] = silent
        pairs[k] = sorted(r for r, v in views.items() if r in u3 and r in near and k in v)
    return UnmaskPlan(b_shares, s_shares, pairs, undecided)


def removal_masks(
    config: ProtocolConfig,
    plan: UnmaskPlan,
    known_seeds: Mapping[str, bytes],
    adverts: Mapping[str, AdvertiseKeys],
) -> list[Mask]:
    """Every mask the sum still carries: ``-PRG(b_j)`` for each survivor (its seed known
    or reconstructed from ``plan.b_shares``), then each dangling pairwise mask.
    :class:`CannotUnmask` for an undecided dropped org (see :class:`UnmaskPlan`)."""
    if plan.undecided:
        k, silent = next(iter(sorted(plan.undecided.items())))
        raise CannotUnmask(
            f"survivors {silent} did not report whether they hold shares of dropped {k!r}, "
            "and no agreed U2 views say so: their masks with it cannot be removed"
        )
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
