"""Membership and gossip figures of the overlay, measured on the in-memory network.

The overlay benchmark imports :func:`measure_detection`, :func:`measure_message_rate`
and :func:`measure_broadcast`; :class:`SimCluster` builds ``n`` SWIM members (and
optionally gossip) on one :class:`~coordinator_free.memory.InMemoryNetwork`, for the
benchmarks and the tests. Run alone::

    python -m bench.overlay_membership [--quick] [--json PATH]

Cost note: every message is an Ed25519-signed envelope whose reply is signed too, so
one ping/ack costs two signatures and two verifications. Measured on one loaded core,
a ping/ack round trip on the in-memory network takes about 1.3 ms: signing about
60 µs and verifying about 200 µs each, the rest envelope encoding and checks. With
``n`` members and one probe per period a period costs about ``n * 1.3`` ms of CPU,
which is why the period grows with ``n`` here (:func:`default_period`): 256 members
fit on one core at a 0.5 s period.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from coordinator_free.endpoint import Endpoint
from coordinator_free.gossip import Gossip, GossipConfig
from coordinator_free.identity import OrgIdentity
from coordinator_free.membership import EventKind, Membership, MemberStatus, SwimConfig
from coordinator_free.memory import InMemoryNetwork

from bench.common import Report, run_main

__all__ = [
    "FEDERATION",
    "Detection",
    "SimCluster",
    "default_period",
    "main",
    "measure_broadcast",
    "measure_detection",
    "measure_message_rate",
    "org_ids",
    "swim_config",
    "wait_until",
]

FEDERATION = "bench-federation"


def org_ids(n: int) -> list[str]:
    """``org-000``, ``org-001``, ... (sortable ids)."""
    return [f"org-{i:03d}" for i in range(n)]


def default_period(n: int) -> float:
    """A SWIM period that keeps ``n`` in-memory members within one core's budget."""
    return 0.1 if n <= 16 else 0.2 if n <= 64 else 0.5


def swim_config(period_s: float) -> SwimConfig:
    """The SWIM parameters used by the benchmarks and tests at a given period."""
    return SwimConfig(period_s=period_s, ping_timeout_s=period_s / 4)


@dataclass
class SimCluster:
    """``n`` members on one in-memory network: endpoints, SWIM and optional gossip."""

    network: InMemoryNetwork
    identities: dict[str, OrgIdentity]
    endpoints: dict[str, Endpoint]
    memberships: dict[str, Membership]
    gossips: dict[str, Gossip] = field(default_factory=dict)
    stopped: set[str] = field(default_factory=set)

    @classmethod
    async def start(
        cls,
        n: int,
        *,
        seed: int = 0,
        swim: SwimConfig | None = None,
        gossip: GossipConfig | None = None,
        latency_s: float = 0.0,
        loss: float = 0.0,
    ) -> SimCluster:
        """Start ``n`` members (deterministic identities and RNGs from ``seed``)."""
        orgs = org_ids(n)
        identities = {
            org: OrgIdentity.generate(org, hashlib.sha256(f"{seed}/{org}".encode()).digest())
            for org in orgs
        }
        keys = {org: ident.public_key for org, ident in identities.items()}
        network = InMemoryNetwork(latency_s=latency_s, loss=loss, seed=seed)
        endpoints = {
            org: Endpoint(identities[org], FEDERATION, network.transport(org), lambda: keys)
            for org in orgs
        }
        config = swim or swim_config(default_period(n))
        memberships: dict[str, Membership] = {}
        for i, org in enumerate(orgs):
            rng = random.Random(seed * 1_000_003 + i)
            memberships[org] = await Membership.create(endpoints[org], orgs, config, rng=rng)
        cluster = cls(network, identities, endpoints, memberships)
        if gossip is not None:
            for i, org in enumerate(orgs):
                rng = random.Random(seed * 1_000_033 + i)
                cluster.gossips[org] = await Gossip.create(
                    endpoints[org], memberships[org], gossip, rng=rng
                )
        for endpoint in endpoints.values():
            await endpoint.start()
        return cluster

    @property
    def orgs(self) -> list[str]:
        """Every member's id, sorted."""
        return sorted(self.memberships)

    def running(self) -> list[str]:
        """Members not crashed or stopped."""
        return [org for org in self.orgs if org not in self.stopped]

    async def crash(self, org: str) -> None:
        """Kill ``org`` on the network and stop its protocols (a crashed process)."""
        self.network.kill(org)
        self.stopped.add(org)
        await self.memberships[org].stop()
        if org in self.gossips:
            await self.gossips[org].stop()

    def all_see(self, org: str, status: MemberStatus) -> bool:
        """Whether every running member other than ``org`` holds ``org`` at ``status``."""
        return all(self.memberships[o].status(org) is status for o in self.running() if o != org)

    def converged(self) -> bool:
        """Whether every running member sees exactly the running members as ALIVE."""
        expected = self.running()
        return all(self.memberships[o].live(include_suspect=False) == expected for o in expected)

    async def close(self) -> None:
        """Stop every protocol, then every endpoint (all at once: members stopped one by
        one would keep probing the stopped ones meanwhile)."""
        await asyncio.gather(
            *(g.stop() for g in self.gossips.values()),
            *(m.stop() for m in self.memberships.values()),
        )
        await asyncio.gather(*(e.close() for e in self.endpoints.values()))


