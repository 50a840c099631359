"""In-process federation simulator with fault injection: ``python -m coordinator_free.sim``.

Hundreds of org nodes, each a real :class:`~coordinator_free.endpoint.Endpoint` with its
own Ed25519 identity and a real :class:`~coordinator_free.rounds.RoundEngine` running
:mod:`secure_agg`'s masked sum, on one :class:`~coordinator_free.memory.InMemoryNetwork`
(latency, bandwidth, loss, partitions, kills). Faulty peers are driven by an enum
(:class:`Fault`), in the manner of hivemind's ``FaultyAverager``: a :class:`FaultSpec`
says which org misbehaves, how, and at which stage of the round (the engine's stage
hook: ``ready``, ``share``, ``agree-ready``, ``mask``, ``reduce``,
``reduce.scatter.K``, ``reduce.gather.K``, ``agree-reduce``, ``unmask``).

Each simulated round is checked (:meth:`RoundOutcome.problems`): every node that
finished holds the plaintext sum of exactly the survivors' inputs, every finisher
holds the same sum and the same survivors, no node still has the round open, and a
node that did not finish says why. Used by the tests and by ``bench/overlay.py``::

    python -m coordinator_free.sim --peers 100 --rounds 3 --faults 6 --seed 1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import numpy as np
from coordinator_free.endpoint import Endpoint
from coordinator_free.errors import TransportError
from coordinator_free.identity import OrgIdentity
from coordinator_free.memory import InMemoryNetwork, InMemoryTransport
from coordinator_free.ring import KIND_CHUNK
from coordinator_free.rounds import (
    KIND_READY,
    KIND_SHARE,
    KIND_UNMASK,
    KIND_VIEW,
    RoundConfig,
    RoundEngine,
    RoundFailed,
    RoundResult,
    endpoint_signer,
    secagg_sessions,
)
from coordinator_free.transport import RawHandler, SequenceCounter
from coordinator_free.wire import Envelope

__all__ = [
    "STAGES",
    "Fault",
    "FaultSpec",
    "PartitionSpec",
    "PeerKilled",
    "RoundOutcome",
    "SimConfig",
    "Simulation",
    "main",
    "random_faults",
    "simulate",
]

STAGES = (
    "ready",
    "share",
    "agree-ready",
    "mask",
    "reduce",
    "reduce.scatter.0",
    "reduce.scatter.1",
    "reduce.gather.0",
    "reduce.gather.1",
    "agree-reduce",
    "unmask",
)
"""Stages a fault can strike at (the engine's hook names; ring steps exist up to n-2)."""


class Fault(StrEnum):
    """What a faulty peer does when its stage comes."""

    KILL = "kill"  # dies: stops answering and abandons the round
    GARBAGE = "garbage"  # sends random bytes, as envelopes and as the stage's payloads
    REPLAY = "replay"  # re-sends every request it sent so far, byte for byte
    DELAY = "delay"  # stalls for ``delay_s`` (a slow peer)
    WRONG_ROUND = "wrong_round"  # sends valid, signed messages for other rounds


class PeerKilled(Exception):
    """Raised inside a killed peer's round: it takes no further part."""


@dataclass(frozen=True)
class FaultSpec:
    """One faulty behaviour: ``org`` does ``fault`` at ``stage`` of ``round`` (None: every round)."""

    org: str
    fault: Fault
    stage: str = "share"
    round: int | None = None
    delay_s: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.fault, Fault):
            object.__setattr__(self, "fault", Fault(self.fault))
        if self.delay_s < 0:
            raise ValueError("FaultSpec.delay_s must be non-negative")


@dataclass(frozen=True)
class PartitionSpec:
    """Split the network into ``groups`` when a round starts; heal after ``heal_after_s``."""

    groups: tuple[tuple[str, ...], ...]
    heal_after_s: float


