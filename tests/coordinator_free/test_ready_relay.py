"""The relayed readies (``RoundConfig.ready_relay_from``): signed records spread by
recursive doubling, ``ceil(log2 n)`` requests per node; forged, replayed and
equivocating records are refused or caught, and dropouts around the ready stage leave
consistent rounds."""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Sequence

import pytest
from coordinator_free.rounds import RoundConfig
from coordinator_free.rounds.ready_relay import (
    RECORDS,
    ReadyRecord,
    Verify,
    _after,
    _steps,
    decode_batch,
    encode_batch,
    record_signing_bytes,
)
from coordinator_free.rounds.wire import KIND_READIES
from coordinator_free.sim import Fault, FaultSpec, RoundOutcome, SimConfig, Simulation

from tests.coordinator_free.test_sim import _split_during_shares

RUN = "sim-run"
READY = ("ready",)


PATIENT = {"ready_timeout": 30.0, "stage_timeout": 40.0, "send_timeout": 40.0}
"""Timeouts no stall of a loaded machine outlasts, for the tests that count messages
or verifications. A relay step that waits past its patience (an eighth of the send
and stage timeouts: 5 s here, 0.5 s otherwise) ends the node's waiting, and its later
batches leave without the records still on their way, so the count would be the
fallback's. A healthy round never waits these out."""


def _config(relay_from: int | None, patient: bool = False, **kw: object) -> RoundConfig:
    timeouts: dict[str, object] = {
        "ready_timeout": 3.0,
        "stage_timeout": 8.0,
        "step_timeout": 2.0,
        "send_timeout": 4.0,
        **(PATIENT if patient else {}),
    }
    return RoundConfig(
        ring_min_chunk=1,
        ready_relay_from=relay_from,
        **{**timeouts, **kw},  # type: ignore[arg-type]
    )


def _rounds(
    n: int,
    relay_from: int | None,
    faults: Sequence[FaultSpec] = (),
    rounds: int = 1,
    patient: bool = False,
    **kw: object,
) -> list[RoundOutcome]:
    config = SimConfig(peers=n, length=64, seed=7, round_config=_config(relay_from, patient, **kw))

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


@pytest.mark.parametrize("n", [2, 3, 5, 12, 16, 33, 100])
def test_on_schedule_every_member_gets_every_record_with_its_own_tag(n: int) -> None:
    # recursive doubling as the relay runs it when no member is late: at each step a
    # node sends the records it has from the author or an earlier step, each with the
    # tags of the members the copy reaches from there (_after); copies of one record
    # pool their tags. Every member gets every record, and one copy with its tag.
    order = [f"m{i:03d}" for i in range(n)]
    pos = {o: i for i, o in enumerate(order)}
    # node -> author -> (receivers whose tags its copies carry, the first step one came)
    held = {x: {x: (set(range(n)) - {x}, -1)} for x in range(n)}
    tagged: dict[int, set[int]] = {x: set() for x in range(n)}
    for step, distance in _steps(n):
        sends = []
        for x in range(n):
            dest = (x + distance) % n
            after = {pos[o] for o in _after(order, dest, distance)}
            sends += [(dest, a, tags & after) for a, (tags, at) in held[x].items() if at < step]
        for dest, a, tags in sends:
            if a == dest:
                continue
            if dest in tags:
                tagged[dest].add(a)
            old, at = held[dest].get(a, (set(), step))
            held[dest][a] = (old | tags, min(at, step))
    for x in range(n):
        assert set(held[x]) == set(range(n))
        assert tagged[x] == set(range(n)) - {x}
    # and a copy carries only the tags of those members: about n / 2 a step per node,
    # not the n - 1 of each record
    assert len(_after(order, 0, 1)) == (1 << (n - 1).bit_length()) // 2


# -- rounds ---------------------------------------------------------------------------------


def test_the_relay_sums_exactly_with_log_n_ready_messages_per_node_below_the_pairwise() -> None:
    n = 16
    (relayed,) = _rounds(n, relay_from=8, patient=True)
    (pairwise,) = _rounds(n, relay_from=None, patient=True)
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


# -- records authenticated by tags ----------------------------------------------------------


def _count_verifications(sim: Simulation) -> list[int]:
    """Wrap every node's record-signature check with a counter (one shared cell)."""
    calls = [0]
    for engine in sim.engines.values():
        relay = engine._ready.relay
        assert relay is not None
        inner = relay.verify

        def counted(org: str, data: bytes, sig: bytes, inner: Verify = inner) -> bool:
            calls[0] += 1
            return inner(org, data, sig)

        relay.verify = counted
    return calls


@pytest.mark.parametrize("n", [12, 40])
def test_from_the_second_round_relayed_records_are_checked_by_tags_not_signatures(n: int) -> None:
    config = SimConfig(peers=n, length=64, seed=7, round_config=_config(8, patient=True))

    async def scenario() -> tuple[list[int], list[RoundOutcome]]:
        async with Simulation(config) as sim:
            calls = _count_verifications(sim)
            per_round, outs = [], []
            for r in (1, 2, 3):
                before = calls[0]
                outs.append(await sim.round(r))
                per_round.append(calls[0] - before)
            return per_round, outs

    per_round, outs = asyncio.run(scenario())
    for out in outs:
        assert out.problems() == [] and len(out.results) == n
        res = out.results["org-00"]
        assert (res.sum == out.expected(res.survivors)).all()
    # the first round learns the record keys from signatures (every record not
    # relayed by its author); later ones check each record by its tag
    assert per_round[0] > n
    assert per_round[1] == per_round[2] == 0


