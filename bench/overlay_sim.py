"""Simulated peers for :mod:`bench.overlay`: the rounds' settings, a plain ring and secure
rounds of ``n`` peers in one process on the in-memory network, and their signed
messages.

Every timed run has the cyclic collector paused (:func:`collector_paused`), for the
plain ring and the secure round alike. :mod:`bench.overlay` runs each simulated row in
a fresh process of its own (:func:`in_fresh_process`, ``python -m bench.overlay_sim
REQUEST``), so that no row inherits the heap, the thread pool or the collector's
generations that the rows before it left.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from coordinator_free.ring import ring_order
from coordinator_free.rounds import RoundConfig
from coordinator_free.sim import RoundOutcome, SimConfig, Simulation

from bench.common import can_measure_memory, peak_rss_since_reset

__all__ = [
    "LARGE_PARAMS",
    "MILLION",
    "RING_KINDS",
    "collector_paused",
    "count_signed",
    "in_fresh_process",
    "round_config",
    "signed_of",
    "sim_figures",
    "stage_medians",
    "stages_note",
]

MILLION = 1_000_000
RING_KINDS = frozenset({"agg.chunk", "agg.sum"})
"""The ring's own messages (its reduce-scatter and all-gather), which a plain ring of
the same vector sends too; the rest of a secure round's messages are its overhead."""
LARGE_PARAMS = 256 * 1024
"""Parameters of the simulated secure rounds at n = 128 and 256: all their peers share
one process, and 256 peers' vectors, masks and ring buffers of 1M parameters would
take most of the machine's memory and an hour of its CPU per round; ``n *
ring_min_chunk`` = 262 144 elements at n = 256 still gives owner unmasking its chunks."""


def round_config(
    n: int, topology: str = "ring", params: int = MILLION, mask_helper: str = "auto"
) -> RoundConfig:
    """The benchmark's rounds of ``n`` members on a vector of ``params`` elements, in
    the simulator and over TLS: a step of a large vector on a loaded machine takes
    seconds, so the timeouts grow with both. ``mask_helper``: ``RoundConfig``'s."""
    slack = 60.0 + n + params / MILLION
    return RoundConfig(
        ready_timeout=30.0,
        stage_timeout=slack,
        step_timeout=slack,
        send_timeout=slack,
        topology=topology,
        mask_helper=mask_helper,
    )


