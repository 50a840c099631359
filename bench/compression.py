"""Compressed secure updates: bytes on the wire, accuracy, and bytes to a target loss.

Run ``python -m bench.compression [--quick] [--json PATH]``. Every figure comes from
real :class:`~org_node.engine.RunEngine` runs: 4 orgs, each with its own
:class:`~coordinator_free.rounds.RoundEngine` (signed messages, pairwise masks,
Shamir-shared seeds, the ring reduce-scatter and all-gather) on the in-memory network
of the simulator, training in-process. Each row compares a compressed run (run spec
``compression``, :mod:`org_node.compression`) against the dense one, measured in the
same run of the benchmark. Rows:

* ``wire_bytes_per_param[C]`` for ``dense`` (the 32-bit ring), ``q8`` and
  ``random-k=0.1,q8``: the ring payload bytes (the round's byte counter of ring chunks:
  the masked vector, frame headers included) the busiest node sent in the run's last
  round, ÷ the model's parameters ÷ ``2 (n - 1) / n`` (what a ring all-reduce sends of
  a vector per node, 1.5 at n = 4). The model is a synthetic one of random updates
  (``P`` parameters in 4 tensors), so that only the encoding matters. Targets 4.0,
  ``<= 2.0``, ``<= 0.25``. q8's first round is its calibration round (the dense
  codec), hence the last round.
* ``acc_vs_dense[task=T,compression=C]``: held-out accuracy after R rounds of FedAvg
  (local SGD, Dirichlet(0.5) label skew on digits, IID windows on gpt) with
  compression C (``q8`` and ``random-k=0.1,q8``) ÷ the same federation without it
  (the 32-bit ring), each the mean over ``SEEDS`` seeds (the model's initialisation,
  the partition, the batches and the run key, hence random-k's support); one run's
  ratio moves by about ±0.02 with them. The note gives the lowest and highest of the
  seeds' ratios. Target ``>= 0.98``. R is 60 on digits (full mode), where the dense
  run has levelled off, and 40 on gpt, where it is still improving (0.305 at 40
  rounds, 0.384 at 120 on the 64k-character corpus), so on gpt the row also holds
  random-k's lag: each coordinate moves once in ``1/F`` rounds. The note gives both
  runs' mean accuracy at round R / 2. The runs go to one process per core.
* ``bytes_to_target_vs_fedavg_dense[task=gpt,compression=random-k=0.1,q8,
  strategy=diloco]``: FedAvg without compression (local AdamW, H steps a round, R
  rounds) sets the target, its final held-out loss; DiLoCo with ``random-k=0.1,q8``
  (the same inner optimizer, ``DILOCO_INNER`` times H inner steps a round, outer
  Nesterov) runs (at most 2R rounds) until its held-out loss reaches it. The row is
  the bytes the busiest node sent (every payload of the secure sum: ready, shares,
  ring, unmasking) until then ÷ those of FedAvg-dense's R rounds; infinite when
  DiLoCo never gets there (the note then gives its best loss). Target ``<= 0.05``.
  DiLoCo trades local compute for communication: the note gives both runs' local
  steps per org.
* ``support_vs_mask_expansion[params=100M,compression=random-k=0.1]``: the seconds of
  random-k's support over 100M coordinates (10M in quick mode), which every org
  computes once a round, ÷ those of one pairwise mask over the same coordinates in a
  64-bit ring (what a dense round expands once per neighbour). No target: the cost
  of drawing the support without replacement, measured.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from coordinator_free.endpoint import Endpoint
from coordinator_free.identity import OrgIdentity
from coordinator_free.memory import InMemoryNetwork
from coordinator_free.rounds import RoundConfig, RoundEngine, endpoint_signer, secagg_sessions

from bench.common import Report, run_main
from org_node.compressor import run_seed, support
from org_node.engine import ATTEMPTS, EngineConfig, RoundReport, RunEngine, RunPlan
from org_node.tasks import Task, evaluate, load_state, load_task, model_state
from org_node.tasks.gpt import CORPUS
from org_node.tasks.partition import dirichlet_partition, iid_partition
from org_node.training.exchange import LocalResult
from secure_agg.prg import add_masks

__all__ = ["FedRun", "main", "run_federation"]

N_ORGS = 4
ALPHA = 0.5
DENSE = "none"
Q8 = "q8"
SPARSE_Q8 = "random-k=0.1,q8"
SEEDS = 5
"""Seeds of each accuracy row in full mode (one in quick mode)."""
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.5
"""DiLoCo's outer Nesterov step with random-k (the paper's 0.9 momentum overshoots when
each coordinate's update arrives once every ~1/F rounds, with its residual)."""
DILOCO_INNER = 5
"""DiLoCo's inner steps a round, as a multiple of FedAvg's local steps: its rounds are
fewer and longer (Douillard et al. run hundreds of inner steps a round)."""
RING_FACTOR = 2 * (N_ORGS - 1) / N_ORGS
"""What a ring all-reduce sends of a vector per node (reduce-scatter, then all-gather)."""