def _tagged(sim: Simulation, author: str, round: int, ready: bytes, to: str) -> ReadyRecord:
    """``author``'s record with its real record key and a tag for ``to`` (the two
    having learned each other's record keys), under a signature that never verifies."""
    mine, theirs = sim.engines[author]._ready.relay, sim.engines[to]._ready.relay
    assert mine is not None and theirs is not None
    mine.keys.learn(to, theirs.keys.public)
    theirs.keys.learn(author, mine.keys.public)
    signing = record_signing_bytes("sim", RUN, round, author, ready, mine.keys.public)
    tags = mine.keys.tags(hashlib.sha256(signing).digest(), [to])
    return ReadyRecord.make(author, ready, b"\x00" * 64, mine.keys.public, tags)


def test_a_tag_shows_a_record_and_a_tampered_replayed_or_relay_made_one_is_refused() -> None:
    async def act(sim: Simulation) -> None:
        a, b, c = sim.orgs[:3]
        ready = b"\x01" * 80
        state = sim.engines[c]._table.state(RUN, 2, a)

        async def relay(rec: ReadyRecord, step: int) -> None:
            await sim.endpoints[a].send(
                c, KIND_READIES, encode_batch(step, [rec.raw]), run=RUN, round=2, stage="ready"
            )

        # b's tag for c, round 1, replayed in round 2; b's round-2 record with its ready
        # changed under the tag; a tag the relay made with its own record key
        replayed = _tagged(sim, b, 1, ready, c)
        good = _tagged(sim, b, 2, ready, c)
        tampered = ReadyRecord.make(b, b"\x02" * 80, good.signature, good.key, good.tags)
        relay_keys = sim.engines[a]._ready.relay.keys  # type: ignore[union-attr]
        relay_keys.learn(c, sim.engines[c]._ready.relay.keys.public)  # type: ignore[union-attr]
        signing = record_signing_bytes("sim", RUN, 2, b, ready, good.key)
        made = ReadyRecord.make(
            b,
            ready,
            good.signature,
            good.key,
            relay_keys.tags(hashlib.sha256(signing).digest(), [c]),
        )
        for step, rec in enumerate((replayed, tampered, made)):
            await relay(rec, step)
            assert state.inbox.item(READY, b) is None and state.inbox.item(RECORDS, b) is None
        # the genuine tagged record is taken though its signature is void: the tag shows it
        await relay(good, 3)
        assert state.inbox.item(READY, b) == ready
        assert b not in state.equivocal

    _relay_scene(act)


def test_a_record_key_is_learned_from_its_author_s_signature_only() -> None:
    async def act(sim: Simulation) -> None:
        a, b, c = sim.orgs[:3]
        ready = b"\x03" * 80
        old = _tagged(sim, b, 2, ready, c)
        keys_c = sim.engines[c]._ready.relay.keys  # type: ignore[union-attr]
        assert keys_c.known(b) == old.key
        # a relay announces a new record key for b under its own signature: refused,
        # and nothing learned
        new_key = bytes(range(32))
        signing = record_signing_bytes("sim", RUN, 3, b, ready, new_key)
        forged = ReadyRecord.make(b, ready, sim.identities[a].sign(signing), new_key)
        await sim.endpoints[a].send(
            c, KIND_READIES, encode_batch(0, [forged.raw]), run=RUN, round=3, stage="ready"
        )
        state = sim.engines[c]._table.get(RUN, 3)
        assert state is not None and state.inbox.item(READY, b) is None
        assert keys_c.known(b) == old.key
        # b restarted: a new record key, announced under its signature
        rec = ReadyRecord.make(b, ready, sim.identities[b].sign(signing), new_key)
        await sim.endpoints[a].send(
            c, KIND_READIES, encode_batch(1, [rec.raw]), run=RUN, round=3, stage="ready"
        )
        assert state.inbox.item(READY, b) == ready
        assert keys_c.known(b) == new_key

    _relay_scene(act)


def test_a_record_whose_tags_a_relay_spoiled_is_taken_by_its_signature() -> None:
    async def act(sim: Simulation) -> None:
        a, b, c = sim.orgs[:3]
        ready = b"\x04" * 80
        good = _tagged(sim, b, 2, ready, c)
        spoiled = bytes(x ^ 0xFF for x in good.tags)
        calls = _count_verifications(sim)
        for step, tags in enumerate((b"", spoiled)):
            state = sim.engines[c]._table.state(RUN, 2 + step, a)
            signing = record_signing_bytes("sim", RUN, 2 + step, b, ready, good.key)
            rec = ReadyRecord.make(b, ready, sim.identities[b].sign(signing), good.key, tags)
            await sim.endpoints[a].send(
                c, KIND_READIES, encode_batch(0, [rec.raw]), run=RUN, round=2 + step, stage="ready"
            )
            assert state.inbox.item(READY, b) == ready
        # each was checked by its signature: one verification apiece
        assert calls[0] == 2

    _relay_scene(act)
