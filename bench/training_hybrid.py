"""Hybrid-parallel local training against plain DDP at the same world size.

Run ``python -m bench.training_hybrid [--quick] [--device cpu|cuda] [--json PATH]``.
Every configuration is a real local job of the char-level GPT task (``--quick``: the
bundled d_model 64 model, 6 steps of 32 sequences; otherwise the d_model 256 variant
``org_node.tasks.gpt:task_wide``, 10 steps of 64), started through
:func:`org_node.training.run_local_job` (torchrun with one process per rank); the
samples/s figure is the job's own, timed after its first step. Rows:

* ``ddp_samples_per_s[W]``: plain DDP, ``dp_replicate = W`` (the baseline).
* ``hybrid_vs_ddp_throughput[dp=a,tp=b]`` and ``[dp=a,pp=b]``: samples/s of FSDP2 x
  tensor parallel and FSDP2 x pipeline ÷ DDP's, same world size, same global batch.
  Target >= 0.9.

Devices. ``--device cpu`` runs 4 gloo ranks. ``--device cuda`` runs one rank per GPU:
with 4 or more GPUs, the same rows on NCCL; with 2 or 3, tensor-parallel and pipeline
pairs against DDP on 2 GPUs. NCCL cannot put two ranks on one GPU, so on a single-GPU
machine the NCCL path is checked at world size 1 (``nccl_single_rank_samples_per_s``,
torchrun + NCCL ÷ in-process, the cost of the launch path) and the hybrid-vs-DDP rows
come from 4 gloo ranks on the CPU, as the notes of each row say. On a small CPU box the
ranks share few cores, so the ratios measure communication overhead under contention
more than scaling.
"""

from __future__ import annotations

import argparse
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
            launch=LaunchConfig(timeout_s=170),
            force_torchrun=force_torchrun,
        )


def _layouts(world: int) -> list[tuple[str, dict[str, int]]]:
    """The hybrid layouts compared with DDP at this world size."""
    if world >= 4:
        dp = world // 2
        return [
            (f"dp={dp},tp=2", {"dp_shard": dp, "tp": 2}),
            (f"dp={dp},pp=2", {"dp_shard": dp, "pp": 2}),
        ]
    return [("dp=1,tp=2", {"tp": 2}), ("dp=1,pp=2", {"pp": 2})]


@dataclass(frozen=True)
class _Size:
    task: str
    label: str
    steps: int
    batch: int


def _compare(report: Report, size: _Size, device: str, world: int, note: str) -> None:
    g = initial_state(size.task)
    ddp = _run(_job(size.task, device, size.steps, size.batch, dp_replicate=world), g)
    base = ddp.metrics["samples_per_s"]
    tag = f"{device},{size.label}"
    report.add(f"ddp_samples_per_s[{tag},W={world}]", base, "samples/s", note=note)
    for label, degrees in _layouts(world):
        result = _run(_job(size.task, device, size.steps, size.batch, **degrees), g)
        report.add(
            f"hybrid_vs_ddp_throughput[{tag},{label}]",
            result.metrics["samples_per_s"],
            "samples/s",
            base,
            target=TARGET,
            note=f"{note}; loss {result.losses[-1]:.3f} vs DDP {ddp.losses[-1]:.3f}",
        )


def _body(report: Report, device: str) -> None:
    size = (
        _Size("gpt", "gpt-d64", 6, 32)
        if report.quick
        else _Size("org_node.tasks.gpt:task_wide", "gpt-d256", 10, 64)
    )
    if device == "cpu":
        _compare(report, size, "cpu", 4, "gloo, 4 CPU ranks")
        return
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    gpus = torch.cuda.device_count()
    if gpus >= 2:
        world = 4 if gpus >= 4 else 2
        _compare(report, size, "cuda", world, f"NCCL, {world} GPUs")
        return
    g = initial_state(size.task)
    spec = _job(size.task, "cuda", size.steps * 4, size.batch)
    _run(spec, g, force_torchrun=False)  # warm the GPU (clocks, kernels) before timing
    local = _run(spec, g, force_torchrun=False)
    nccl = _run(spec, g, force_torchrun=True)
    report.add(
        f"nccl_single_rank_samples_per_s[cuda,{size.label},W=1]",
        nccl.metrics["samples_per_s"],
        "samples/s",
        local.metrics["samples_per_s"],
        note="one GPU: torchrun + NCCL process group vs in-process; NCCL cannot share a GPU",
    )
    _compare(report, size, "cpu", 4, "single-GPU host: hybrid vs DDP on 4 gloo CPU ranks")


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