# --------------------------------------------------------------------------- trainers


class RandomTrainer:
    """Random updates of a synthetic model (the wire rows: only the encoding matters)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def train(
        self, global_state: Mapping[str, np.ndarray], round: int, options: Mapping[str, Any]
    ) -> LocalResult:
        rng = np.random.default_rng([self.seed, round])
        update = {
            k: (0.01 * rng.standard_normal(np.shape(v))).astype(np.float32)
            for k, v in global_state.items()
        }
        return LocalResult(update, 100, 10, {})


class TaskTrainer:
    """One org's local job, in-process: ``steps`` steps from the global model on its
    share of a bundled task, SGD (FedAvg) or the strategy's AdamW (DiLoCo's inner loop,
    whose state the org keeps across rounds)."""

    def __init__(self, task: Task, indices: np.ndarray, org: int, setup: FedRun) -> None:
        data = task.build_data()
        idx = torch.as_tensor(indices, dtype=torch.long)
        self.x, self.y = data.inputs[idx], data.targets[idx]
        self.task, self.org, self.setup = task, org, setup
        self.model = task.build_model(setup.seed)
        self.opt: torch.optim.Optimizer | None = None

    def _optimizer(self, options: Mapping[str, Any]) -> torch.optim.Optimizer:
        if self.opt is None:
            if options.get("optimizer", self.setup.optimizer) == "adamw":
                lr = float(options.get("lr", self.setup.lr))
                wd = float(options.get("weight_decay", 0.0))
                self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=wd)
            else:
                self.opt = torch.optim.SGD(self.model.parameters(), lr=self.setup.lr)
        return self.opt

    def train(
        self, global_state: Mapping[str, np.ndarray], round: int, options: Mapping[str, Any]
    ) -> LocalResult:
        load_state(self.model, dict(global_state))
        opt = self._optimizer(options)
        steps = int(options.get("local_steps", self.setup.local_steps))
        gen = torch.Generator().manual_seed(self.setup.seed * 1_000_003 + self.org * 10_007 + round)
        self.model.train()
        for _ in range(steps):
            batch = torch.randint(0, len(self.y), (self.setup.batch_size,), generator=gen)
            opt.zero_grad()
            self.task.loss(self.model(self.x[batch]), self.y[batch]).backward()  # type: ignore[no-untyped-call]
            opt.step()
        local = model_state(self.model)
        update = {k: local[k] - np.asarray(global_state[k], np.float32) for k in local}
        return LocalResult(update, len(self.y), steps, {})


# --------------------------------------------------------------------------- federation


@dataclass(frozen=True)
class FedRun:
    """One federated run: ``task`` (a bundled task, or ``synthetic:P`` for the wire rows),
    its compression and strategy, R rounds of H local steps."""

    task: str
    rounds: int
    local_steps: int
    compression: str = DENSE
    strategy: str = "fedavg"
    strategy_options: Mapping[str, Any] = field(default_factory=dict)
    optimizer: str = "sgd"
    lr: float = 0.1
    batch_size: int = 32
    seed: int = 0


@dataclass
class FedResult:
    """Per round: the model after it, each org's payload and ring bytes."""

    models: list[dict[str, np.ndarray]] = field(default_factory=list)
    sent: list[dict[str, int]] = field(default_factory=list)
    ring: list[dict[str, int]] = field(default_factory=list)

    def busiest(self, upto: int | None = None) -> int:
        """Bytes the busiest node sent over the first ``upto`` rounds (all by default)."""
        rounds = self.sent[:upto]
        return max(sum(r[o] for r in rounds) for o in rounds[0])


