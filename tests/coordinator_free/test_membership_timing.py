"""Membership timeouts that follow the network: the round-trip estimator, local health,
and SWIM on an in-memory network whose every message is slower than the ping floor.

The estimator and the health score take measured seconds from their caller and hold no
clock, so their tests are exact. Protocol tests count SWIM periods, never wall time.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from coordinator_free.membership import (
    PING,
    EventKind,
    MembershipEvent,
    MemberStatus,
    SwimConfig,
    Update,
    encode_message,
)
from coordinator_free.membership.timing import LocalHealth, RttEstimator
from hypothesis import given
from hypothesis import strategies as st

from bench.overlay_membership import SimCluster

PERIOD = 0.05
FLOOR = PERIOD / 4


def run(coro: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(coro(), timeout=120))


async def within_periods(cluster: SimCluster, org: str, periods: int, predicate: Any) -> int:
    """Wait until ``predicate()``; return the periods ``org`` ran meanwhile, or fail."""
    membership = cluster.memberships[org]
    start = membership.periods
    while not predicate():
        assert membership.periods - start <= periods, f"not within {periods} periods"
        await asyncio.sleep(PERIOD / 5)
    return membership.periods - start


def drain(queue: asyncio.Queue[MembershipEvent]) -> list[MembershipEvent]:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


# ---------------------------------------------------------------------- estimator


def test_before_any_sample_the_timeout_is_one_second_within_floor_and_cap() -> None:
    assert RttEstimator(floor_s=0.01, cap_s=5.0).rto == 1.0  # RFC 6298's initial value
    assert RttEstimator(floor_s=0.01, cap_s=0.5).rto == 0.5
    assert RttEstimator(floor_s=2.0, cap_s=5.0).rto == 2.0
    assert RttEstimator(floor_s=0.01, cap_s=5.0, initial_s=0.2).rto == 0.2


def test_first_sample_sets_srtt_and_half_of_it_as_variation() -> None:
    est = RttEstimator(floor_s=0.01, cap_s=5.0)
    est.sample(0.2)
    assert est.srtt == 0.2 and est.rttvar == 0.1
    assert est.rto == pytest.approx(0.2 + 4 * 0.1)


def test_later_samples_follow_jacobson_karels_gains() -> None:
    est = RttEstimator(floor_s=0.01, cap_s=5.0)
    est.sample(0.2)
    est.sample(0.4)
    # rttvar <- 3/4 * 0.1 + 1/4 * |0.2 - 0.4|; srtt <- 7/8 * 0.2 + 1/8 * 0.4
    assert est.rttvar == pytest.approx(0.125)
    assert est.srtt == pytest.approx(0.225)
    assert est.rto == pytest.approx(0.225 + 0.5)


def test_steady_round_trips_shrink_the_timeout_to_twice_the_round_trip() -> None:
    """The variation of a steady link tends to nothing; the timeout keeps a margin of
    one round trip for jitter (the deviation counted is at least srtt / 4)."""
    est = RttEstimator(floor_s=0.01, cap_s=5.0)
    for _ in range(100):
        est.sample(0.12)
    assert est.srtt == pytest.approx(0.12)
    assert est.rttvar < 0.001
    assert est.rto == pytest.approx(0.24)


def test_the_floor_holds_for_fast_peers_and_the_cap_for_slow_ones() -> None:
    fast = RttEstimator(floor_s=0.08, cap_s=1.0)
    for _ in range(50):
        fast.sample(0.001)
    assert fast.rto == 0.08
    slow = RttEstimator(floor_s=0.08, cap_s=1.0)
    slow.sample(3.0)
    assert slow.rto == 1.0


def test_missed_acks_double_the_timeout_until_a_sample_resets_it() -> None:
    est = RttEstimator(floor_s=0.1, cap_s=1.0)
    for _ in range(20):
        est.sample(0.01)
    assert est.rto == 0.1  # the floor
    seen = []
    for _ in range(5):
        est.missed()
        seen.append(est.rto)
    assert seen == pytest.approx([0.2, 0.4, 0.8, 1.0, 1.0])
    assert est.measured == 0.1  # what suspicion timeouts use: no backoff
    est.sample(0.01)
    assert est.rto == 0.1


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_impossible_samples_are_ignored(bad: float) -> None:
    est = RttEstimator(floor_s=0.1, cap_s=1.0)
    est.sample(bad)
    assert est.srtt is None and est.samples == 0


@pytest.mark.parametrize(("floor", "cap"), [(0.0, 1.0), (2.0, 1.0), (0.1, math.inf)])
def test_estimator_refuses_a_floor_above_its_cap(floor: float, cap: float) -> None:
    with pytest.raises(ValueError):
        RttEstimator(floor, cap)


@given(
    st.lists(
        st.one_of(
            st.floats(0.0, 20.0, allow_nan=False),
            st.just(-1.0),  # -1 stands for a missed ack
        ),
        max_size=60,
    )
)
def test_timeout_stays_between_floor_and_cap_and_covers_twice_the_smoothed_rtt(
    events: list[float],
) -> None:
    est = RttEstimator(floor_s=0.05, cap_s=2.0, initial_s=0.05)
    for value in events:
        if value < 0:
            est.missed()
        else:
            est.sample(value)
        assert 0.05 <= est.rto <= 2.0
        if est.srtt is not None:
            assert est.rto >= min(2 * est.srtt, 2.0)


# ---------------------------------------------------------------------- local health


def test_local_health_grows_on_trouble_shrinks_on_success_and_stays_in_range() -> None:
    health = LocalHealth(max_multiplier=4)
    assert health.multiplier == 1 and health.scale(0.5) == 0.5
    health.apply(+2)
    assert health.multiplier == 3 and health.scale(0.5) == 1.5
    health.apply(+5)
    assert health.multiplier == 4  # at most max_multiplier
    for _ in range(10):
        health.apply(-1)
    assert health.multiplier == 1  # never below 1


@given(st.integers(1, 10), st.lists(st.integers(-3, 3), max_size=50))
def test_local_health_score_is_clamped(max_multiplier: int, deltas: list[int]) -> None:
    health = LocalHealth(max_multiplier)
    for delta in deltas:
        health.apply(delta)
        assert 1 <= health.multiplier <= max_multiplier


def test_local_health_of_one_is_off() -> None:
    health = LocalHealth(1)
    health.apply(+3)
    assert health.multiplier == 1
    with pytest.raises(ValueError):
        LocalHealth(0)


def test_config_refuses_a_cap_below_the_floor_and_bounds_suspicion() -> None:
    with pytest.raises(ValueError, match="max_ping_timeout_s"):
        SwimConfig(period_s=1.0, ping_timeout_s=0.3, max_ping_timeout_s=0.2)
    with pytest.raises(ValueError):
        SwimConfig.from_mapping({"local_health_max": 0})
    config = SwimConfig(period_s=1.0, ping_timeout_s=0.25, max_ping_timeout_s=2.0)
    assert config.max_suspicion_timeout(5) == max(4.0, 4 * 2.0) * config.local_health_max


# ---------------------------------------------------------------------- in the protocol


def test_refuting_a_suspicion_raises_local_health_and_probes_lower_it() -> None:
    async def body() -> None:
        config = SwimConfig(period_s=PERIOD, ping_timeout_s=FLOOR, suspicion_mult=20)
        cluster = await SimCluster.start(4, seed=21, swim=config)
        try:
            victim = cluster.memberships["org-002"]
            claim = encode_message(0, [Update("org-002", MemberStatus.SUSPECT, 0)])
            await cluster.endpoints["org-001"].send("org-002", PING, claim, stage="swim")
            assert victim.counters["refuted"] == 1
            assert victim.health.multiplier == 2
            assert victim.period_s() == pytest.approx(2 * PERIOD)
            assert victim.ping_timeout("org-000") >= 2 * FLOOR
            # successful probes bring it back to full health
            await within_periods(cluster, "org-002", 40, lambda: victim.health.multiplier == 1)
        finally:
            await cluster.close()

    run(body)


def test_ping_timeout_and_suspicion_follow_the_measured_round_trip() -> None:
    async def body() -> None:
        config = SwimConfig(period_s=PERIOD, ping_timeout_s=FLOOR, max_ping_timeout_s=1.0)
        cluster = await SimCluster.start(3, seed=22, swim=config, latency_s=0.04)
        try:
            m = cluster.memberships["org-000"]
            await within_periods(
                cluster, "org-000", 80, lambda: all(m.view()[o].rtt for o in ("org-001", "org-002"))
            )
            rtt = m.view()["org-001"].rtt
            assert rtt is not None and rtt >= 0.08  # a request and its reply, 40 ms each
            assert m.ping_timeout("org-001") >= rtt > FLOOR
            assert m.suspicion_timeout("org-001") >= config.suspicion_mult * rtt
        finally:
            await cluster.close()

    run(body)


def test_an_ack_after_the_probe_gave_up_still_measures_the_round_trip() -> None:
    """A 10 s period, so no probe runs but the ones made here. The first probe waits the
    initial second and measures the 60 ms round trip; with the estimate then forced down
    to the 12.5 ms floor, the next probe misses and backs off, yet its ack, once it
    comes, is measured."""

    async def body() -> None:
        config = SwimConfig(period_s=10.0, ping_timeout_s=FLOOR, max_ping_timeout_s=1.0)
        cluster = await SimCluster.start(2, seed=25, swim=config, latency_s=0.03)
        try:
            m = cluster.memberships["org-000"]

            async def measured(samples: int) -> None:
                for _ in range(200):
                    if m._members["org-001"].rtt.samples >= samples:
                        return
                    await asyncio.sleep(0.01)

            await measured(1)
            assert m.counters["acks_missed"] == 0  # the first probe waited long enough
            estimate = m._members["org-001"].rtt
            estimate.srtt, estimate.rttvar = 0.001, 0.0  # pretend the link was fast
            assert m.ping_timeout("org-001") == FLOOR
            await m._probe("org-001", asyncio.get_running_loop().time())
            assert m.counters["acks_missed"] == 1
            await measured(2)
            assert estimate.samples == 2 and estimate.srtt is not None
            assert estimate.srtt > 0.06 / 8  # the late 60 ms sample moved the average
            assert m.ping_timeout("org-001") > FLOOR
        finally:
            await cluster.close()

    run(body)


def test_finding_7_delayed_members_are_not_suspected_once_measured_nor_declared_dead() -> None:
    """Every message takes 30 ms, a round trip 60 ms: more than a whole protocol period
    and almost five times the configured ping floor. Before this fix every direct and
    indirect probe timed out, so members were suspected all the time."""

    async def body() -> None:
        n = 5
        config = SwimConfig(period_s=PERIOD, ping_timeout_s=FLOOR, max_ping_timeout_s=1.0)
        cluster = await SimCluster.start(n, seed=23, swim=config, latency_s=0.03)
        try:
            queues = {o: cluster.memberships[o].subscribe() for o in cluster.orgs}

            def measured() -> bool:
                return all(
                    state.rtt is not None
                    for m in cluster.memberships.values()
                    for org, state in m.view().items()
                    if org != m.me
                )

            await within_periods(cluster, "org-000", 200, measured)
            warmup = [e for q in queues.values() for e in drain(q)]
            assert not any(e.kind is EventKind.DEAD for e in warmup)
            # once round trips are measured, a further 60 periods without a suspicion
            start = cluster.memberships["org-000"].periods
            while cluster.memberships["org-000"].periods - start < 60:
                await asyncio.sleep(PERIOD)
            later = [e for q in queues.values() for e in drain(q)]
            assert not [e for e in later if e.kind in (EventKind.SUSPECT, EventKind.DEAD)]
            assert cluster.converged()
        finally:
            await cluster.close()

    run(body)


def test_a_truly_dead_member_is_still_declared_dead_within_a_bounded_time() -> None:
    async def body() -> None:
        n = 5
        config = SwimConfig(
            period_s=PERIOD, ping_timeout_s=FLOOR, max_ping_timeout_s=0.1, local_health_max=4
        )
        cluster = await SimCluster.start(n, seed=24, swim=config, latency_s=0.02)
        try:
            m = cluster.memberships["org-000"]
            await within_periods(cluster, "org-000", 200, cluster.converged)
            await cluster.crash("org-003")
            # each period lasts at least PERIOD, so a suspicion of at most
            # max_suspicion_timeout seconds spans at most that many periods; add a probe
            # cycle to first detect it and dissemination, doubled for a loaded machine
            bound = 2 * (n + config.max_suspicion_timeout(n) / PERIOD + 2 * math.log2(n) + 4)
            await within_periods(
                cluster,
                "org-000",
                int(bound),
                lambda: cluster.all_see("org-003", MemberStatus.DEAD),
            )
            assert "org-003" not in m.live()
            assert cluster.converged()
        finally:
            await cluster.close()

    run(body)
