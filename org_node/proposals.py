"""A run proposed once, consented to by each participant, started at a time they agree on.

The proposing org signs a :class:`Proposal` (the run's name and spec, its federation
run key, the proposer, when it was made, the consent deadline and the start delay) and
spreads it over gossip (topic :data:`PROPOSAL_TOPIC`, key the run key). Every
participant records it as ``proposed``. Each participant's admin then accepts or
declines it; the decision is a signed :class:`Consent` (topic :data:`CONSENT_TOPIC`,
same key) that names the run key, the hash of the name and canonical spec, so an org
consents to exactly the spec it checked. Gossip verifies every record against the
origin's key in the federation manifest before anyone stores it.

:func:`decide` is the pure rule every participant applies to the same records, so all
of them reach the same outcome without anyone coordinating:

* every participant accepted: the run starts ``start_delay`` after the latest
  consent (each consent carries its signer's time), the same instant at every org;
* so many declined that the quorum cannot be reached: the run is cancelled, naming
  who declined and why;
* the deadline passed: with at least the quorum accepted (a spec's ``quorum`` below
  the number of participants) the run starts ``start_delay`` after the deadline with
  those; otherwise it is cancelled, naming whom it waited for.

A consent signed after the deadline counts for nothing. Times are integer
milliseconds since the epoch, so the record bytes (and the outcome) are the same at
every org.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from coordinator_free.errors import Refused
from coordinator_free.manifest import canonical_json
from coordinator_free.peer_json import loads_bounded

from org_node.policy import PolicyError, RunSpec
from org_node.run_config import run_key

__all__ = [
    "CONSENT_TOPIC",
    "PROPOSAL_TOPIC",
    "Consent",
    "Outcome",
    "Proposal",
    "ProposalError",
    "consent_signing_bytes",
    "decide",
    "from_ms",
]

PROPOSAL_TOPIC = "run.proposal"
"""Gossip topic of signed run proposals (key: the run key)."""
CONSENT_TOPIC = "run.consent"
"""Gossip topic of each participant's signed consent or decline (key: the run key)."""

DECISIONS = ("accept", "decline")


class ProposalError(ValueError):
    """A proposal or consent record that is malformed or does not match its signer."""


def from_ms(ms: int) -> datetime:
    """A millisecond timestamp as an aware UTC datetime."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def _load(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = loads_bounded(data, what=what)
    except Refused as exc:
        raise ProposalError(exc.detail) from None
    if not isinstance(value, dict) or value.get("v") != 1:
        raise ProposalError(f"{what} is not a version-1 object")
    return value


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProposalError(f"{what} must be a non-negative integer")
    return value


def _str(value: Any, what: str, limit: int = 100) -> str:
    if not isinstance(value, str) or not value or len(value) > limit:
        raise ProposalError(f"{what} must be a string of 1-{limit} characters")
    return value


@dataclass(frozen=True)
class Proposal:
    """A signed proposal of the run ``name`` with ``spec`` (see the module docstring)."""

    name: str
    spec: Mapping[str, Any]
    run_key: str
    proposer: str
    proposed_at_ms: int
    consent_by_ms: int
    start_delay_ms: int

    @classmethod
    def make(
        cls,
        name: str,
        spec: Mapping[str, Any],
        proposer: str,
        now_ms: int,
        consent_timeout_s: int,
        start_delay_s: int,
    ) -> Proposal:
        return cls(
            name=name,
            spec=dict(spec),
            run_key=run_key(name, spec),
            proposer=proposer,
            proposed_at_ms=now_ms,
            consent_by_ms=now_ms + consent_timeout_s * 1000,
            start_delay_ms=start_delay_s * 1000,
        )

    @property
    def run_spec(self) -> RunSpec:
        return RunSpec.from_dict(self.spec)

    @property
    def participants(self) -> tuple[str, ...]:
        return tuple(sorted(self.run_spec.participants))

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": 1,
            "name": self.name,
            "spec": dict(self.spec),
            "run_key": self.run_key,
            "proposer": self.proposer,
            "proposed_at_ms": self.proposed_at_ms,
            "consent_by_ms": self.consent_by_ms,
            "start_delay_ms": self.start_delay_ms,
        }

    def to_record(self) -> bytes:
        return canonical_json(self.to_dict())

    @classmethod
    def from_dict(cls, value: Mapping[str, Any], origin: str | None = None) -> Proposal:
        """Check a proposal object; ``origin`` (its signer) must be its proposer."""
        name = _str(value.get("name"), "name")
        spec = value.get("spec")
        if not isinstance(spec, dict):
            raise ProposalError("spec must be an object")
        try:
            parsed = RunSpec.from_dict(spec)
        except PolicyError as exc:
            raise ProposalError(f"invalid spec: {exc}") from None
        key = _str(value.get("run_key"), "run_key", 32)
        if key != run_key(name, spec):
            raise ProposalError(
                f"the proposal's run key {key} is not the hash of its name and spec "
                f"({run_key(name, spec)})"
            )
        proposer = _str(value.get("proposer"), "proposer")
        if origin is not None and proposer != origin:
            raise ProposalError(f"a proposal by {proposer} signed by {origin}")
        if proposer not in parsed.participants:
            raise ProposalError(f"the proposer {proposer} is not among the participants")
        out = cls(
            name=name,
            spec=dict(spec),
            run_key=key,
            proposer=proposer,
            proposed_at_ms=_int(value.get("proposed_at_ms"), "proposed_at_ms"),
            consent_by_ms=_int(value.get("consent_by_ms"), "consent_by_ms"),
            start_delay_ms=_int(value.get("start_delay_ms"), "start_delay_ms"),
        )
        if out.consent_by_ms <= out.proposed_at_ms:
            raise ProposalError("the consent deadline is not after the proposal")
        return out

    @classmethod
    def from_record(cls, data: bytes, origin: str) -> Proposal:
        return cls.from_dict(_load(data, "a run proposal"), origin)


@dataclass(frozen=True)
class Consent:
    """One participant's signed decision on the run ``run_key``."""

    run_key: str
    org: str
    decision: Literal["accept", "decline"]
    reason: str
    at_ms: int

    def to_record(self) -> bytes:
        return canonical_json(
            {
                "v": 1,
                "run_key": self.run_key,
                "org": self.org,
                "decision": self.decision,
                "reason": self.reason,
                "at_ms": self.at_ms,
            }
        )

    @classmethod
    def from_record(cls, data: bytes, origin: str) -> Consent:
        value = _load(data, "a run consent")
        org = _str(value.get("org"), "org")
        if org != origin:
            raise ProposalError(f"a consent of {org} signed by {origin}")
        decision = value.get("decision")
        if decision not in DECISIONS:
            raise ProposalError(f"decision must be one of {', '.join(DECISIONS)}")
        reason = value.get("reason", "")
        if not isinstance(reason, str) or len(reason) > 500:
            raise ProposalError("reason must be a string of at most 500 characters")
        if decision == "decline" and not reason.strip():
            raise ProposalError("a decline must give its reason")
        return cls(
            run_key=_str(value.get("run_key"), "run_key", 32),
            org=org,
            decision=decision,
            reason=reason,
            at_ms=_int(value.get("at_ms"), "at_ms"),
        )