async def wait_until(predicate: object, *, timeout_s: float, poll_s: float = 0.02) -> bool:
    """Poll ``predicate()`` until true or ``timeout_s`` passes; return its last value."""
    assert callable(predicate)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            return bool(predicate())
        await asyncio.sleep(poll_s)
    return True


@dataclass(frozen=True)
class Detection:
    """How one crashed member was detected (SWIM §3.1 and §4.2).

    first_suspect_s / first_dead_s: seconds from the crash until the first member
    held the victim SUSPECT / DEAD (SWIM's first detection: expected ``e / (e - 1)``
    periods until some member probes it, independent of ``n``; DEAD adds the
    suspicion timeout). all_dead_s: until every live member held it DEAD
    (dissemination, expected ``O(log n)`` periods more). period_s: the configured
    period; actual_period_s: the periods the members really ran over the same time
    (on one loaded core the loop cannot run hundreds of members on time, so the
    actual period is longer: ``dilation`` = actual / configured). The ``*_periods``
    figures divide by the actual period, so starvation does not pass for protocol
    cost.
    """

    n: int
    period_s: float
    actual_period_s: float
    first_suspect_s: float
    first_dead_s: float
    all_dead_s: float

    @property
    def dilation(self) -> float:
        return self.actual_period_s / self.period_s

    @property
    def first_suspect_periods(self) -> float:
        return self.first_suspect_s / self.actual_period_s

    @property
    def first_dead_periods(self) -> float:
        return self.first_dead_s / self.actual_period_s

    @property
    def disseminate_periods(self) -> float:
        """Periods from the first DEAD until every live member holds it DEAD."""
        return (self.all_dead_s - self.first_dead_s) / self.actual_period_s

    @property
    def all_dead_periods(self) -> float:
        return self.all_dead_s / self.actual_period_s


async def _detection(n: int, seed: int, period_s: float, max_periods: int) -> Detection:
    cluster = await SimCluster.start(n, seed=seed, swim=swim_config(period_s))
    try:
        await asyncio.sleep(2 * period_s)
        victim = random.Random(seed).choice(cluster.orgs)
        queues = {
            org: cluster.memberships[org].subscribe() for org in cluster.orgs if org != victim
        }
        first: dict[EventKind, float] = {}

        def seen() -> bool:
            now = time.perf_counter()
            for queue in queues.values():
                while not queue.empty():
                    event = queue.get_nowait()
                    if event.org_id == victim and event.kind in (EventKind.SUSPECT, EventKind.DEAD):
                        first.setdefault(event.kind, now)
            return cluster.all_see(victim, MemberStatus.DEAD)

        others = [m for o, m in cluster.memberships.items() if o != victim]
        periods_before = sum(m.periods for m in others)
        t0 = time.perf_counter()
        await cluster.crash(victim)
        ok = await wait_until(seen, timeout_s=max_periods * period_s, poll_s=period_s / 20)
        t_all = time.perf_counter()
        if not ok:
            raise RuntimeError(f"{victim} not declared DEAD by all within {max_periods} periods")
        ran = (sum(m.periods for m in others) - periods_before) / len(others)
        # a DEAD learnt without a SUSPECT first (by gossip) still implies a suspicion
        t_dead = first.get(EventKind.DEAD, t_all)
        t_suspect = min(first.get(EventKind.SUSPECT, t_dead), t_dead)
        return Detection(
            n=n,
            period_s=period_s,
            actual_period_s=max(period_s, (t_all - t0) / max(ran, 1.0)),
            first_suspect_s=t_suspect - t0,
            first_dead_s=t_dead - t0,
            all_dead_s=t_all - t0,
        )
    finally:
        await cluster.close()


def measure_detection(
    n: int, seed: int, *, period_s: float | None = None, max_periods: int = 200
) -> Detection:
    """Crash one of ``n`` members; time its first suspicion, first DEAD and all-DEAD.

    The period is fixed (``default_period(n)`` unless given); see :class:`Detection`
    for the figures in periods and the loop's time dilation.
    """
    return asyncio.run(_detection(n, seed, period_s or default_period(n), max_periods))


