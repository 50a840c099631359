"""Hybrid-parallel local training against plain DDP at the same world size.

Run ``python -m bench.training_hybrid [--quick] [--device cpu|cuda] [--json PATH]``.
Every configuration is a real local job of the char-level GPT task, started through
:func:`org_node.training.run_local_job` (torchrun with one process per rank), in two
regimes:

* ``gpt-d1024`` (``org_node.tasks.gpt:task_large``: 4 blocks, d_model 1024, 50.6M
  parameters; 8 sequences of 64 characters, 512 tokens per step): the regime tensor and
  pipeline parallelism are for, a wide model and a moderate number of tokens per step.
  DDP all-reduces ~50M gradients and runs AdamW on the whole model on every rank; a TP
  rank all-reduces 256 tokens x 1024 activations per block half and, with FSDP2 over
  dp, updates a quarter of the model. Target >= 0.9.
* ``gpt-d64`` (the bundled 0.2M-parameter model, 32 sequences of 32): reported, no
  target. Here a step is a few milliseconds of arithmetic and each hybrid collective
  (TP: 4 per block, FSDP2: 2 per block, pipeline sends) costs more than the work it
  splits, while DDP sends one all-reduce per step.

Rows, per regime: ``ddp_samples_per_s[W]`` (plain DDP, ``dp_replicate = W``, the
baseline) and ``hybrid_vs_ddp_throughput[dp=a,tp=b]`` / ``[dp=a,pp=b]`` (FSDP2 x tensor
parallel, FSDP2 x 1F1B pipeline: samples/s ÷ DDP's, same world size, same global batch,
same model). The three run interleaved, ``repeats`` times; each job's figure is its
median step after the first, and a configuration's figure is its best run (the one
least disturbed by other load), every run's ratio listed in the note. The note gives
the CPU seconds of all ranks per step, which do not depend on how busy the host is,
and the final losses; ``hybrid_loss_gap`` rows check the layouts trained the same
model (relative gap of the final loss to DDP's, target <= 1e-3).

Devices. ``--device cpu`` runs 4 gloo ranks, each with an even share of the cores
(``org_node.training.launch.threads_per_rank``). ``--device cuda`` runs one rank per
GPU: with 4 or more GPUs, the same rows on NCCL; with 2 or 3, tensor-parallel and
pipeline pairs against DDP on 2 GPUs. NCCL cannot put two ranks on one GPU, so on a
single-GPU machine the NCCL path is checked at world size 1
(``nccl_single_rank_samples_per_s``, torchrun + NCCL ÷ in-process, the cost of the
launch path) and the hybrid-vs-DDP rows come from 4 gloo ranks on the CPU, as the notes
of each row say.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import Report, run_main
from org_node.tasks import initial_state
from org_node.training import LaunchConfig, LocalResult, run_local_job

__all__ = ["main"]

TARGET = ">= 0.9"
LOSS_GAP_TARGET = "<= 0.001"


def _job(task: str, device: str, steps: int, batch: int, **degrees: int) -> dict[str, Any]:
    return {
        "task": task,
        "local_steps": steps,
        "batch_size": batch,
        "lr": 1e-3,
        "optimizer": "adamw",
        "device": device,
        "evaluate": False,
        **degrees,
    }


def _run(
    spec: dict[str, Any], global_state: dict[str, np.ndarray], *, force_torchrun: bool = True
) -> LocalResult:
    with tempfile.TemporaryDirectory(prefix="fedweave-bench-") as tmp:
        return run_local_job(
            spec,
            global_state,
            Path(tmp),
            launch=LaunchConfig(timeout_s=600),
            force_torchrun=force_torchrun,
        )


def _layouts(world: int) -> list[tuple[str, dict[str, int]]]:
    """DDP first (the baseline), then the hybrid layouts, at this world size."""
    if world >= 4:
        dp = world // 2
        hybrid = [
            (f"dp={dp},tp=2", {"dp_shard": dp, "tp": 2}),
            (f"dp={dp},pp=2", {"dp_shard": dp, "pp": 2}),
        ]
    else:
        hybrid = [("dp=1,tp=2", {"tp": 2}), ("dp=1,pp=2", {"pp": 2})]
    return [("ddp", {"dp_replicate": world}), *hybrid]


@dataclass(frozen=True)
class _Regime:
    """One model size: the task, its label, steps and global batch per job, repeats."""

    task: str
    label: str
    steps: int
    batch: int
    repeats: int
    target: bool
    shape: str


LARGE = "4 blocks, d_model 1024, 50.6M params, 8 x 64 = 512 tokens/step"
SMALL = "4 blocks, d_model 64, 0.2M params, 32 x 32 = 1024 tokens/step"


def _regimes(quick: bool) -> list[_Regime]:
    large = "org_node.tasks.gpt:task_large"
    if quick:
        return [
            _Regime(large, "gpt-d1024", 4, 8, 1, True, LARGE),
            _Regime("gpt", "gpt-d64", 6, 32, 1, False, SMALL),
        ]
    return [
        _Regime(large, "gpt-d1024", 8, 8, 3, True, LARGE),
        _Regime("gpt", "gpt-d64", 10, 32, 3, False, SMALL),
    ]


def _compare(report: Report, regime: _Regime, device: str, world: int, note: str) -> None:
    g = initial_state(regime.task)
    layouts = _layouts(world)
    runs: dict[str, list[LocalResult]] = {label: [] for label, _ in layouts}
    for rep in range(regime.repeats):
        # interleaved, the order rotated, so slow spells of the host hit every layout
        shift = rep % len(layouts)
        for label, degrees in layouts[shift:] + layouts[:shift]:
            spec = _job(regime.task, device, regime.steps, regime.batch, **degrees)
            runs[label].append(_run(spec, g))

    def best(label: str) -> float:
        return max(r.metrics["samples_per_s_median"] for r in runs[label])

    def cpu(label: str) -> float:
        return statistics.median(r.metrics["cpu_s_per_step"] for r in runs[label])

    ddp_loss = runs["ddp"][0].losses[-1]
    base = best("ddp")
    tag = f"{device},{regime.label}"
    setting = f"{note}; {regime.shape}; best of {regime.repeats}"
    report.add(
        f"ddp_samples_per_s[{tag},W={world}]",
        base,
        "samples/s",
        note=f"{setting}; {cpu('ddp'):.3g} CPU s/step (all ranks)",
    )
    for label, _ in layouts[1:]:
        each = ", ".join(
            f"{h.metrics['samples_per_s_median'] / d.metrics['samples_per_s_median']:.2f}"
            for h, d in zip(runs[label], runs["ddp"], strict=True)
        )
        loss = runs[label][0].losses[-1]
        report.add(
            f"hybrid_vs_ddp_throughput[{tag},{label}]",
            best(label),
            "samples/s",
            base,
            target=TARGET if regime.target else None,
            note=(
                f"{setting}; each run's ratio {each}; CPU s/step {cpu(label):.3g} vs DDP "
                f"{cpu('ddp'):.3g}; loss {loss:.4f} vs DDP {ddp_loss:.4f}"
            ),
        )
        report.add(
            f"hybrid_loss_gap[{tag},{label}]",
            abs(loss - ddp_loss) / abs(ddp_loss),
            "rel",
            target=LOSS_GAP_TARGET,
            note=f"final loss after {regime.steps} steps, {label} vs DDP",
        )


def _body(report: Report, device: str) -> None:
    regimes = _regimes(report.quick)
    if device == "cpu":
        for regime in regimes:
            _compare(report, regime, "cpu", 4, "gloo, 4 CPU ranks")
        return
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    gpus = torch.cuda.device_count()
    if gpus >= 2:
        world = 4 if gpus >= 4 else 2
        for regime in regimes:
            _compare(report, regime, "cuda", world, f"NCCL, {world} GPUs")
        return
    size = regimes[0]
    g = initial_state(size.task)
    spec = _job(size.task, "cuda", size.steps * 4, size.batch)
    _run(spec, g, force_torchrun=False)  # warm the GPU (clocks, kernels) before timing
    local = _run(spec, g, force_torchrun=False)
    nccl = _run(spec, g, force_torchrun=True)
    report.add(
        f"nccl_single_rank_samples_per_s[cuda,{size.label},W=1]",
        nccl.metrics["samples_per_s_median"],
        "samples/s",
        local.metrics["samples_per_s_median"],
        note="one GPU: torchrun + NCCL process group vs in-process; NCCL cannot share a GPU",
    )
    for regime in regimes:
        _compare(report, regime, "cpu", 4, "single-GPU host: hybrid vs DDP on 4 gloo CPU ranks")


def main(argv: Sequence[str] | None = None) -> Report:
    """Parse ``--device`` here and leave ``--quick``/``--json`` to ``run_main``."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    return run_main(
        "training_hybrid",
        lambda report: _body(report, args.device),
        rest,
        description=__doc__.splitlines()[0] + " (also: --device cpu|cuda)",
    )


if __name__ == "__main__":
    main()
