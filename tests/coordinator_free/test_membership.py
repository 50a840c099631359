"""SWIM membership: precedence rules, codec, and protocol outcomes on the in-memory network.

Protocol tests count periods, never wall time: every bound is a number of SWIM
periods, generous enough for a loaded machine (polling stops as soon as it holds).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import RefusalReason, Refused
from coordinator_free.membership import (
    PING,
    EventKind,
    Membership,
    MembershipEvent,
    MemberStatus,
    SwimConfig,
    SwimMessage,
    Update,
    decode_message,
    encode_message,
)
from hypothesis import given
from hypothesis import strategies as st

from bench.overlay_membership import SimCluster, swim_config

PERIOD = 0.05
A, S, D, L = MemberStatus.ALIVE, MemberStatus.SUSPECT, MemberStatus.DEAD, MemberStatus.LEFT


def run(coro: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(coro(), timeout=60))


async def within_periods(cluster: SimCluster, org: str, periods: int, predicate: Any) -> int:
    """Wait until ``predicate()``; return the periods ``org`` ran meanwhile, or fail."""
    membership = cluster.memberships[org]
    start = membership.periods
    while not predicate():
        ran = membership.periods - start
        assert ran <= periods, f"not within {periods} periods"
        await asyncio.sleep(PERIOD / 5)
    return membership.periods - start


def drain(queue: asyncio.Queue[MembershipEvent]) -> list[MembershipEvent]:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


# ---------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ({"period_s": 0}, ValueError),
        ({"period_s": float("nan")}, ValueError),
        ({"period_s": 1.0, "ping_timeout_s": 0.6}, ValueError),
        ({"indirect_k": -1}, ValueError),
        ({"indirect_k": 1.5}, TypeError),
        ({"retransmit_mult": 0}, ValueError),
        ({"piggyback_max": True}, TypeError),
        ({"suspicion_periods": 3}, ValueError),
    ],
    ids=[
        "zero-period",
        "nan-period",
        "timeout-over-half",
        "negative-k",
        "float-k",
        "zero-retransmit",
        "bool-piggyback",
        "unknown-key",
    ],
)
def test_config_rejects_invalid_values(values: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        SwimConfig.from_mapping(values)


def test_config_derived_limits_grow_logarithmically() -> None:
    config = SwimConfig(period_s=1.0, ping_timeout_s=0.25, suspicion_mult=4, retransmit_mult=4)
    assert config.suspicion_timeout(2) == 4.0  # max(1, log10 n) floors small groups
    assert config.suspicion_timeout(1000) == pytest.approx(12.0)
    assert config.retransmit_limit(9) == 4
    assert config.retransmit_limit(99) == 8


# ---------------------------------------------------------------------- precedence


@pytest.mark.parametrize(
    ("new", "current", "wins"),
    [
        (Update("x", S, 0), (A, 0), True),  # suspect overrides alive, same incarnation
        (Update("x", A, 0), (S, 0), False),  # only a higher incarnation refutes
        (Update("x", A, 1), (S, 0), True),
        (Update("x", S, 0), (S, 0), False),
        (Update("x", D, 0), (S, 0), True),
        (Update("x", D, 0), (S, 1), False),  # stale death after a refutation
        (Update("x", A, 1), (D, 0), True),  # rejoin with a higher incarnation
        (Update("x", A, 0), (D, 0), False),
        (Update("x", L, 0), (D, 0), True),
        (Update("x", D, 0), (L, 0), False),
    ],
    ids=["S0>A0", "A0<S0", "A1>S0", "S0=S0", "D0>S0", "D0<S1", "A1>D0", "A0<D0", "L0>D0", "D0<L0"],
)
def test_precedence_follows_swim(
    new: Update, current: tuple[MemberStatus, int], wins: bool
) -> None:
    assert new.supersedes(*current) is wins


updates = st.builds(Update, st.just("x"), st.sampled_from(list(MemberStatus)), st.integers(0, 5))


@given(updates, updates, updates)
def test_precedence_is_a_strict_total_order(a: Update, b: Update, c: Update) -> None:
    ab, ba = a.supersedes(b.status, b.incarnation), b.supersedes(a.status, a.incarnation)
    assert not (ab and ba)
    assert ab or ba or a == b
    if ab and b.supersedes(c.status, c.incarnation):
        assert a.supersedes(c.status, c.incarnation)


# ---------------------------------------------------------------------- codec


@given(
    st.integers(0, 2**62),
    st.lists(
        st.tuples(
            st.text(min_size=1, max_size=20),
            st.sampled_from(list(MemberStatus)),
            st.integers(0, 2**62),
        ),
        max_size=10,
    ),
    st.one_of(st.none(), st.text(max_size=20)),
    st.one_of(st.none(), st.booleans()),
)
def test_codec_round_trips(
    inc: int, raw: list[tuple[str, MemberStatus, int]], target: str | None, ok: bool | None
) -> None:
    ups = tuple(Update(*u) for u in raw)
    data = encode_message(inc, ups, target=target, ok=ok)
    assert decode_message(data) == SwimMessage(inc, ups, target, ok)
    assert encode_message(inc, ups, target=target, ok=ok) == data  # canonical


def test_codec_fixed_vector() -> None:
    data = encode_message(3, [Update("org-b", S, 2), Update("org-c", L, 0)], target="org-d")
    assert data == b'{"i":3,"t":"org-d","u":[["org-b",1,2],["org-c",3,0]]}'


@given(st.binary(max_size=200))
def test_decoding_garbage_only_refuses(data: bytes) -> None:
    try:
        decode_message(data)
    except Refused as exc:
        assert exc.reason is RefusalReason.MALFORMED


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"[]",
        b'{"i":-1,"u":[]}',
        b'{"i":1,"u":[["x",9,0]]}',
        b'{"i":1,"u":[["x",true,0]]}',
        b'{"i":1,"u":[],"z":0}',
        b'{"i":true,"u":[]}',
        b'{"i":1,"u":[],"t":5}',
        b"\xff",
    ],
    ids=[
        "empty",
        "list",
        "negative",
        "rank",
        "bool-rank",
        "extra-field",
        "bool-inc",
        "int-target",
        "not-utf8",
    ],
)
def test_decoding_refuses_malformed(data: bytes) -> None:
    with pytest.raises(Refused) as info:
        decode_message(data)
    assert info.value.reason is RefusalReason.MALFORMED


# ---------------------------------------------------------------------- protocol


def test_round_robin_probes_each_member_once_per_cycle() -> None:
    async def body() -> None:
        cluster = await SimCluster.start(6, seed=3, swim=swim_config(10.0))
        try:
            m = cluster.memberships["org-000"]
            others = sorted(set(cluster.orgs) - {"org-000"})
            for _ in range(3):
                cycle = [m._next_target() for _ in others]
                assert sorted(t for t in cycle if t) == others
        finally:
            await cluster.close()

    run(body)


def test_killed_member_is_declared_dead_by_every_live_member() -> None:
    async def body() -> None:
        n = 10
        cluster = await SimCluster.start(n, seed=1, swim=swim_config(PERIOD))
        try:
            events = cluster.memberships["org-000"].subscribe()
            await asyncio.sleep(2 * PERIOD)
            assert cluster.converged()
            await cluster.crash("org-007")
            config = cluster.memberships["org-000"].config
            # first detection within a probe cycle, then the suspicion timeout, then
            # dissemination; doubled for a loaded machine
            bound = 2 * (n + config.suspicion_timeout(n) / PERIOD + 2 * math.log2(n) + 4)
            await within_periods(
                cluster, "org-000", int(bound), lambda: cluster.all_see("org-007", D)
            )
            assert all("org-007" not in cluster.memberships[o].live() for o in cluster.running())
            kinds = [e.kind for e in drain(events) if e.org_id == "org-007"]
            assert kinds[-1] is EventKind.DEAD
            assert cluster.converged()
        finally:
            await cluster.close()

    run(body)


def test_suspected_but_alive_member_refutes_and_stays_alive() -> None:
    async def body() -> None:
        # a long suspicion timeout: on a loaded machine periods stretch, timers do not
        config = SwimConfig(period_s=PERIOD, ping_timeout_s=PERIOD / 4, suspicion_mult=20)
        cluster = await SimCluster.start(6, seed=2, swim=config)
        try:
            events = {o: cluster.memberships[o].subscribe() for o in cluster.orgs}
            # org-005 tells org-000 that org-002 is suspect (a false suspicion)
            claim = encode_message(0, [Update("org-002", S, 0)])
            await cluster.endpoints["org-005"].send("org-000", PING, claim, stage="swim")
            assert cluster.memberships["org-000"].status("org-002") in (S, A)
            await within_periods(
                cluster,
                "org-000",
                40,
                lambda: (
                    cluster.memberships["org-002"].incarnation >= 1
                    and cluster.all_see("org-002", A)
                    and all(
                        cluster.memberships[o].view()["org-002"].incarnation >= 1
                        for o in cluster.orgs
                        if o != "org-002"
                    )
                ),
            )
            seen = [e for q in events.values() for e in drain(q) if e.org_id == "org-002"]
            assert any(e.kind is EventKind.SUSPECT for e in seen)
            assert not any(e.kind is EventKind.DEAD for e in seen)
            assert cluster.memberships["org-002"].counters["refuted"] >= 1
        finally:
            await cluster.close()

    run(body)


def test_partition_is_detected_then_heals_back_to_one_view() -> None:
    async def body() -> None:
        n = 8
        cluster = await SimCluster.start(n, seed=4, swim=swim_config(PERIOD))
        try:
            left, right = cluster.orgs[:4], cluster.orgs[4:]
            cluster.network.partition(left, right)
            await within_periods(
                cluster,
                "org-000",
                200,
                lambda: all(
                    cluster.memberships[a].live(include_suspect=False) == side
                    for side in (left, right)
                    for a in side
                ),
            )
            cluster.network.heal()
            await within_periods(cluster, "org-000", 200, cluster.converged)
            assert all(cluster.memberships["org-000"].view()[o].incarnation >= 1 for o in right)
        finally:
            await cluster.close()

    run(body)


def test_graceful_leave_is_seen_as_left_not_dead() -> None:
    async def body() -> None:
        cluster = await SimCluster.start(8, seed=5, swim=swim_config(PERIOD))
        try:
            events = cluster.memberships["org-001"].subscribe()
            leaver = cluster.memberships["org-003"]
            await leaver.leave()
            assert "org-003" not in leaver.live()
            cluster.stopped.add("org-003")
            await within_periods(cluster, "org-001", 60, lambda: cluster.all_see("org-003", L))
            kinds = [e.kind for e in drain(events) if e.org_id == "org-003"]
            assert kinds == [EventKind.LEAVE]
            assert cluster.converged()
        finally:
            await cluster.close()

    run(body)


def test_restarted_member_rejoins_after_being_declared_dead() -> None:
    async def body() -> None:
        cluster = await SimCluster.start(6, seed=6, swim=swim_config(PERIOD))
        try:
            events = cluster.memberships["org-000"].subscribe()
            cluster.network.kill("org-004")  # unreachable, but its protocol keeps running
            cluster.stopped.add("org-004")
            await within_periods(cluster, "org-000", 200, lambda: cluster.all_see("org-004", D))
            cluster.network.revive("org-004")
            cluster.stopped.discard("org-004")
            await within_periods(cluster, "org-000", 200, cluster.converged)
            kinds = [e.kind for e in drain(events) if e.org_id == "org-004"]
            assert EventKind.DEAD in kinds
            assert kinds[-1] is EventKind.JOIN
        finally:
            await cluster.close()

    run(body)


def test_member_restarted_after_leaving_rejoins_with_a_higher_incarnation() -> None:
    async def body() -> None:
        cluster = await SimCluster.start(5, seed=9, swim=swim_config(PERIOD))
        try:
            await cluster.memberships["org-002"].leave()
            cluster.stopped.add("org-002")
            await within_periods(cluster, "org-000", 60, lambda: cluster.all_see("org-002", L))
            # restart org-002: a fresh endpoint on its transport, a fresh membership
            old = cluster.endpoints["org-002"]
            await old.close()
            endpoint = Endpoint(old.identity, old.federation, old.transport, old.guard.members)
            fresh = await Membership.create(endpoint, cluster.orgs, swim_config(PERIOD))
            await endpoint.start()
            cluster.endpoints["org-002"], cluster.memberships["org-002"] = endpoint, fresh
            cluster.stopped.discard("org-002")
            await within_periods(cluster, "org-000", 100, cluster.converged)
            assert fresh.incarnation >= 1
        finally:
            await cluster.close()

    run(body)


def test_malformed_payload_is_refused_and_counted() -> None:
    async def body() -> None:
        cluster = await SimCluster.start(3, seed=7, swim=swim_config(PERIOD))
        try:
            with pytest.raises(Refused) as info:
                await cluster.endpoints["org-001"].send("org-000", PING, b"\x00garbage")
            assert info.value.reason is RefusalReason.MALFORMED
            assert cluster.memberships["org-000"].counters["malformed"] == 1
            reply = await cluster.endpoints["org-001"].send("org-000", PING, encode_message(0, []))
            assert decode_message(reply).incarnation == 0
        finally:
            await cluster.close()

    run(body)


def test_manifest_changes_add_and_drop_members() -> None:
    async def body() -> None:
        cluster = await SimCluster.start(3, seed=8, swim=swim_config(10.0))
        try:
            m = cluster.memberships["org-000"]
            events = m.subscribe()
            m.update_members(["org-000", "org-001", "org-009"])
            assert m.live() == ["org-000", "org-001", "org-009"]
            assert [(e.kind, e.org_id) for e in drain(events)] == [
                (EventKind.LEAVE, "org-002"),
                (EventKind.JOIN, "org-009"),
            ]
            assert m.size == 3
        finally:
            await cluster.close()

    run(body)
