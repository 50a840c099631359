"""The node's admission rule (issue 20, finding 4): peers open rounds only of runs this
org accepted, only as their participants, and only with the run's backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coordinator_free.endpoint import Endpoint
from coordinator_free.memory import InMemoryNetwork
from coordinator_free.ring import RingReducer
from coordinator_free.rounds import RoundConfig
from coordinator_free.rounds.state import RoundTable
from sqlmodel import Session

from org_node.db.engine import default_database_url, make_engine, migrate
from org_node.db.models import Run
from org_node.node.admission import RunAdmission
from org_node.run_config import run_key
from org_node.runs import RunState
from tests.coordinator_free.transport_support import FEDERATION, identity


def _spec(participants: tuple[str, ...], backend: str = "masked") -> dict[str, Any]:
    return {
        "trainer": "tiny",
        "rounds": 2,
        "participants": list(participants),
        "threshold": 2,
        "backend": backend,
    }


def test_finding_4_only_accepted_runs_of_their_backend_are_admitted(tmp_path: Path) -> None:
    db = make_engine(default_database_url(tmp_path))
    migrate(db)
    rows = {
        "masked": (RunState.ACCEPTED, _spec(("a", "b", "c"))),
        "ckks": (RunState.RUNNING, _spec(("a", "b"), "ckks")),
        "proposed": (RunState.PROPOSED, _spec(("a", "m"))),
        "declined": (RunState.DECLINED, _spec(("a", "m"))),
        "over": (RunState.COMPLETED, _spec(("a", "m"))),
    }
    with Session(db) as session:
        for name, (state, spec) in rows.items():
            session.add(
                Run(
                    id=name.ljust(32, "0"), name=name, spec=spec, state=state.value, proposed_by="a"
                )
            )
        session.commit()
    admission = RunAdmission()
    admission.load(db)
    masked, ckks = admission.for_backend("masked"), admission.for_backend("ckks")
    key = {name: run_key(name, spec) for name, (_, spec) in rows.items()}
    assert set(admission.runs()) == {key["masked"], key["ckks"]}
    assert masked(key["masked"]) == {"a", "b", "c"}
    assert masked(f"{key['masked']}:stats") == {"a", "b", "c"}
    # a message of the backend a run does not use is not admitted
    assert ckks(key["masked"]) is None and masked(key["ckks"]) is None
    assert ckks(key["ckks"]) == {"a", "b"}
    for name in ("proposed", "declined", "over"):
        assert masked(key[name]) is None
    assert masked("invented") is None
    admission.forget(key["masked"])
    assert masked(key["masked"]) is None


def test_finding_4_rounds_of_a_run_that_ended_give_their_slots_back() -> None:
    """A member's rounds of a run that is over no longer count against its quota."""

    admission = RunAdmission()
    admission.admit("old", ("a", "m"), "masked")
    admission.admit("new", ("a", "m"), "masked")
    me = identity("a")
    endpoint = Endpoint(me, FEDERATION, InMemoryNetwork().transport("a"), dict)
    table = RoundTable("a", RoundConfig(), RingReducer(endpoint), admission.for_backend("masked"))
    quota = table.member_quota()
    for r in range(quota):
        table.state("old", r, "m")
    admission.forget("old")
    for r in range(quota):
        table.state("new", r, "m")
    assert table.open_rounds() == [("new", r) for r in range(quota)]
