"""The ring first (``U1`` settled by the ring's completion), against the ring that waits.

Run ``python -m bench.ring_first [--quick] [--json PATH]``. Simulated secure rounds
(in-memory transport, one process) of ``n`` members whose shares ride with the
readies, so that ``U1`` is agreed by the token (``RoundConfig.shares_ahead_from``):
once with the ring first (``ring_first = true``, the default: a node whose proposal
holds every member starts its ring at once, and the ring's completion settles ``U1``
with no message), once with the token run in every round and the ring waiting for
its decision (the baseline). Each run is a fresh simulation; the row is the median of
its steady rounds (2..R; round 1 exchanges the shares and is left out).

* ``round_s[sim,n=N,latency=20ms]``: the in-memory network delays every message by
  20 ms one way, as between institutions: the token's ``2 n`` hops, ``n`` of them one
  after another, are wall time. The ratio follows from the simulator's network model
  (a fixed delay, no bandwidth limit), not from a network.
* ``round_s[sim,n=N,latency=0]``: no delay. Every peer shares one interpreter, so the
  round is CPU-bound: what goes is the token's work, and what its wait hid (the
  premask's expansion) shows in the mask stage.
* ``agree_u1_s[...]``: the seconds the round spent in the agreement on ``U1`` (the
  ``agree-ready`` stage of the slowest node).
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from collections.abc import Sequence

from coordinator_free.sim import SimConfig, Simulation

from bench.common import Report, run_main

__all__ = ["figures", "main"]

LATENCY_S = 0.02


def figures(n: int, length: int, latency_s: float, beside: bool, rounds: int) -> dict[str, float]:
    """One fresh simulation of ``rounds`` rounds: the median steady round's seconds and
    its ``agree-ready`` stage's (the slowest node's), every round checked exact."""
    sim_config = SimConfig(peers=n, length=length, seed=1, latency_s=latency_s)
    config = dataclasses.replace(sim_config.engine_config(), ring_first=beside, ring_min_chunk=64)
    sim_config = dataclasses.replace(sim_config, round_config=config)

    async def run() -> tuple[list[float], list[float]]:
        walls, agree = [], []
        async with Simulation(sim_config) as sim:
            for r in range(1, rounds + 1):
                t0 = time.perf_counter()
                out = await sim.round(r)
                wall = time.perf_counter() - t0
                if out.problems() or len(out.results) != n:
                    raise RuntimeError(f"round {r} did not complete exactly: {out.summary()}")
                if r > 1:
                    walls.append(wall)
                    agree.append(
                        max(res.stage_times.get("agree-ready", 0.0) for res in out.results.values())
                    )
        return walls, agree

    walls, agree = asyncio.run(run())
    return {"round_s": statistics.median(walls), "agree_u1_s": statistics.median(agree)}


def body(report: Report) -> None:
    n, length, rounds = (40, 16_384, 3) if report.quick else (64, 65_536, 5)
    for latency in (LATENCY_S, 0.0):
        label = (
            f"sim,n={n},latency={round(latency * 1000)}ms" if latency else f"sim,n={n},latency=0"
        )
        beside = figures(n, length, latency, True, rounds)
        waiting = figures(n, length, latency, False, rounds)
        note = (
            f"{length} elements, median of rounds 2..{rounds}; baseline: the ring waits for "
            "the token's decision"
        )
        if latency:
            note += "; the ratio follows from the simulator's network model (a fixed delay)"
        report.add(f"round_s[{label}]", beside["round_s"], "s", waiting["round_s"], note=note)
        report.add(
            f"agree_u1_s[{label}]",
            beside["agree_u1_s"],
            "s",
            waiting["agree_u1_s"],
            note="the agreement-on-U1 stage of the slowest node",
        )


def main(argv: Sequence[str] | None = None) -> Report:
    """``python -m bench.ring_first [--quick] [--json PATH]``."""
    return run_main("ring_first", body, argv, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    main()