SIM_MASK_HELPER = "process"
"""Where the simulated peers expand their masks: in the helper process, streamed into
the ring, as an org node does by default on a machine of four cores or more
(``RoundConfig.mask_helper``). Each simulated org stands for a machine of its own,
and the simulation's peers share one helper, as they share one interpreter."""


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """One timed run of simulated peers with the cyclic collector paused, as ``timeit``
    times: a full collection first (untimed), none during the run.

    The peers of a simulation share one heap, so each full collection walks every
    peer's objects, where a deployed org's walks its own: summed over the peers the
    simulation collects about ``n`` times the work the deployed orgs would, and the side
    with more live objects pays the most (at n = 256: 23 s of a secure round, 4.3 s of a
    plain ring). Both sides run paused alike."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


async def sim_figures(
    n: int,
    params: int,
    *,
    secure: bool,
    repeats: int = 3,
    warm: bool = True,
    star: bool = True,
    signed: dict[str, float] | None = None,
) -> dict[str, float]:
    """Busiest bytes and seconds of a plain ring, and of secure rounds (ring, star).

    Seconds are warm, like the TLS rows': one plain ring and one secure round first
    (the first vector-sized allocations of a process cost page faults that later
    rounds do not pay; their seconds are kept apart, ``first_plain_s`` and
    ``first_ring_s``), then ``repeats`` of each, interleaved, and the median of each;
    ``warm=False`` skips the first runs (a vector too large to run twice). Where the
    platform lets the peak resident set be reset, the most it rose during each plain
    ring and secure round (``plain_rss``, ``ring_rss``: bytes, all ``n`` peers of this
    process together, the inputs made before).
    ``signed`` gets the signed messages per node of the last secure ring round, by
    kind (:meth:`RoundOutcome.signed_per_node`). Where a secure round's time goes:
    ``ring_stage_<stage>``, each stage's seconds (:func:`stage_medians`), the median
    over the timed ring rounds."""
    out: dict[str, float] = {}
    timer = _Timer(n, params, signed)
    for topology in ("ring", "star") if secure and star else ("ring",):
        config = SimConfig(
            peers=n,
            length=params,
            seed=1,
            round_config=round_config(n, topology, params, SIM_MASK_HELPER),
        )
        async with Simulation(config) as sim:
            for engine in sim.engines.values():
                engine.prepare_on_done = False  # the timer starts it once all are done
            if topology == "ring":
                out |= await _ring_rows(timer, sim, secure=secure, repeats=repeats, warm=warm)
            else:
                out["star_s"], out["star_busiest"] = await timer.secure_round(sim, "star")
    out["warm"] = 1.0 if warm else 0.0
    for name, peaks in timer.rss.items():
        if peaks:
            out[f"{name}_rss"] = float(max(peaks))
    return out


class _Timer:
    """Times plain rings and secure rounds of the simulations of one row, numbering
    their rounds on from one simulation to the next, and keeps each one's rise of the
    peak resident set (``rss``, by kind) where the platform can measure it."""

    def __init__(self, n: int, params: int, signed: dict[str, float] | None) -> None:
        self.n, self.params, self.signed = n, params, signed
        # the secure rounds are numbered on consecutively, as an org node's rounds of
        # one run are (the masks of the next one are prepared after each); the plain
        # rings, another run, apart
        self.rounds = itertools.count(1)
        self.plain_rounds = itertools.count(1)
        self.memory = can_measure_memory()
        self.rss: dict[str, list[int]] = {"plain": [], "ring": [], "star": []}
        self.prepared: list[int] = []  # the peers whose masks each round had prepared
        self.prepare_s: list[float] = []  # seconds waited for the next round's masks

    async def plain(self, sim: Simulation) -> tuple[float, float]:
        """One plain ring all-reduce of every peer's input: seconds, busiest bytes."""
        n, rnd = self.n, next(self.plain_rounds)
        inputs = sim.inputs(rnd)
        order = ring_order(sim.orgs, rnd)
        for engine in sim.engines.values():
            # what a sender may buffer here, sized from the vector as a round's is
            engine.ring.open("plain", rnd)
            engine.ring.expect("plain", rnd, 4 * self.params, 1)
        before = dict(sim.network.bytes_sent)
        with collector_paused():
            peak = peak_rss_since_reset() if self.memory else None
            t0 = time.perf_counter()
            await asyncio.gather(
                *(
                    sim.engines[o].ring.allreduce(
                        order, inputs[o], run="plain", round=rnd, timeout=60.0 + n
                    )
                    for o in sim.orgs
                )
            )
            seconds = time.perf_counter() - t0
        if peak is not None:
            self.rss["plain"].append(peak())
        for engine in sim.engines.values():
            engine.ring.close("plain", rnd)
        return seconds, busiest(sim.network.bytes_sent, before)

    async def secure_round(
        self, sim: Simulation, kind: str, stages: list[dict[str, float]] | None = None
    ) -> tuple[float, float]:
        """One secure round of every peer (``kind``: its topology): seconds, busiest
        bytes; its stages' medians appended to ``stages``."""
        rnd = next(self.rounds)
        inputs = sim.inputs(rnd)
        before = dict(sim.network.bytes_sent)
        with collector_paused():
            peak = peak_rss_since_reset() if self.memory else None
            outcome = await sim.round(rnd, inputs=inputs)
        if peak is not None:
            self.rss[kind].append(peak())
        # the next round's masks, expanded while each org's next update would train:
        # untimed, once every peer is done (each org has its own cores), and off the
        # CPU of the next timing
        t0 = time.perf_counter()
        for engine in sim.engines.values():
            engine.prepare_masks(sim.config.run)
        await asyncio.gather(*(e.masks_prepared(sim.config.run) for e in sim.engines.values()))
        self.prepare_s.append(time.perf_counter() - t0)
        self.prepared.append(sum(r.masks_prepared for r in outcome.results.values()))
        if outcome.problems() or len(outcome.results) != self.n:
            raise RuntimeError(f"secure round failed: {outcome.summary()}")
        if self.signed is not None and kind == "ring":
            self.signed.clear()
            self.signed.update(signed_of(outcome))
        if stages is not None:
            stages.append(stage_medians(outcome))
        return outcome.seconds, busiest(sim.network.bytes_sent, before)