async def _message_rate(n: int, periods: int, seed: int, period_s: float) -> float:
    cluster = await SimCluster.start(n, seed=seed, swim=swim_config(period_s))
    try:
        await asyncio.sleep(period_s)
        before = sum(cluster.network.messages_sent.values())
        start = [m.periods for m in cluster.memberships.values()]
        await asyncio.sleep(periods * period_s)
        sent = sum(cluster.network.messages_sent.values()) - before
        ran = [m.periods - s for m, s in zip(cluster.memberships.values(), start, strict=True)]
        return sent / n / max(1.0, sum(ran) / len(ran))
    finally:
        await cluster.close()


def measure_message_rate(
    n: int, periods: int, seed: int, *, period_s: float | None = None
) -> float:
    """Messages (requests and replies) sent per member per SWIM period, steady state."""
    return asyncio.run(_message_rate(n, periods, seed, period_s or default_period(n)))


async def _broadcast(n: int, seed: int, period_s: float, max_periods: int) -> float:
    gossip = GossipConfig(period_s=period_s, push_timeout_s=period_s * 4)
    cluster = await SimCluster.start(
        n, seed=seed, swim=swim_config(max(period_s, default_period(n))), gossip=gossip
    )
    try:
        origin = cluster.gossips[cluster.orgs[0]]
        start = origin.periods
        origin.publish("bench", "k", b"x" * 32)
        ok = await wait_until(
            lambda: all(g.get("bench", "k") for g in cluster.gossips.values()),
            timeout_s=max_periods * period_s,
            poll_s=period_s / 10,
        )
        if not ok:
            raise RuntimeError(f"a record did not reach all {n} members in {max_periods} periods")
        return float(origin.periods - start)
    finally:
        await cluster.close()


def measure_broadcast(
    n: int, seed: int, *, period_s: float | None = None, max_periods: int = 200
) -> float:
    """Gossip periods (counted at the origin) until a record reaches all ``n`` members."""
    return asyncio.run(_broadcast(n, seed, period_s or default_period(n), max_periods))


def _body(report: Report) -> None:
    sizes = [16, 64] if report.quick else [16, 64, 256]
    for n in sizes:
        period = default_period(n)
        det = measure_detection(n, seed=1)
        suspicion = swim_config(period).suspicion_timeout(n) / period
        report.add(
            f"swim_first_suspect[n={n}]",
            det.first_suspect_periods,
            "periods",
            target="<= 3",
            note=f"first member to suspect the crashed one ({det.first_suspect_s:.2f}s); SWIM "
            f"expects e/(e-1) = 1.58 periods, flat in n; actual period "
            f"{det.actual_period_s:.3f}s = {det.dilation:.2f} x {period}s",
        )
        report.add(
            f"swim_first_dead[n={n}]",
            det.first_dead_periods,
            "periods",
            target=f"<= {suspicion + 4:.0f}",
            note=f"first DEAD ({det.first_dead_s:.2f}s): first suspicion + the suspicion timeout "
            f"({suspicion:.1f} periods, grows with log10 n by design)",
        )
        report.add(
            f"swim_disseminate[n={n}]",
            det.disseminate_periods,
            "periods",
            target=f"<= {2 * math.log2(n) + 4:.0f}",
            note=f"first DEAD until all live members hold it DEAD (all-agree at "
            f"{det.all_dead_s:.2f}s); expected O(log n), bound 2 log2 n + 4",
        )
        rate = measure_message_rate(n, periods=10, seed=1)
        report.add(
            f"swim_msgs[n={n}]",
            rate,
            "msgs/node/period",
            target="<= 6",
            note="requests and replies; 2 per probe, more on missed acks and piggy-backed leaves",
        )
        periods = measure_broadcast(n, seed=1)
        report.add(
            f"gossip_reach[n={n}]",
            periods,
            "periods",
            baseline=math.log2(n),
            target="<= 3",
            note="gossip periods until all members hold a record; baseline log2 n, target c = 3",
            ratio=periods / math.log2(n),
        )


def main(argv: Sequence[str] | None = None) -> Report:
    """``python -m bench.overlay_membership [--quick] [--json PATH]``."""
    # refusals of messages to crashed or stopped members are expected here; each one
    # is logged at WARNING by the receiver, which would flood the table
    logging.getLogger("coordinator_free").setLevel(logging.ERROR)
    return run_main(
        "overlay_membership",
        _body,
        argv,
        description="SWIM detection time, message rate and gossip reach on the in-memory network",
    )


if __name__ == "__main__":
    main()