@dataclass(frozen=True)
class SimConfig:
    """A simulated federation.

    peers: how many org nodes. length: input vector length. bits: ring width.
    seed: seeds identities, inputs, secure_agg randomness and random faults.
    latency_s / bandwidth_bps / loss: the in-memory network's (see ``memory``).
    round_config: the engines' timing; None scales generous defaults with ``peers``.
    threshold: the Shamir threshold; None is a majority of the members.
    """

    peers: int = 16
    length: int = 1000
    bits: int = 32
    seed: int = 0
    latency_s: float = 0.0
    bandwidth_bps: float | None = None
    loss: float = 0.0
    round_config: RoundConfig | None = None
    threshold: int | None = None
    federation: str = "sim"
    run: str = "sim-run"

    def __post_init__(self) -> None:
        if self.peers < 2:
            raise ValueError("SimConfig.peers must be at least 2")
        if self.length < 1:
            raise ValueError("SimConfig.length must be at least 1")
        if self.bits not in (32, 64):
            raise ValueError("SimConfig.bits must be 32 or 64")

    def engine_config(self) -> RoundConfig:
        """The round config the engines use (scaled defaults unless one was given)."""
        if self.round_config is not None:
            return self.round_config
        # every peer shares this process's CPU: an all-to-all stage costs about
        # n^2 signed messages (a millisecond or more each on a loaded core) before its
        # last message lands, so the windows grow with n^2; they end early when
        # everything has arrived, so a generous window costs nothing without faults
        n = self.peers
        all_to_all = 0.02 * n * n
        return RoundConfig(
            ready_timeout=1.0 + all_to_all,
            stage_timeout=5.0 + all_to_all,
            step_timeout=3.0 + 0.05 * n,
            send_timeout=5.0 + all_to_all,
            threshold=self.threshold,
        )


@dataclass
class RoundOutcome:
    """What one simulated round gave every node, and the inputs it was checked against."""

    round: int
    inputs: dict[str, np.ndarray]
    results: dict[str, RoundResult] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    killed: set[str] = field(default_factory=set)
    faulty: set[str] = field(default_factory=set)
    open_after: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    seconds: float = 0.0
    # signed envelopes each org sent during the round, by kind (replies as ``KIND.reply``)
    signed: dict[str, Counter[str]] = field(default_factory=dict)

    @property
    def completed(self) -> bool:
        return bool(self.results)

    def expected(self, survivors: Iterable[str]) -> np.ndarray:
        """The plaintext ring sum of ``survivors``' inputs."""
        members = list(survivors)
        total = np.zeros_like(self.inputs[members[0]])
        for org in members:
            np.add(total, self.inputs[org], out=total)
        return total

    def problems(self) -> list[str]:
        """Every violated invariant, as text; empty when the round is consistent."""
        found: list[str] = []
        sums = {o: r.sum for o, r in self.results.items()}
        for org, res in self.results.items():
            if not np.array_equal(res.sum, self.expected(res.survivors)):
                found.append(f"{org}: sum differs from the plaintext sum of its survivors")
            if len(res.survivors) < res.threshold:
                found.append(f"{org}: {len(res.survivors)} survivors, below t={res.threshold}")
            if org not in res.survivors:
                found.append(f"{org}: finished but is not among its survivors")
        if sums:
            first_org = min(sums)
            first = self.results[first_org]
            for org, res in self.results.items():
                if res.survivors != first.survivors or not np.array_equal(res.sum, first.sum):
                    found.append(f"{org} and {first_org} finished with different sums")
            for org in first.survivors:
                if org not in self.results and org not in self.failures and org not in self.killed:
                    found.append(f"survivor {org} neither finished nor failed")
        for org, reason in self.failures.items():
            if not reason:
                found.append(f"{org} failed without a reason")
        for org, keys in self.open_after.items():
            if keys:
                found.append(f"{org} still has rounds open: {keys}")
        return found

    def busiest_bytes(self) -> int:
        return max((r.bytes_sent for r in self.results.values()), default=0)

    def signed_per_node(self) -> dict[str, float]:
        """Signed messages (requests and replies) per node of the round, by kind, a
        reply counted under its request's kind: the mean over every org that sent."""
        total: Counter[str] = Counter()
        for kinds in self.signed.values():
            for kind, count in kinds.items():
                total[kind.removesuffix(".reply")] += count
        n = max(1, len(self.signed))
        return {kind: count / n for kind, count in sorted(total.items())}

    def summary(self) -> dict[str, object]:
        first = self.results[min(self.results)] if self.results else None
        return {
            "round": self.round,
            "finished": len(self.results),
            "failed": len(self.failures),
            "killed": sorted(self.killed),
            "survivors": len(first.survivors) if first else 0,
            "dropped": list(first.dropped) if first else [],
            "ring_attempts": first.ring_attempts if first else 0,
            "neighbours": first.neighbours if first else None,
            "seconds": round(self.seconds, 3),
            "busiest_bytes": self.busiest_bytes(),
            "failures": dict(sorted(self.failures.items())),
            "problems": self.problems(),
        }


