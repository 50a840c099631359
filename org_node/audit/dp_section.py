"""The differential-privacy section of a run's audit report.

Each round of a run with an epsilon is charged for the noise its survivors added, on
the mechanism every participant signed in the run spec (``org_node.dp_spec``); the
section lists per round the survivors, the noise as a multiple of one org's
sensitivity and the ε of the round and composed (Rényi DP accountant). Its ``agreed``
object holds what a verifier needs to recompute the whole section from the report's
own rounds (:func:`recomputed_dp_section`, called by ``fedweave audit verify``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from org_node.audit.records import ReportError, canonical
from org_node.privacy import GaussianRound, RdpAccountant, SkellamRound

__all__ = ["DpFacts", "dp_section", "recomputed_dp_section", "skellam_dp_facts"]


def _finite(value: float | None, what: str) -> None:
    if value is not None and not math.isfinite(value):
        raise ReportError(f"{what} must be a finite number")


@dataclass(frozen=True)
class DpFacts:
    """Org-level DP of the run: one mechanism per round, ε reported at ``delta``.

    ``survivors`` and ``rounds`` (when known): per mechanism, how many orgs' noise the
    round's sum held and its 1-based round; ``agreed``: the mechanism of the run spec
    and what sizes it (``participants``, ``threshold``, ``dimension``, ``noise_shares``),
    from which a verifier recomputes every round's ε.
    """

    mechanisms: tuple[GaussianRound | SkellamRound, ...]
    delta: float
    l2_clip: float
    epsilon_budget: float | None = None
    survivors: tuple[int, ...] = ()
    rounds: tuple[int, ...] = ()
    agreed: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.delta < 1.0:
            raise ReportError("delta must be in (0, 1)")
        _finite(self.l2_clip, "l2_clip")
        _finite(self.epsilon_budget, "epsilon_budget")


def skellam_dp_facts(
    agreed: Mapping[str, Any],
    rounds: Sequence[tuple[int, int]],
    epsilon_budget: float | None,
) -> DpFacts:
    """The DP of a run on the agreed Skellam mechanism: ``agreed`` is the DP section's
    ``agreed`` object (the spec's mechanism, the participants and threshold that size
    each org's noise share, the vector's dimension), ``rounds`` the ``(round,
    survivors)`` of each released round; each round is charged for its survivors'
    noise (:func:`org_node.privacy.skellam_round_for`)."""
    from org_node.dp_spec import DpMechanism
    from org_node.privacy import agreed_noise, skellam_round_for

    mechanism = DpMechanism.from_dict(agreed["mechanism"])
    noise = agreed_noise(mechanism, int(agreed["participants"]), int(agreed["threshold"]))
    dim = int(agreed["dimension"])
    return DpFacts(
        mechanisms=tuple(skellam_round_for(noise, dim, s) for _, s in rounds),
        delta=mechanism.delta,
        l2_clip=mechanism.l2_clip,
        epsilon_budget=epsilon_budget,
        survivors=tuple(s for _, s in rounds),
        rounds=tuple(r for r, _ in rounds),
        agreed=dict(agreed) | {"noise_shares": noise.n_orgs},
    )


def _noise_over_sensitivity(mech: GaussianRound | SkellamRound) -> float:
    if isinstance(mech, GaussianRound):
        return mech.noise_multiplier
    return math.sqrt(mech.variance) / mech.l2_sensitivity


def dp_section(dp: DpFacts | None) -> dict[str, Any] | None:
    if dp is None:
        return None
    acct = RdpAccountant()
    per_round = []
    for index, mech in enumerate(dp.mechanisms):
        acct.charge(mech)
        row: dict[str, Any] = {
            "round": dp.rounds[index] if dp.rounds else index + 1,
            "noise_over_sensitivity": _noise_over_sensitivity(mech),
            "epsilon": acct.round_epsilon(dp.delta),
            "epsilon_cumulative": acct.epsilon(dp.delta),
        }
        if dp.survivors:
            row["survivors"] = dp.survivors[index]
        per_round.append(row)
    mechs = {type(m).__name__ for m in dp.mechanisms}
    noise = sorted({m.noise_multiplier for m in dp.mechanisms if isinstance(m, GaussianRound)})
    if dp.agreed is not None:
        noise = [float(dp.agreed["mechanism"]["noise_multiplier"])]
    return {
        "mechanism": "gaussian"
        if mechs == {"GaussianRound"}
        else (
            "skellam" if mechs == {"SkellamRound"} or dp.agreed else "mixed" if mechs else "none"
        ),
        "noise_multipliers": noise,
        "l2_clip": dp.l2_clip,
        "delta": dp.delta,
        "epsilon_budget": dp.epsilon_budget,
        "agreed": None if dp.agreed is None else dict(dp.agreed),
        "rounds": per_round,
        "epsilon_total": acct.epsilon(dp.delta) if dp.mechanisms else 0.0,
    }


def recomputed_dp_section(doc: Mapping[str, Any]) -> dict[str, Any] | None:
    """The DP section a report's own figures give (None when the report has no agreed
    mechanism to recompute from): the agreed mechanism of the section, each round's
    survivors from the report's rounds, and the spec's budget."""
    dp = doc.get("differential_privacy")
    if not isinstance(dp, Mapping) or dp.get("agreed") is None:
        return None
    alive = {r["round"]: len(r["survivors"]) for r in doc["rounds"]}
    rounds = [(row["round"], alive.get(row["round"], 0)) for row in dp["rounds"]]
    if any(s < 1 for _, s in rounds):
        raise ReportError("a charged round has no survivors in the report's rounds")
    agreed = {k: v for k, v in dp["agreed"].items() if k != "noise_shares"}
    facts = skellam_dp_facts(agreed, rounds, doc["run"]["spec"].get("epsilon"))
    section: dict[str, Any] = json.loads(canonical(dp_section(facts)))
    return section