async def _ring_rows(
    timer: _Timer, sim: Simulation, *, secure: bool, repeats: int, warm: bool
) -> dict[str, float]:
    """The ring's figures of :func:`sim_figures`: plain rings and, when ``secure``,
    secure rounds, interleaved (warm-up first, unless ``warm`` is off)."""
    out: dict[str, float] = {}
    runs = repeats if secure else 1
    if secure and warm:
        # the warm-up is timed too: the first round of a process, reported apart
        out["first_plain_s"] = (await timer.plain(sim))[0]
        out["first_ring_s"] = (await timer.secure_round(sim, "ring"))[0]
        timer.rss["plain"].clear()
        timer.rss["ring"].clear()
    timed: dict[str, list[float]] = {"plain": [], "ring": []}
    stages: list[dict[str, float]] = []
    for _ in range(runs):
        seconds, out["plain_busiest"] = await timer.plain(sim)
        timed["plain"].append(seconds)
        if secure:
            seconds, out["ring_busiest"] = await timer.secure_round(sim, "ring", stages)
            timed["ring"].append(seconds)
    if secure:
        # the timed rounds: the fewest peers that took prepared masks in one, and the
        # median wait for the masks of the round after each (all peers, one process)
        timed_prepared = timer.prepared[-runs:]
        out["ring_prepared"] = float(min(timed_prepared)) / timer.n
        out["ring_prepare_s"] = statistics.median(timer.prepare_s[-runs:])
    for stage in sorted({s for times in stages for s in times}):
        out[f"ring_stage_{stage}"] = statistics.median(times.get(stage, 0.0) for times in stages)
    if not warm:
        out["cold"] = 1.0
    for name, values in timed.items():
        if values:
            out[f"{name}_s"] = statistics.median(values)
            out[f"{name}_min_s"], out[f"{name}_max_s"] = min(values), max(values)
    return out


def stage_medians(outcome: RoundOutcome) -> dict[str, float]:
    """Each stage's seconds in one secure round (``RoundResult.stage_times``), the
    median over its peers: a stage a peer did not enter counts as 0."""
    results = list(outcome.results.values())
    stages = sorted({s for r in results for s in r.stage_times})
    return {s: statistics.median(r.stage_times.get(s, 0.0) for r in results) for s in stages}


#: A round's stages in the order it runs them (``RoundResult.stage_times``).
STAGE_ORDER = (
    "ready",
    "share",
    "agree-ready",
    "mask",
    "reduce",
    "agree-reduce",
    "unmask",
    "gather",
)


def stages_note(where: str, fig: dict[str, float]) -> str:
    """Where the secure round's time went, stage by stage (``ring_stage_*`` figures):
    over TLS the slowest node's seconds in the last timed round, simulated the median
    over the peers and the timed rounds; empty when the figures have none."""
    stages = {
        k.removeprefix("ring_stage_"): v for k, v in fig.items() if k.startswith("ring_stage_")
    }
    if not stages:
        return ""

    def rank(stage: str) -> tuple[int, str]:
        return (STAGE_ORDER.index(stage) if stage in STAGE_ORDER else len(STAGE_ORDER), stage)

    which = (
        "the slowest node, last timed round"
        if where == "tls"
        else "median over peers and timed rounds"
    )
    parts = ", ".join(f"{stage} {stages[stage]:.3f}" for stage in sorted(stages, key=rank))
    return f"; its stages in s ({which}): {parts}"