REPLAY_KEPT = 256
"""How many of its last requests an org with a replay fault keeps to replay."""


class _RecordingTransport:
    """An in-memory transport that keeps the last ``keep`` requests it sends, for an
    org whose faults replay them (0 for the others: a ring's chunks are large, and
    every org keeping :data:`REPLAY_KEPT` of them held hundreds of MB across rounds)."""

    def __init__(self, inner: InMemoryTransport, keep: int) -> None:
        self.inner = inner
        self.org_id = inner.org_id
        self.sent: list[tuple[str, bytes]] = []
        self.keep = keep

    async def start(self, handler: RawHandler) -> None:
        await self.inner.start(handler)

    async def request(self, peer: str, data: bytes, *, timeout: float) -> bytes:
        if self.keep:
            self.sent.append((peer, data))
            del self.sent[: -self.keep]
        return await self.inner.request(peer, data, timeout=timeout)

    async def close(self) -> None:
        await self.inner.close()


def _kind_for(stage: str) -> str:
    if stage.startswith("reduce") or stage == "mask":
        return KIND_CHUNK
    return {
        "ready": KIND_READY,
        "share": KIND_SHARE,
        "agree-ready": KIND_VIEW,
        "agree-reduce": KIND_VIEW,
        "unmask": KIND_UNMASK,
    }.get(stage, KIND_VIEW)