def _synthetic(params: int) -> dict[str, np.ndarray]:
    """A model of ``params`` parameters in 4 tensors (a 2-D one and three smaller)."""
    rows = params // 1000
    small = (params - rows * 990) // 3
    shapes = [(rows, 990), (small,), (small,), (params - rows * 990 - 2 * small,)]
    return {f"t{i}": np.zeros(s, dtype=np.float32) for i, s in enumerate(shapes)}


def _trainers(setup: FedRun) -> tuple[dict[str, np.ndarray], list[Any]]:
    if setup.task.startswith("synthetic:"):
        model = _synthetic(int(setup.task.partition(":")[2]))
        return model, [RandomTrainer(i) for i in range(N_ORGS)]
    task = load_task(setup.task)
    data = task.build_data()
    if data.labels is None:
        parts = iid_partition(len(data), N_ORGS, seed=setup.seed)
    else:
        parts = dirichlet_partition(data.labels, N_ORGS, ALPHA, seed=setup.seed, min_size=20)
    model = model_state(task.build_model(setup.seed))
    return model, [TaskTrainer(task, p, i, setup) for i, p in enumerate(parts)]


def _engine_config(setup: FedRun) -> EngineConfig:
    return EngineConfig(
        strategy=setup.strategy,
        strategy_options=dict(setup.strategy_options),
        weighting="uniform",
        ring_bits=32,
        clip=64.0,  # covers FedNova's tau and every delta / tau coordinate
        checkpoint_every=0,
        ready_timeout_s=60.0,
        model_hash_timeout_s=60.0,
    )


async def _run(setup: FedRun, state_dir: Path) -> FedResult:
    orgs = tuple(f"org{i}" for i in range(N_ORGS))
    network = InMemoryNetwork()
    ids = {
        o: OrgIdentity.generate(o, private_bytes=bytes([i + 1]) * 32) for i, o in enumerate(orgs)
    }
    keys = {o: i.public_key for o, i in ids.items()}
    endpoints = {o: Endpoint(ids[o], "bench", network.transport(o), lambda: keys) for o in orgs}
    # numbered as an org node numbers its rounds (each round's masks prepared after the last)
    config = RoundConfig(
        ready_timeout=60,
        stage_timeout=60,
        lookahead_rounds=2 * ATTEMPTS,
        attempts_per_round=ATTEMPTS,
    )
    rounds = {
        o: RoundEngine(e, lambda: orgs, secagg_sessions(*endpoint_signer(e), seed=7), config)
        for o, e in endpoints.items()
    }
    spec = {
        "trainer": "bench",
        "rounds": setup.rounds,
        "participants": list(orgs),
        "compression": setup.compression,
    }
    plan = RunPlan.from_spec(f"bench-{setup.task}-{setup.seed}", spec)
    model, trainers = _trainers(setup)
    result = FedResult()
    reports: dict[int, dict[str, RoundReport]] = {}
    engines: dict[str, RunEngine] = {}

    def on_round(report: RoundReport, org: str) -> None:
        reports.setdefault(report.round, {})[org] = report
        if org == orgs[0]:
            result.models.append({k: v.copy() for k, v in engines[org].state.model.items()})

    engines.update(
        {
            o: RunEngine(
                plan,
                _engine_config(setup),
                rounds=rounds[o],
                trainer=trainers[i],
                state_dir=state_dir / o,
                initial_model=model,
                rng=np.random.default_rng([setup.seed, i]),
                on_round=lambda report, o=o: on_round(report, o),  # type: ignore[misc]
            )
            for i, o in enumerate(orgs)
        }
    )
    for e in endpoints.values():
        await e.start()
    try:
        outcomes = await asyncio.gather(*(e.run() for e in engines.values()))
    finally:
        for e in endpoints.values():
            await e.close()
    if len({o.model_hash for o in outcomes}) != 1:
        raise RuntimeError("the nodes ended with different models")
    for r in sorted(reports):
        result.sent.append({o: rep.bytes_sent for o, rep in reports[r].items()})
        result.ring.append(
            {o: int(rep.metrics["ring_bytes_sent"]) for o, rep in reports[r].items()}
        )
    return result