@dataclass(frozen=True)
class Outcome:
    """What the consents known now mean for the run.

    ``kind``: ``waiting`` (for ``waiting_for`` until the deadline), ``start`` (at
    ``start_at_ms``, with ``accepted``) or ``cancel`` (``reason`` says why).
    """

    kind: Literal["waiting", "start", "cancel"]
    accepted: tuple[str, ...] = ()
    waiting_for: tuple[str, ...] = ()
    start_at_ms: int | None = None
    reason: str = ""
    declined: Mapping[str, str] = field(default_factory=dict)


def consent_signing_bytes(federation: str, consent: Consent) -> bytes:
    """What ``consent.org`` signed when it gossiped ``consent`` in ``federation``: the
    gossip record's signing bytes (topic :data:`CONSENT_TOPIC`, key the run key), which a
    privacy report carries the signature of and its verifier checks."""
    from coordinator_free.gossip import record_signing_bytes

    return record_signing_bytes(
        federation, consent.org, CONSENT_TOPIC, consent.run_key, consent.to_record()
    )


def _when(ms: int) -> str:
    return from_ms(ms).strftime("%Y-%m-%d %H:%M:%S UTC")


def decide(proposal: Proposal, consents: Mapping[str, Consent], now_ms: int) -> Outcome:
    """The outcome of ``proposal`` given the ``consents`` known (org -> consent) at
    ``now_ms`` (see the module docstring); the same inputs give the same outcome."""
    parts = proposal.participants
    valid = {
        org: c
        for org, c in consents.items()
        if org in parts and c.run_key == proposal.run_key and c.at_ms <= proposal.consent_by_ms
    }
    accepted = tuple(o for o in parts if o in valid and valid[o].decision == "accept")
    declined = {o: valid[o].reason for o in parts if o in valid and valid[o].decision == "decline"}
    pending = tuple(o for o in parts if o not in valid)
    needed = proposal.run_spec.consents_needed
    if len(parts) - len(declined) < needed:
        said = "; ".join(f"{o} declined: {r}" for o, r in sorted(declined.items()))
        return Outcome("cancel", accepted, pending, reason=said, declined=declined)
    if not pending:
        latest = max(c.at_ms for c in valid.values())
        start = latest + proposal.start_delay_ms
        return Outcome("start", accepted, (), start, declined=declined)
    if now_ms >= proposal.consent_by_ms:
        if len(accepted) >= needed:
            start = proposal.consent_by_ms + proposal.start_delay_ms
            return Outcome("start", accepted, pending, start, declined=declined)
        reason = (
            f"the consent deadline ({_when(proposal.consent_by_ms)}) passed with "
            f"{len(accepted)} of the {needed} consents needed; no answer from " + ", ".join(pending)
        )
        return Outcome("cancel", accepted, pending, reason=reason, declined=declined)
    return Outcome("waiting", accepted, pending, declined=declined)