class Simulation:
    """A federation of ``config.peers`` simulated org nodes with ``faults`` injected.

    ``async with Simulation(cfg, faults) as sim: outcome = await sim.round(1)``.
    """

    def __init__(self, config: SimConfig, faults: Sequence[FaultSpec] = ()) -> None:
        self.config = config
        self.faults = list(faults)
        width = len(str(config.peers - 1))
        self.orgs = [f"org-{i:0{width}d}" for i in range(config.peers)]
        unknown = {f.org for f in self.faults} - set(self.orgs)
        if unknown:
            raise ValueError(f"faults name orgs not in the simulation: {sorted(unknown)}")
        self.network = InMemoryNetwork(
            latency_s=config.latency_s,
            bandwidth_bps=config.bandwidth_bps,
            loss=config.loss,
            seed=config.seed,
        )
        self.identities = {
            o: OrgIdentity.generate(o, private_bytes=_seed_bytes(config.seed, o)) for o in self.orgs
        }
        self._keys = {o: i.public_key for o, i in self.identities.items()}
        replaying = {f.org for f in self.faults if f.fault is Fault.REPLAY}
        self.transports = {
            o: _RecordingTransport(
                self.network.transport(o), keep=REPLAY_KEPT if o in replaying else 0
            )
            for o in self.orgs
        }
        # every signed envelope each org sent (requests and replies), by kind
        self.signed: dict[str, Counter[str]] = {}
        # one sequence counter per org, as each org's own process would have: with the
        # process-wide counter, the numbers one org draws are spread over every simulated
        # org's traffic, and a request that waited in the loop behind a few thousand
        # others falls below its receiver's replay window (``transport.ReplayWindow``)
        # and is refused as a replay once an all-to-all stage carries more messages than
        # the window (above about 64 peers)
        self.endpoints = {
            o: Endpoint(
                self.identities[o],
                config.federation,
                self.transports[o],
                self.members,
                sequence=SequenceCounter(),
                on_egress=self._count_for(o),
            )
            for o in self.orgs
        }
        engine_config = config.engine_config()
        # the fault hook only where there are faults to inject: an org node's engine has
        # none, and the hook costs every stage and ring step a coroutine
        hook = self._hook if self.faults else None
        self.engines = {
            o: RoundEngine(
                self.endpoints[o],
                self.member_ids,
                secagg_sessions(*endpoint_signer(self.endpoints[o]), seed=config.seed),
                engine_config,
                hook=hook,
                live=self.live_ids,
            )
            for o in self.orgs
        }
        self.killed: set[str] = set()
        self.refusals_seen = 0
        self._started = False

    def _count_for(self, org: str) -> Callable[[Envelope, bytes], None]:
        counts = self.signed.setdefault(org, Counter())
        lock = threading.Lock()

        def count(env: Envelope, wire: bytes) -> None:
            # the endpoint calls it from a worker thread for a large message
            with lock:
                counts[env.kind] += 1

        return count

    def members(self) -> dict[str, bytes]:
        """Every member's Ed25519 public key (the manifest of the simulated federation)."""
        return self._keys

    def member_ids(self) -> list[str]:
        return self.orgs

    def live_ids(self) -> list[str]:
        """The members not killed: what a perfect failure detector (SWIM, settled) says."""
        return [o for o in self.orgs if o not in self.killed]

    async def start(self) -> None:
        for endpoint in self.endpoints.values():
            await endpoint.start()
        self._started = True

    async def close(self) -> None:
        for endpoint in self.endpoints.values():
            await endpoint.close()

    async def __aenter__(self) -> Simulation:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def inputs(self, round: int) -> dict[str, np.ndarray]:
        """Every org's input of ``round``: uniform ring elements, seeded."""
        dtype = np.uint32 if self.config.bits == 32 else np.uint64
        rng = np.random.default_rng([self.config.seed, round])
        data = rng.integers(
            0,
            np.iinfo(dtype).max,
            size=(len(self.orgs), self.config.length),
            dtype=dtype,
            endpoint=True,
        )
        return {o: data[i] for i, o in enumerate(self.orgs)}

    # -- faults ---------------------------------------------------------------------------

    async def _hook(self, org: str, run: str, round: int, stage: str) -> None:
        for spec in self.faults:
            if spec.org == org and spec.stage == stage and spec.round in (None, round):
                await self._strike(spec, run, round, stage)

    async def _strike(self, spec: FaultSpec, run: str, round: int, stage: str) -> None:
        org = spec.org
        if spec.fault is Fault.KILL:
            self.network.kill(org)
            self.killed.add(org)
            raise PeerKilled(f"{org} killed at {stage} of round {round}")
        if spec.fault is Fault.DELAY:
            await asyncio.sleep(spec.delay_s)
            return
        others = [o for o in self.orgs if o != org and o not in self.killed]
        endpoint = self.endpoints[org]
        rng = random.Random(f"{self.config.seed}/{org}/{round}/{stage}")
        sends: list[tuple[str, str, bytes, int]] = []
        raw: list[tuple[str, bytes]] = []
        if spec.fault is Fault.GARBAGE:
            kind = _kind_for(stage)
            for peer in others:
                sends.append((peer, kind, rng.randbytes(rng.randint(1, 200)), round))
                raw.append((peer, rng.randbytes(rng.randint(1, 200))))
        elif spec.fault is Fault.REPLAY:
            raw = list(self.transports[org].sent)
        elif spec.fault is Fault.WRONG_ROUND:
            lookahead = self.config.engine_config().lookahead_rounds
            for peer in others:
                for wrong in {max(0, round - 1), round + lookahead + 5} - {round}:
                    sends.append((peer, _kind_for(stage), b"\x00" * 48, wrong))
        timeout = self.config.engine_config().send_timeout

        async def send(peer: str, kind: str, payload: bytes, rnd: int) -> None:
            try:
                await endpoint.send(
                    peer, kind, payload, run=run, round=rnd, stage=stage, timeout=timeout
                )
            except TransportError:
                self.refusals_seen += 1

        async def resend(peer: str, data: bytes) -> None:
            try:
                await self.transports[org].inner.request(peer, data, timeout=timeout)
            except TransportError:
                self.refusals_seen += 1

        await asyncio.gather(
            *(send(*s) for s in sends), *(resend(peer, data) for peer, data in raw)
        )

    # -- rounds ---------------------------------------------------------------------------

    async def round(
        self,
        round: int,
        *,
        partition: PartitionSpec | None = None,
        inputs: dict[str, np.ndarray] | None = None,
    ) -> RoundOutcome:
        """Run one round on every live node at once; return what each got."""
        if not self._started:
            raise RuntimeError("start() the simulation first")
        inputs = inputs if inputs is not None else self.inputs(round)
        outcome = RoundOutcome(round=round, inputs=inputs)
        outcome.faulty = {f.org for f in self.faults if f.round in (None, round)}
        live = [o for o in self.orgs if o not in self.killed]
        healer: asyncio.Task[None] | None = None
        if partition is not None:
            self.network.partition(*partition.groups)

            async def heal() -> None:
                await asyncio.sleep(partition.heal_after_s)
                self.network.heal()

            healer = asyncio.ensure_future(heal())
        signed_before = {o: Counter(c) for o, c in self.signed.items()}
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(self.engines[o].run_round(self.config.run, round, inputs[o]) for o in live),
            return_exceptions=True,
        )
        outcome.seconds = time.perf_counter() - t0
        for org, counts in self.signed.items():
            sent = counts - signed_before.get(org, Counter())
            if sent:
                outcome.signed[org] = sent
        if healer is not None:
            healer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await healer
            self.network.heal()
        for org, res in zip(live, results, strict=True):
            if isinstance(res, RoundResult):
                outcome.results[org] = res
            elif isinstance(res, PeerKilled):
                pass
            elif isinstance(res, RoundFailed):
                outcome.failures[org] = res.reason
            elif isinstance(res, BaseException):
                raise res
        outcome.killed = set(self.killed)
        outcome.open_after = {
            o: [k for k in self.engines[o].open_rounds() if k[1] <= round] for o in live
        }
        return outcome