def busiest(after: dict[str, int] | Any, before: dict[str, int]) -> float:
    return float(max(after[o] - before.get(o, 0) for o in after))


async def count_signed(n: int, params: int) -> dict[str, float]:
    """The signed messages per node of a secure round, untimed (quick mode's counts): the
    second round of the simulation, as the timed rows are warm (in the first, no org
    knows its holders' keys yet, and the shares take the share exchange)."""
    config = SimConfig(peers=n, length=params, seed=1, round_config=round_config(n))
    async with Simulation(config) as sim:
        for rnd in (1, 2):
            outcome = await sim.round(rnd)
            if outcome.problems() or len(outcome.results) != n:
                raise RuntimeError(f"secure round failed: {outcome.summary()}")
        return signed_of(outcome)


def signed_of(outcome: RoundOutcome) -> dict[str, float]:
    """Signed messages per node by kind, and the busiest node's beyond the ring."""
    signed = outcome.signed_per_node()
    signed["max_beyond_ring"] = max(
        sum(c for k, c in kinds.items() if k.removesuffix(".reply") not in RING_KINDS)
        for kinds in outcome.signed.values()
    )
    return signed


# -- one row in a process of its own ------------------------------------------------------

_CALLS = ("sim_figures", "count_signed")


def in_fresh_process(call: str, **kwargs: Any) -> tuple[dict[str, float], dict[str, float]]:
    """``call`` (:func:`sim_figures` or :func:`count_signed`) with ``kwargs``, run in a
    fresh Python process: its figures and the signed messages per node by kind
    (``kwargs["signed"] = True`` asks :func:`sim_figures` for them).

    A process that has run other rows holds what they left: a heap grown and cut up by
    their vectors (a large cold row measured 1.14 in a process of its own and 2.06
    after the other rows), the default executor's threads, the collector's older
    generations. A row in its own process pays none of it, as each deployed org runs
    in its own. Raises :class:`RuntimeError` when the row fails there (its error went
    to standard error)."""
    if call not in _CALLS:
        raise ValueError(f"call must be one of {_CALLS}, got {call!r}")
    request = json.dumps({"call": call, "kwargs": kwargs})
    done = subprocess.run(
        [sys.executable, "-m", "bench.overlay_sim", request],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.PIPE,
        text=True,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"the simulated row {call}({kwargs}) failed in its process "
            f"(exit {done.returncode}; its error is above)"
        )
    answer = json.loads(lines[-1])
    return answer["figures"], answer["signed"]


def _row_main(argv: Sequence[str]) -> None:
    """``python -m bench.overlay_sim REQUEST``: one row of :func:`in_fresh_process`; the
    answer is the last line of standard output."""
    if len(argv) != 1:
        raise SystemExit("usage: python -m bench.overlay_sim REQUEST (a JSON call)")
    request = json.loads(argv[0])
    call, kwargs = request["call"], dict(request["kwargs"])
    logging.getLogger("coordinator_free").setLevel(logging.ERROR)
    signed: dict[str, float] = {}
    figures: dict[str, float] = {}
    if call == "sim_figures":
        wanted = kwargs.pop("signed", False)
        figures = asyncio.run(sim_figures(**kwargs, signed=signed if wanted else None))
    elif call == "count_signed":
        signed = asyncio.run(count_signed(**kwargs))
    else:
        raise SystemExit(f"unknown call {call!r}: one of {_CALLS}")
    print(json.dumps({"figures": figures, "signed": signed}), flush=True)


if __name__ == "__main__":
    _row_main(sys.argv[1:])