def run_federation(setup: FedRun) -> FedResult:
    """Run ``setup`` to the end; every node's model hash must agree."""
    with tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(_run(setup, Path(tmp)))


# --------------------------------------------------------------------------- rows


def wire_rows(report: Report, params: int) -> None:
    bytes_per_param: dict[str, float] = {}
    notes: dict[str, str] = {}
    for compression in (DENSE, Q8, SPARSE_Q8):
        res = run_federation(FedRun(f"synthetic:{params}", 3, 1, compression=compression))
        ring = max(res.ring[-1].values())
        total = max(res.sent[-1].values())
        bytes_per_param[compression] = ring / params / RING_FACTOR
        notes[compression] = (
            f"{N_ORGS} orgs, {params} parameters in 4 tensors; last round's ring bytes of "
            f"the busiest node {ring} ÷ params ÷ {RING_FACTOR:g} (ring all-reduce); all "
            f"payload of that round {total / params / RING_FACTOR:.4f} B/param"
        )
    dense = bytes_per_param[DENSE]
    for compression, label, target in (
        (DENSE, "dense", None),
        (Q8, "q8", "<= 2.0"),
        (SPARSE_Q8, SPARSE_Q8, "<= 0.25"),
    ):
        report.add(
            f"wire_bytes_per_param[{label}]",
            bytes_per_param[compression],
            "B/param",
            None if compression == DENSE else dense,
            target=target,
            target_is_absolute=True,
            note=notes[compression]
            + ("; dense = the 32-bit ring (target 4.0)" if compression == DENSE else ""),
        )