def _seed_bytes(seed: int, org: str) -> bytes:
    return hashlib.sha256(f"fedweave-sim/{seed}/{org}".encode()).digest()


def random_faults(
    orgs: Sequence[str],
    count: int,
    *,
    rounds: Sequence[int] = (1,),
    seed: int = 0,
    kinds: Sequence[Fault] = tuple(Fault),
    stages: Sequence[str] = STAGES,
) -> list[FaultSpec]:
    """``count`` faults on distinct orgs, with random kinds, stages and rounds (seeded)."""
    if count > len(orgs):
        raise ValueError(f"{count} faults need {count} distinct orgs, there are {len(orgs)}")
    rng = random.Random(seed)
    chosen = rng.sample(list(orgs), count)
    return [
        FaultSpec(
            org=o,
            fault=rng.choice(list(kinds)),
            stage=rng.choice(list(stages)),
            round=rng.choice(list(rounds)),
            delay_s=rng.uniform(0.05, 0.5),
        )
        for o in chosen
    ]


async def simulate(
    config: SimConfig,
    rounds: int = 1,
    faults: Sequence[FaultSpec] = (),
    *,
    partition: PartitionSpec | None = None,
) -> list[RoundOutcome]:
    """Run ``rounds`` rounds (the partition, if any, in the first); return every outcome."""
    async with Simulation(config, faults) as sim:
        outcomes = []
        for r in range(1, rounds + 1):
            outcomes.append(await sim.round(r, partition=partition if r == 1 else None))
        return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: simulate rounds with random faults, print one line per round."""
    parser = argparse.ArgumentParser(
        prog="python -m coordinator_free.sim", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--peers", type=int, default=32, help="simulated org nodes")
    parser.add_argument("--rounds", type=int, default=2, help="rounds to run")
    parser.add_argument("--length", type=int, default=1000, help="input vector length")
    parser.add_argument("--faults", type=int, default=2, help="faulty peers (random kinds)")
    parser.add_argument("--kinds", default=",".join(f.value for f in Fault), help="fault kinds")
    parser.add_argument("--latency", type=float, default=0.0, help="one-way latency (s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the outcomes as JSON")
    parser.add_argument("--verbose", action="store_true", help="log every refusal and retry")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR)
    config = SimConfig(peers=args.peers, length=args.length, seed=args.seed, latency_s=args.latency)
    width = len(str(args.peers - 1))
    orgs = [f"org-{i:0{width}d}" for i in range(args.peers)]
    kinds = [Fault(k) for k in args.kinds.split(",") if k]
    faults = random_faults(
        orgs, args.faults, rounds=range(1, args.rounds + 1), seed=args.seed, kinds=kinds
    )
    for f in faults:
        print(f"fault: {f.org} {f.fault.value} at {f.stage} of round {f.round}")
    outcomes = asyncio.run(simulate(config, args.rounds, faults))
    ok = True
    rows = []
    for out in outcomes:
        row = out.summary()
        rows.append(row)
        ok = ok and not row["problems"]
        print(
            f"round {row['round']}: {row['finished']} finished, {row['failed']} failed, "
            f"{row['survivors']} survivors, dropped {row['dropped']}, "
            f"{row['ring_attempts']} ring runs, SecAgg+ k={row['neighbours']}, "
            f"{row['seconds']}s, "
            f"busiest node sent {row['busiest_bytes']} B"
            + (f", PROBLEMS: {row['problems']}" if row["problems"] else "")
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
