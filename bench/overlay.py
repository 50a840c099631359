"""Overlay figures: ring traffic, the star baseline, a secure round against a plain ring.

Run::

    python -m bench.overlay [--quick] [--json PATH] [--only SECTION ...]

``--only`` (repeatable) runs parts alone: ``simulated`` (the simulated secure rounds and
ring traffic), ``tls`` (the rows over mutual TLS), ``largest`` (the largest simulated
round, full mode only: on a machine with the memory for it, the 1B row) and
``membership``.

Rows (byte counts come from the transports' counters: the in-memory network's
``bytes_sent`` per org, and over TLS a counting wrapper around each process's
:class:`~coordinator_free.tls.TlsTransport`, both counting every request and reply an
org sends, envelopes and signatures included):

- ``ring_bytes_per_payload[...]``: bytes the busiest node sends during one ring
  all-reduce ÷ the payload's bytes (``4 × params``). Target ``<= 2.2`` (the ring's
  ``2 (n - 1) / n`` plus framing).
- ``star_over_ring_busiest_bytes[...]``: the same secure round star-shaped through one
  node (``RoundConfig(topology="star")``) ÷ the ring round, busiest node's bytes.
  Target ``>= n / 2.5``.
- ``round_vs_plain_ring[...]``: wall seconds of a whole secure round (ready, key
  shares, masking, ring, unmasking) ÷ a plaintext ring all-reduce of the same payload
  over the same transport. Target ``<= 1.25`` (simulated rounds of 16 peers or more:
  ``<= 1.3``). Both run warm (after one run of each that is not counted:
  connections outlive rounds in a deployment, and a process's first vector-sized
  allocations pay page faults that later rounds do not) and alternate, and each
  figure is the median of its runs: over TLS nine at 1M, five at 25M and three at
  100M, where the processes start each run together at a clock time agreed by a
  small all-reduce (they share one clock); three in the simulator, five in its 100M
  row (the first round's seconds in the note from n = 128 on).
- ``peak_rss_over_update[...]``: how far a node's resident set rose during a secure
  round (its peak, reset through ``/proc/self/clear_refs`` as the round starts, less
  the resident set then; the input exists before) ÷ the update's float32 bytes
  (``4 × params``); over TLS the worst process and timed run, in the simulator the
  process's rise ÷ its ``n`` peers. Baseline: the same figure for the plain ring.
  Target ``<= 3`` plus a fixed :data:`FIXED_RSS` (frames in flight, chunk buffers),
  so the target reads ``3 + FIXED_RSS / (4 × params)``. Linux only (skipped elsewhere).
- ``signed_msgs_per_node_per_round[n=...]``: signed requests and replies per node of
  one simulated secure round beyond the ring's own (which a plain ring sends too),
  mean over the nodes, counted by the simulator's endpoints
  (:meth:`~coordinator_free.sim.RoundOutcome.signed_per_node`); the note gives the
  per-kind breakdown and the busiest node. ``signed_msgs_per_log2n_growth[...]``
  divides that count by ``log2 n`` at the largest and the smallest ``n`` and compares
  (arithmetic on those rows): ``<= 1.25`` reads as growth no faster than ``O(log n)``.
  ``secure_round_seconds[...]``: the time of one such round at n = 128 and 256.
- ``detect_seconds[n]``, ``detect_periods[n]``, ``disseminate_periods[n]`` and
  ``msgs_per_node_per_period[n]``: SWIM failure detection and message rate, from
  :mod:`bench.overlay_membership`. Detection is SWIM's *first* detection (SWIM §3.1:
  the first member to suspect the crashed one, expected ``e / (e - 1)`` periods,
  flat in ``n``), in seconds and in the periods the members actually ran (on one
  core the loop stretches a period as ``n`` grows; the note gives that dilation);
  dissemination, first DEAD until every live member agrees, is reported apart and is
  expected to grow as ``O(log n)``.

Settings. The simulated peers of a row run in a fresh process of the row's own, on the
in-memory network (``python -m bench.overlay_sim ...``: no row inherits the heap or
the threads of the rows before it); the TLS rows run 4 org processes on 127.0.0.1
(``python -m bench.overlay_tls ...``, :mod:`bench.overlay_tls`). Full:
simulated n in {16, 64, 256} with 1M params for the ring traffic, n = 16 with 25M,
secure rounds at n in {16, 64} with 1M (warm medians of three) and at n in {128, 256}
with 256k params (``LARGE_PARAMS``; SecAgg+ graph, owner unmasking, relayed readies;
warm medians of three too, no star round: each round takes from half a minute to two
minutes of CPU here; the note gives the first round's seconds too), TLS with 1M,
25M and 100M params (the median of nine, five and three timed runs); membership at n in {16,
64, 256}; last, one secure round of 4 simulated peers with 1B params, or the most that
fits the memory available (the peers share this process: about ``5 × 4 × 4 B ×
params``, their inputs, masked sums and sums and the frames in flight): at 1B run
once, not warmed up; below it warm medians of five, the first run's seconds in the
note. (25M params for more than 16 in-process peers does not fit one machine's
memory.) Quick, under a minute on an idle machine: ring traffic of 4 and 16 peers on
64k params, a secure round of 8 simulated peers and of 4 TLS processes on 1M params,
the signed messages of one round of 64 simulated peers on 64k params (untimed),
membership at n = 16.

All simulated peers share one CPU here, so a secure round's masking work (each peer
expands ``n`` masks) is counted ``n`` times over against a ring whose message handling
is too; the TLS rows, one process per org, are the deployment-like figure. They share
one heap as well, so every timed simulated run, plain or secure, has the cyclic
collector paused, as ``timeit`` times (a full collection before it, untimed):
:func:`bench.overlay_sim.collector_paused`.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Sequence

from bench.common import (
    Report,
    available_memory,
    run_main,
)
from bench.overlay_sim import (
    LARGE_PARAMS,
    MILLION,
    RING_KINDS,
    in_fresh_process,
    stages_note,
)
from bench.overlay_tls import tls_figures

__all__ = ["main"]

BILLION = 1000 * MILLION
#: Peers of the largest simulated round (all in one process).
LARGE_SIM_PEERS = 4


def _largest_simulated(n: int, wanted: int) -> tuple[int, str]:
    """The most parameters, ``wanted`` or less, whose secure round of ``n`` simulated
    peers fits the memory available, and a note that says why.

    The peers share one process, so it holds each peer's input, its masked input that
    the ring sums in place and the unmasked sum it returns (3 ring vectors of 4 B a
    parameter), and on the in-memory network, which does not pace the senders, every
    peer's frames in flight and buffered chunks: measured at 100M, about 2 vectors
    more per peer. So ``5 n`` vectors, with a tenth more and 1 GiB for the rest, in
    three quarters of the memory available."""
    available = available_memory()

    def need(params: int) -> int:
        return int(5 * n * 4 * params * 1.1) + (1 << 30)

    for params in (wanted, 500 * MILLION, 250 * MILLION, 100 * MILLION, 25 * MILLION):
        # a quarter of what is available stays for the rest of the machine
        if params <= wanted and need(params) <= 0.75 * available:
            break
    note = ""
    if params != wanted:
        note = (
            f"; {_label(wanted)} parameters would need about {need(wanted) / 2**30:.0f} GiB "
            f"here ({n} peers in one process × 5 vectors × 4 B × params, +10%, +1 GiB), "
            f"{available / 2**30:.0f} GiB were available (a quarter kept for the rest of "
            "the machine): the largest that fits ran"
        )
    return params, note


# -- the report ---------------------------------------------------------------------------


def _label(params: int) -> str:
    if params % BILLION == 0:
        return f"{params // BILLION}B"
    return f"{params // MILLION}M" if params % MILLION == 0 else f"{params // 1000}k"


#: The fixed part of a round's memory that does not grow with the vector: a ring frame
#: in flight (16 MiB, with its copies into a message and out of one), the chunk
#: buffers of mask expansion and decoding, the interpreter's own growth.
FIXED_RSS = 64 << 20


def _add_memory_row(
    report: Report, tag: str, params: int, fig: dict[str, float], peers: int
) -> None:
    """``peak_rss_over_update``: how far one node's resident set rose during a secure
    round, over the update's float32 bytes; ``peers`` nodes share the process in the
    simulator, whose figure is divided among them."""
    if "ring_rss" not in fig:
        return
    update = 4 * params
    secure, plain = fig["ring_rss"] / peers, fig.get("plain_rss", 0.0) / peers
    where = "per process" if peers == 1 else f"the process's rise ÷ its {peers} peers"
    report.add(
        f"peak_rss_over_update[{tag}]",
        secure / update,
        "x",
        baseline=plain / update if plain else None,
        target=f"<= {3 + FIXED_RSS / update:.2f}",
        target_is_absolute=True,
        note=f"(peak RSS - RSS before the round) ÷ (4 B × params), the worst node and "
        f"timed run, {where}: secure round {secure / 2**20:.0f} MiB, plain ring "
        f"{plain / 2**20:.0f} MiB (baseline); target 3× plus {FIXED_RSS >> 20} MiB fixed",
    )


def _add_rows(
    report: Report, where: str, n: int, params: int, fig: dict[str, float], *, note: str = ""
) -> None:
    payload = 4 * params
    tag = f"{where},n={n},params={_label(params)}"
    report.add(
        f"ring_bytes_per_payload[{tag}]",
        fig["plain_busiest"] / payload,
        "x",
        target="<= 2.2",
        note=f"ring all-reduce, busiest node; 2(n-1)/n = {2 * (n - 1) / n:.3f}",
    )
    if "ring_s" not in fig:
        return
    if "star_busiest" in fig:
        _add_star_row(report, tag, n, fig)
    _add_ratio_row(report, tag, n, params, fig, note)


def _add_star_row(report: Report, tag: str, n: int, fig: dict[str, float]) -> None:
    report.add(
        f"star_over_ring_busiest_bytes[{tag}]",
        fig["star_busiest"],
        "B",
        baseline=fig["ring_busiest"],
        target=f">= {n / 2.5:.2f}",
        note="secure round through one hub ÷ the same round along the ring, busiest node",
    )


def _add_ratio_row(
    report: Report, tag: str, n: int, params: int, fig: dict[str, float], note: str
) -> None:
    """``round_vs_plain_ring`` and, where measured, ``peak_rss_over_update``."""
    where = tag.split(",", 1)[0]
    spread = ""
    if fig.get("cold"):
        spread = "; one cold run of each"
    elif fig.get("ring_min_s") == fig.get("ring_max_s") and "first_ring_s" in fig:
        spread = "; one warm run of each"
    elif "ring_min_s" in fig:
        runs = "warm runs" if fig.get("warm", 1.0) else "runs"
        spread = (
            f"; median of {runs} interleaved with the baseline's, secure "
            f"{fig['ring_min_s']:.3f}-{fig['ring_max_s']:.3f}s, plain "
            f"{fig['plain_min_s']:.3f}-{fig['plain_max_s']:.3f}s"
        )
    report.add(
        f"round_vs_plain_ring[{tag}]",
        fig["ring_s"],
        "s",
        baseline=fig["plain_s"],
        target="<= 1.3" if where == "sim" and n >= 16 else "<= 1.25",
        note="whole secure round ÷ plaintext ring all-reduce, same payload and transport"
        + spread
        + stages_note(where, fig)
        + _prepared_note(fig)
        + note,
    )
    _add_memory_row(report, tag, params, fig, n if where == "sim" else 1)


def _prepared_note(fig: dict[str, float]) -> str:
    """How many timed secure rounds took masks prepared before them, and the wait for
    them after each round (untimed: an org node's next update trains meanwhile)."""
    if "ring_prepared" not in fig:
        return ""
    return (
        f"; masks prepared while the update trains: in {fig['ring_prepared']:.0%} of "
        f"the timed rounds' masked inputs, {fig['ring_prepare_s']:.3f} s to expand "
        "after each round (not timed)"
    )


def _add_signed_row(report: Report, n: int, signed: dict[str, float]) -> float:
    """The signed messages per node of one secure round beyond the ring's own; returns it."""
    beyond = sum(v for k, v in signed.items() if k not in RING_KINDS and k != "max_beyond_ring")
    ring = sum(v for k, v in signed.items() if k in RING_KINDS)
    kinds = ", ".join(
        f"{k}={v:.2f}" for k, v in sorted(signed.items()) if k not in ("max_beyond_ring",)
    )
    report.add(
        f"signed_msgs_per_node_per_round[n={n}]",
        beyond,
        "msgs",
        note=f"signed requests and replies per node of one simulated secure round beyond the "
        f"ring's own {ring:.0f} (which a plain ring sends too), mean over nodes; busiest "
        f"node {signed.get('max_beyond_ring', 0):.0f} (a token's starter sends its "
        f"decision, and the permits, to the n - 1 others); per kind: {kinds}",
    )
    return beyond


def _add_growth_row(report: Report, counted: dict[int, float]) -> None:
    """Whether the messages beyond the ring grow no faster than ``log2 n``: the count per
    ``log2 n`` at the largest ``n`` over that at the smallest (arithmetic on the rows)."""
    if len(counted) < 2:
        return
    lo, hi = min(counted), max(counted)
    per_log = {n: counted[n] / math.log2(n) for n in (lo, hi)}
    growth = per_log[hi] / per_log[lo]
    report.add(
        f"signed_msgs_per_log2n_growth[n={lo}..{hi}]",
        per_log[hi],
        "msgs",
        baseline=per_log[lo],
        target="<= 1.25",
        note=f"(signed messages beyond the ring ÷ log2 n) at n={hi} over n={lo}, arithmetic "
        f"on the rows above: {'O(log n)' if growth <= 1.25 else 'faster than O(log n)'} "
        f"(n/log2 n alone would give {(hi / math.log2(hi)) / (lo / math.log2(lo)):.1f})",
    )


def _first(fig: dict[str, float]) -> str:
    """The note's words on the first, untimed round of a warm row's process."""
    if "first_ring_s" not in fig:
        return ""
    return (
        f"; the first round of the process: secure {fig['first_ring_s']:.1f} s, plain "
        f"{fig['first_plain_s']:.1f} s ({fig['first_ring_s'] / fig['first_plain_s']:.3f})"
    )


def _secure_rows(
    report: Report, secure: list[tuple[int, int]], count_only: Sequence[tuple[int, int]] = ()
) -> None:
    """The simulated secure rounds against a plain ring, and their signed messages, each
    ``n`` in a fresh process: warm medians of three. From n = 128 on no star round (a
    round takes up to two minutes of this machine's CPU), and the first round's seconds
    are in the note: one run of that size moves by more than its gap to the target."""
    counted: dict[int, float] = {}
    for n, params in secure:
        large = n >= 128
        fig, signed = in_fresh_process(
            "sim_figures",
            n=n,
            params=params,
            secure=True,
            repeats=3,
            star=not large,
            signed=True,
        )
        first = _first(fig)
        _add_rows(report, "sim", n, params, fig, note=first if large else "")
        if large:
            report.add(
                f"secure_round_seconds[sim,n={n},params={_label(params)}]",
                fig["ring_s"],
                "s",
                note="one secure round of every simulated peer together in one process "
                "(SecAgg+ graph, owner unmasking, relayed readies), after the first" + first,
            )
        counted[n] = _add_signed_row(report, n, signed)
    for n, params in count_only:
        counted[n] = _add_signed_row(
            report, n, in_fresh_process("count_signed", n=n, params=params)[1]
        )
    _add_growth_row(report, counted)


#: The parts of the benchmark ``--only`` can pick (all of them by default).
SECTIONS = ("simulated", "tls", "largest", "membership")


def _body(report: Report, only: Sequence[str] = SECTIONS) -> None:
    if "simulated" in only:
        _simulated_rows(report)
    if "tls" in only:
        for params in [MILLION] if report.quick else [MILLION, 25 * MILLION, 100 * MILLION]:
            # three timed runs of each at 100M: the median of three, in a bounded time;
            # nine at 1M, where a run is a fifth of a second and two runs of the plain
            # ring in one process differ by a third
            repeats = 3 if params >= 100 * MILLION else 5 if params >= 25 * MILLION else 9
            _add_rows(report, "tls", 4, params, tls_figures(params, repeats=repeats))
    if "largest" in only and not report.quick:
        _largest_row(report)
    if "membership" in only:
        for n in [16] if report.quick else [16, 64, 256]:
            _membership_rows(report, n)


def _simulated_rows(report: Report) -> None:
    """Secure rounds against plain rings, and ring traffic, of simulated peers."""
    if report.quick:
        ring_only = [(4, 65_536), (16, 65_536)]
        secure = [(8, MILLION)]
        count_only = [(64, 64 * 1024)]
    else:
        ring_only = [(256, MILLION), (16, 25 * MILLION)]
        secure = [(16, MILLION), (64, MILLION), (128, LARGE_PARAMS), (256, LARGE_PARAMS)]
        count_only = []
    _secure_rows(report, secure, count_only)
    for n, params in ring_only:
        fig, _ = in_fresh_process("sim_figures", n=n, params=params, secure=False)
        _add_rows(report, "sim", n, params, fig)


def _largest_row(report: Report) -> None:
    """One secure round of :data:`LARGE_SIM_PEERS` simulated peers with 1B parameters,
    or the most that fits the memory available."""
    params, note = _largest_simulated(LARGE_SIM_PEERS, BILLION)
    # below 1B, warm medians (the first run of each in the note), of five: one run of
    # each at 100M moved from 1.16 to 1.54 between runs, and three secure runs of one
    # process spread from 16 to 24 s
    warm = params < BILLION
    fig, _ = in_fresh_process(
        "sim_figures",
        n=LARGE_SIM_PEERS,
        params=params,
        secure=True,
        repeats=5 if warm else 1,
        warm=warm,
        star=False,
    )
    _add_rows(report, "sim", LARGE_SIM_PEERS, params, fig, note=note + _first(fig))


def _membership_rows(report: Report, n: int) -> None:
    """SWIM's detection, dissemination and message rate among ``n`` members."""
    from bench.overlay_membership import default_period, measure_detection, measure_message_rate

    period = default_period(n)
    det = measure_detection(n, seed=1)
    report.add(
        f"detect_seconds[n={n}]",
        det.first_suspect_s,
        "s",
        note=f"crash until the FIRST member suspects it (SWIM's constant-time detection): "
        f"{det.first_suspect_periods:.2f} periods of the actual "
        f"{det.actual_period_s:.3f}s (configured {period}s, time dilation "
        f"{det.dilation:.2f} on one core); first DEAD {det.first_dead_s:.2f}s = "
        f"{det.first_dead_periods:.1f} periods",
    )
    report.add(
        f"detect_periods[n={n}]",
        det.first_suspect_periods,
        "periods",
        target="<= 3",
        note="first suspicion in actual protocol periods; SWIM expects e/(e-1) = 1.58, flat in n",
    )
    report.add(
        f"disseminate_periods[n={n}]",
        det.disseminate_periods,
        "periods",
        target=f"<= {2 * math.log2(n) + 4:.0f}",
        note=f"first DEAD until every live member holds it DEAD (all-agree after "
        f"{det.all_dead_s:.2f}s); expected O(log n)",
    )
    rate = measure_message_rate(n, periods=5 if report.quick else 10, seed=1)
    report.add(
        f"msgs_per_node_per_period[n={n}]",
        rate,
        "msgs",
        target="<= 6",
        note="SWIM requests and replies per member per period, steady state",
    )


def main(argv: Sequence[str] | None = None) -> Report:
    """``python -m bench.overlay [--quick] [--json PATH] [--only SECTION ...]``."""
    parser = argparse.ArgumentParser(prog="python -m bench.overlay", add_help=False)
    parser.add_argument("--only", action="append", choices=SECTIONS, default=None)
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    only = tuple(args.only or SECTIONS)
    if only == ("largest",) and "--quick" in rest:
        raise SystemExit("--only largest: the largest simulated round runs in full mode only")
    logging.getLogger("coordinator_free").setLevel(logging.ERROR)
    return run_main(
        "overlay",
        lambda report: _body(report, only),
        rest,
        description="ring traffic, star baseline, secure round vs plain ring, membership "
        f"(also: --only {'|'.join(SECTIONS)}, repeatable: run those parts alone)",
    )


if __name__ == "__main__":
    main()
