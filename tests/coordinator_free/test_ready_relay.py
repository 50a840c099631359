"""The relayed readies (``RoundConfig.ready_relay_from``): signed records spread by
recursive doubling, ``ceil(log2 n)`` requests per node; forged, replayed and
equivocating records are refused or caught, and dropouts around the ready stage leave
consistent rounds."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import pytest
from coordinator_free.rounds import RoundConfig
from coordinator_free.rounds.ready_relay import (
    RECORDS,
    ReadyRecord,
    decode_batch,
    encode_batch,
    record_signing_bytes,
)
from coordinator_free.rounds.wire import KIND_READIES
from coordinator_free.sim import Fault, FaultSpec, RoundOutcome, SimConfig, Simulation

from tests.coordinator_free.test_sim import _split_during_shares

RUN = "sim-run"
READY = ("ready",)


def _config(relay_from: int | None, **kw: object) -> RoundConfig:
    return RoundConfig(
        ready_timeout=3.0,
        stage_timeout=8.0,
        step_timeout=2.0,
        send_timeout=4.0,
        ring_min_chunk=1,
        ready_relay_from=relay_from,
        **kw,  # type: ignore[arg-type]
    )


def _rounds(
    n: int,
    relay_from: int | None,
    faults: Sequence[FaultSpec] = (),
    rounds: int = 1,
    **kw: object,
) -> list[RoundOutcome]:
    config = SimConfig(peers=n, length=64, seed=7, round_config=_config(relay_from, **kw))

    async def scenario() -> list[RoundOutcome]:
        async with Simulation(config, list(faults)) as sim:
            return [await sim.round(r) for r in range(1, rounds + 1)]

    return asyncio.run(scenario())


def _record(sim: Simulation, author: str, round: int, ready: bytes) -> ReadyRecord:
    signing = record_signing_bytes(sim.config.federation, RUN, round, author, ready)
    return ReadyRecord.make(author, ready, sim.identities[author].sign(signing))


# -- the encoding ---------------------------------------------------------------------------


def test_a_batch_decodes_to_what_was_encoded_and_malformed_ones_are_refused() -> None:
    a = ReadyRecord.make("org-a", b"x" * 40, b"s" * 64)
    b = ReadyRecord.make("org-b", b"", b"t" * 64)
    step, records = decode_batch(encode_batch(3, [a.raw, b.raw]))
    assert step == 3 and records == [a, b]
    data = encode_batch(0, [a.raw])
    for bad in (data[:-1], data + b"\x00", b"\x00", encode_batch(200, [])):
        with pytest.raises(ValueError):
            decode_batch(bad)


# -- rounds ---------------------------------------------------------------------------------


def test_the_relay_sums_exactly_with_log_n_ready_messages_per_node_below_the_pairwise() -> None:
    n = 16
    (relayed,) = _rounds(n, relay_from=8)
    (pairwise,) = _rounds(n, relay_from=None)
    for out in (relayed, pairwise):
        assert out.problems() == [] and len(out.results) == n
    new = relayed.signed_per_node()
    old = pairwise.signed_per_node()
    # requests and replies: 2 ceil(log2 n) = 8 per node, against n - 1 = 15
    assert new.get("round.ready", 0.0) == 0.0
    assert new["round.readies"] == 2 * math.ceil(math.log2(n))
    assert old["round.ready"] == n - 1 and "round.readies" not in old
    assert new["round.readies"] < old["round.ready"]
    # the same members and the same sum either way
    res = relayed.results["org-00"]
    assert set(res.survivors) == set(relayed.inputs)
    assert (res.sum == relayed.expected(res.survivors)).all()


def test_a_node_killed_before_its_ready_is_left_out_and_the_rest_sum_exactly() -> None:
    n = 12
    killed = "org-05"
    first, second = _rounds(n, 8, [FaultSpec(killed, Fault.KILL, "ready", round=1)], rounds=2)
    for out in (first, second):
        assert out.problems() == []
        assert set(out.results) == set(first.inputs) - {killed}
        res = out.results["org-00"]
        assert killed not in res.survivors
        assert (res.sum == out.expected(res.survivors)).all()
    # the relays that waited on the dead node fell back to direct readies (a few per
    # node), far below one per member: the dead node's records are simply missing
    per = first.signed_per_node()
    assert per.get("round.ready", 0.0) < n - 1


def test_a_node_killed_after_sending_its_ready_is_dropped_and_the_rest_sum_exactly() -> None:
    n = 12
    killed = "org-03"
    (out,) = _rounds(n, 8, [FaultSpec(killed, Fault.KILL, "share", round=1)])
    assert out.problems() == []
    assert set(out.results) == set(out.inputs) - {killed}
    res = out.results["org-00"]
    assert killed not in res.survivors
    assert (res.sum == out.expected(res.survivors)).all()


def test_a_slow_node_joins_through_direct_readies_and_the_round_is_whole() -> None:
    n = 12
    (out,) = _rounds(n, 8, [FaultSpec("org-07", Fault.DELAY, "ready", round=1, delay_s=1.0)])
    assert out.problems() == []
    assert len(out.results) == n
    assert set(out.results["org-00"].survivors) == set(out.inputs)


def test_a_split_during_the_shares_is_still_caught_with_relayed_readies() -> None:
    n = 12
    config = SimConfig(peers=n, length=16, seed=21, round_config=_config(8, secagg_plus_above=8))
    orgs = [f"org-{i:02d}" for i in range(n)]
    halves = (tuple(orgs[::2]), tuple(orgs[1::2]))

    first, second = _split_during_shares(config, halves)
    assert first.problems() == [] and not first.results
    assert set(first.failures) == set(orgs)
    assert second.problems() == [] and len(second.results) == n
    assert second.signed_per_node()["round.readies"] > 0


# -- forged, replayed and equivocating records ---------------------------------------------


def _relay_scene(
    act: object,
) -> None:
    """Run ``act(sim)`` inside a started simulation of 4 relaying peers."""
    config = SimConfig(peers=4, length=16, seed=3, round_config=_config(3))

    async def scenario() -> None:
        async with Simulation(config) as sim:
            await act(sim)  # type: ignore[operator]

    asyncio.run(scenario())


def test_a_forged_or_replayed_record_relayed_by_another_member_is_refused() -> None:
    async def act(sim: Simulation) -> None:
        a, b, c = sim.orgs[:3]
        ready = b"\x01" * 80
        # b's ready, signed by a (a forgery), and b's genuine ready of round 1 replayed
        # into round 2: both relayed by a to c, in round 2
        forged = ReadyRecord.make(
            b, ready, sim.identities[a].sign(record_signing_bytes("sim", RUN, 2, b, ready))
        )
        replayed = _record(sim, b, 1, ready)
        wrong_run = ReadyRecord.make(
            b, ready, sim.identities[b].sign(record_signing_bytes("sim", "other", 2, b, ready))
        )
        for rec in (forged, replayed, wrong_run):
            await sim.endpoints[a].send(
                c, KIND_READIES, encode_batch(0, [rec.raw]), run=RUN, round=2, stage="ready"
            )
        state = sim.engines[c]._table.get(RUN, 2)
        assert state is not None
        assert state.inbox.item(READY, b) is None and state.inbox.item(RECORDS, b) is None
        # b's genuine record of round 2, relayed by a, is taken
        genuine = _record(sim, b, 2, ready)
        await sim.endpoints[a].send(
            c, KIND_READIES, encode_batch(1, [genuine.raw]), run=RUN, round=2, stage="ready"
        )
        assert state.inbox.item(READY, b) == ready
        assert b not in state.equivocal

    _relay_scene(act)


def test_two_different_signed_readies_of_one_member_make_it_equivocal() -> None:
    async def act(sim: Simulation) -> None:
        a, b, c, d = sim.orgs
        one, two = _record(sim, b, 2, b"\x01" * 80), _record(sim, b, 2, b"\x02" * 80)
        await sim.endpoints[a].send(
            c, KIND_READIES, encode_batch(0, [one.raw]), run=RUN, round=2, stage="ready"
        )
        await sim.endpoints[d].send(
            c, KIND_READIES, encode_batch(0, [two.raw]), run=RUN, round=2, stage="ready"
        )
        state = sim.engines[c]._table.get(RUN, 2)
        assert state is not None
        assert state.inbox.item(READY, b) == one.ready
        assert b in state.equivocal

    _relay_scene(act)


def test_a_malformed_batch_is_refused_and_files_nothing() -> None:
    from coordinator_free.errors import Refused

    async def act(sim: Simulation) -> None:
        a, b, c = sim.orgs[:3]
        rec = _record(sim, b, 2, b"\x01" * 80)
        with pytest.raises(Refused):
            await sim.endpoints[a].send(
                c, KIND_READIES, encode_batch(0, [rec.raw])[:-3], run=RUN, round=2, stage="ready"
            )
        state = sim.engines[c]._table.get(RUN, 2)
        assert state is None or state.inbox.item(READY, b) is None

    _relay_scene(act)


def test_the_relay_switch_is_validated() -> None:
    with pytest.raises(ValueError):
        RoundConfig(ready_relay_from=2)
    assert RoundConfig(ready_relay_from=None).relays_readies(1000) is False
    assert RoundConfig(ready_relay_from=32).relays_readies(32) is True
    assert RoundConfig(ready_relay_from=32).relays_readies(31) is False