def accuracies(setup: FedRun) -> tuple[float, float]:
    """Held-out accuracy of ``setup``'s model after round R / 2 and after round R."""
    torch.set_num_threads(1)
    models = run_federation(setup).models
    half, last = models[setup.rounds // 2 - 1], models[-1]
    return evaluate(setup.task, half)["accuracy"], evaluate(setup.task, last)["accuracy"]


def _in_parallel(setups: Sequence[FedRun]) -> list[tuple[float, float]]:
    """:func:`accuracies` of each setup, one process per core."""
    workers = max(1, min(len(setups), os.cpu_count() or 1))
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        return list(pool.map(accuracies, setups))


def accuracy_rows(report: Report, quick: bool) -> None:
    """Accuracy after R rounds, the mean over seeds (the module docstring says where
    the dense run stands at R); how much later a compressed run gets there is in the
    note (the accuracy at round R / 2) and, in bytes, in :func:`bytes_to_target_row`."""
    seeds = range(1 if quick else SEEDS)
    for task, rounds, steps, lr in (
        (("digits", 20, 10, 0.1), ("gpt", 10, 10, 0.5))
        if quick
        else (("digits", 60, 10, 0.1), ("gpt", 40, 10, 0.5))
    ):
        batch = 32 if task == "digits" else 16
        base = [FedRun(task, rounds, steps, lr=lr, batch_size=batch, seed=s) for s in seeds]
        kinds = (DENSE, Q8, SPARSE_Q8)
        done = _in_parallel([replace(b, compression=c) for c in kinds for b in base])
        runs = {c: done[i * len(base) : (i + 1) * len(base)] for i, c in enumerate(kinds)}
        dense_half, dense = np.mean(runs[DENSE], axis=0)
        for compression in (Q8, SPARSE_Q8):
            half, acc = np.mean(runs[compression], axis=0)
            ratios = [c[1] / d[1] for c, d in zip(runs[compression], runs[DENSE], strict=True)]
            report.add(
                f"acc_vs_dense[task={task},compression={compression}]",
                float(acc),
                "accuracy",
                float(dense),
                target=">= 0.98",
                note=(
                    f"{N_ORGS} orgs, FedAvg, R={rounds}, {steps} local SGD steps (lr {lr}); "
                    f"dense = the 32-bit ring; mean of {len(base)} seed(s), the seeds' "
                    f"ratios {min(ratios):.3f}-{max(ratios):.3f}; at round {rounds // 2}: "
                    f"{half:.3f} against dense {dense_half:.3f}"
                ),
            )


def bytes_to_target_row(report: Report, quick: bool) -> None:
    rounds, steps, lr = (6, 10, 1e-3) if quick else (12, 10, 1e-3)
    fedavg = FedRun("gpt", rounds, steps, optimizer="adamw", lr=lr, batch_size=16)
    dense = run_federation(fedavg)
    dense_losses = [evaluate("gpt", m)["loss"] for m in dense.models]
    target = dense_losses[-1]
    most, inner = 2 * rounds, DILOCO_INNER * steps
    diloco = FedRun(
        "gpt",
        most,
        inner,
        compression=SPARSE_Q8,
        strategy="diloco",
        strategy_options={
            "inner_steps": inner,
            "inner_lr": lr,
            "inner_weight_decay": 0.0,
            "outer_lr": OUTER_LR,
            "outer_momentum": OUTER_MOMENTUM,
        },
        batch_size=16,
    )
    res = run_federation(diloco)
    losses = [evaluate("gpt", m)["loss"] for m in res.models]
    reached = next((r + 1 for r, loss in enumerate(losses) if loss <= target), None)
    base = dense.busiest(rounds)
    spent = res.busiest(reached) if reached is not None else res.busiest()
    corpus_chars = len(CORPUS.read_text(encoding="utf-8"))
    report.add(
        f"bytes_to_target_vs_fedavg_dense[task=gpt,compression={SPARSE_Q8},strategy=diloco]",
        float(spent) if reached is not None else math.inf,
        "B",
        float(base),
        ratio=spent / base if reached is not None else math.inf,
        target="<= 0.05",
        note=(
            f"{N_ORGS} orgs, IID windows of the {corpus_chars:,}-character corpus; "
            f"FedAvg-dense (32-bit ring, {steps} local AdamW steps of lr {lr:g}, "
            f"R={rounds}: {rounds * steps} steps an org) ends at held-out loss "
            f"{target:.4f} (round {rounds // 2}: {dense_losses[rounds // 2 - 1]:.4f}); "
            f"DiLoCo ({inner} inner steps a round, outer lr {OUTER_LR}, momentum "
            f"{OUTER_MOMENTUM}) + {SPARSE_Q8} "
            + (
                f"reaches it in round {reached} ({reached * inner} steps an org)"
                if reached is not None
                else f"does not within {most} rounds (best {min(losses):.4f}; "
                f"{spent} B spent, {spent / base:.3f} of FedAvg-dense's)"
            )
            + f"; its loss after {most} rounds {losses[-1]:.4f}"
            + "; bytes: every payload the busiest node sent"
        ),
    )


def support_cost_row(report: Report, params: int, repeats: int = 3) -> None:
    """random-k's support at ``params`` coordinates (one AES-CTR phase per coordinate,
    a chunk at a time, and the window's test) against one pairwise mask of the same
    coordinates in the node's default 64-bit ring (a dense round expands one per
    neighbour): medians of ``repeats`` interleaved runs."""
    seed = run_seed("bench-support")
    support_s: list[float] = []
    mask_s: list[float] = []
    sent = 0
    for r in range(repeats):
        t0 = time.perf_counter()
        sent = len(support(seed, r, params, 0.1))
        support_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        vector = np.zeros(params, dtype=np.uint64)
        add_masks(vector, [(seed, 1)])
        mask_s.append(time.perf_counter() - t0)
        del vector
    label = f"{params / 1e6:g}M"
    report.add(
        f"support_vs_mask_expansion[params={label},compression=random-k=0.1]",
        statistics.median(support_s),
        "s",
        statistics.median(mask_s),
        note=(
            f"random-k's support of {params} coordinates at F = 0.1 ({sent} sent in the "
            f"last run) ÷ one pairwise mask of them in a 64-bit ring (a new vector, "
            f"expanded): medians of {repeats}, interleaved; support "
            f"{min(support_s):.3f}-{max(support_s):.3f} s, mask "
            f"{min(mask_s):.3f}-{max(mask_s):.3f} s"
        ),
    )


def body(report: Report) -> None:
    quick = report.quick
    support_cost_row(report, 10_000_000 if quick else 100_000_000)
    wire_rows(report, 200_000 if quick else 1_000_000)
    accuracy_rows(report, quick)
    bytes_to_target_row(report, quick)


def main(argv: Sequence[str] | None = None) -> Report:
    torch.set_num_threads(1)
    return run_main("compression", body, argv, description=__doc__ or "")


if __name__ == "__main__":
    main(sys.argv[1:])
