"""The rule every participant applies to a run's proposal and consents
(:mod:`org_node.proposals`): same records, same outcome, at every org."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from org_node.proposals import Consent, Proposal, ProposalError, decide
from org_node.run_config import run_key

ORGS = ("org-a", "org-b", "org-c")
SPEC = {"trainer": "breast_cancer", "rounds": 2, "participants": list(ORGS), "threshold": 2}
T0 = 1_700_000_000_000


def proposal(**spec: object) -> Proposal:
    return Proposal.make("cohort-1", SPEC | spec, "org-a", T0, 600, 5)


def yes(p: Proposal, org: str, at: int) -> Consent:
    return Consent(p.run_key, org, "accept", "", at)


def test_every_accept_starts_the_run_a_delay_after_the_last_consent() -> None:
    p = proposal()
    consents = {o: yes(p, o, T0 + 1000 * i) for i, o in enumerate(ORGS)}
    out = decide(p, consents, T0 + 5000)
    assert out.kind == "start" and out.accepted == ORGS
    assert out.start_at_ms == T0 + 2000 + 5000


def test_waiting_names_whom_it_waits_for() -> None:
    p = proposal()
    out = decide(p, {"org-a": yes(p, "org-a", T0)}, T0 + 10)
    assert out.kind == "waiting" and out.waiting_for == ("org-b", "org-c")


def test_a_decline_cancels_a_run_that_needs_everyone_naming_who_and_why() -> None:
    p = proposal()
    no = Consent(p.run_key, "org-b", "decline", "the board said no", T0 + 1)
    out = decide(p, {"org-a": yes(p, "org-a", T0), "org-b": no}, T0 + 2)
    assert out.kind == "cancel" and out.reason == "org-b declined: the board said no"


def test_the_deadline_cancels_a_run_short_of_its_consents() -> None:
    p = proposal()
    out = decide(p, {"org-a": yes(p, "org-a", T0)}, p.consent_by_ms)
    assert out.kind == "cancel"
    assert "1 of the 3 consents needed" in out.reason and "org-b, org-c" in out.reason


def test_a_quorum_starts_at_the_deadline_with_those_that_consented() -> None:
    p = proposal(quorum=2)
    consents = {"org-a": yes(p, "org-a", T0), "org-c": yes(p, "org-c", T0 + 5)}
    assert decide(p, consents, T0 + 10).kind == "waiting"  # org-b may still answer
    out = decide(p, consents, p.consent_by_ms + 1)
    assert out.kind == "start" and out.accepted == ("org-a", "org-c")
    assert out.start_at_ms == p.consent_by_ms + p.start_delay_ms
    no = Consent(p.run_key, "org-b", "decline", "no data", T0 + 7)
    out = decide(p, consents | {"org-b": no}, T0 + 10)  # everyone answered: no need to wait
    assert out.kind == "start" and out.start_at_ms == T0 + 7 + 5000


def test_consents_signed_late_or_for_another_run_count_for_nothing() -> None:
    p = proposal()
    late = {o: yes(p, o, p.consent_by_ms + 1) for o in ORGS}
    assert decide(p, late, p.consent_by_ms + 2).kind == "cancel"
    other = Proposal.make("cohort-2", SPEC, "org-a", T0, 600, 5)
    foreign = {o: yes(other, o, T0) for o in ORGS}
    assert decide(p, foreign, T0 + 1).kind == "waiting"
    stranger = {"org-z": Consent(p.run_key, "org-z", "accept", "", T0)}
    assert decide(p, stranger, T0 + 1).waiting_for == ORGS


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from(["accept", "decline", None]), min_size=3, max_size=3),
    st.lists(st.integers(0, 700_000), min_size=3, max_size=3),
    st.integers(0, 800_000),
    st.sampled_from([None, 2, 3]),
    st.randoms(),
)
def test_the_outcome_does_not_depend_on_the_order_records_arrived(
    decisions: list[str | None],
    ats: list[int],
    now: int,
    quorum: int | None,
    rnd: random.Random,
) -> None:
    p = proposal(quorum=quorum)
    consents = [
        Consent(p.run_key, o, d, "" if d == "accept" else "no", T0 + at)  # type: ignore[arg-type]
        for o, d, at in zip(ORGS, decisions, ats, strict=True)
        if d is not None
    ]
    outcomes = []
    for _ in range(4):
        rnd.shuffle(consents)
        outcomes.append(decide(p, {c.org: c for c in consents}, T0 + now))
    assert all(o == outcomes[0] for o in outcomes)


def test_records_round_trip_and_a_tampered_one_is_refused() -> None:
    p = proposal()
    assert Proposal.from_record(p.to_record(), "org-a") == p
    with pytest.raises(ProposalError, match="signed by org-b"):
        Proposal.from_record(p.to_record(), "org-b")
    body = json.loads(p.to_record())
    body["spec"]["rounds"] = 200  # the spec changed, the key did not
    with pytest.raises(ProposalError, match="not the hash of its name and spec"):
        Proposal.from_record(json.dumps(body).encode(), "org-a")
    body = json.loads(p.to_record()) | {"proposer": "org-z"}
    body["run_key"] = run_key(body["name"], body["spec"])
    with pytest.raises(ProposalError, match="signed by org-a"):
        Proposal.from_record(json.dumps(body).encode(), "org-a")
    c = Consent(p.run_key, "org-b", "decline", "not now", T0)
    assert Consent.from_record(c.to_record(), "org-b") == c
    with pytest.raises(ProposalError, match="signed by org-c"):
        Consent.from_record(c.to_record(), "org-c")
    silent = Consent(p.run_key, "org-b", "decline", "  ", T0)
    with pytest.raises(ProposalError, match="must give its reason"):
        Consent.from_record(silent.to_record(), "org-b")
    with pytest.raises(ProposalError, match="not JSON"):
        Consent.from_record(b"\xff", "org-b")


def test_finding_4_deeply_nested_records_are_refused_not_a_recursion_error() -> None:
    deep = b'{"v": 1, "spec": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ProposalError, match="nests deeper"):
        Proposal.from_record(deep, "org-a")
    with pytest.raises(ProposalError, match="nests deeper"):
        Consent.from_record(deep, "org-b")
