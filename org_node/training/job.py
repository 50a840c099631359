"""The local training job: one process per rank, started by torchrun (or in-process).

Single host, 4 ranks (what the node's ``launch.launch_job`` runs)::

    torchrun --nnodes 1 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 -m org_node.training.job --run-dir RUN_DIR

Several hosts: run ``python -m org_node.training.launch --run-dir RUN_DIR --nnodes 2
--node-rank I --rdzv-endpoint HEAD:29400`` on every host (see ``launch.py``); the run
directory must be on a file system all hosts share. Without torchrun's environment
(``RANK``/``WORLD_SIZE``) the job runs as a single process, world size 1.

What a rank does, top to bottom:

1. read the spec and the global weights from the run directory (``exchange.py``);
2. check the degrees against the world size (``ParallelDims``), build the task's model,
   check its shapes against the global model and load it;
3. init the process group (gloo on CPU, NCCL with ``device="cuda"``, one GPU per local
   rank), build the DeviceMesh, parallelize (``parallelize.py``);
4. resume from the newest DCP checkpoint of this spec and global model, if any;
5. train: each step draws the global batch from ``(seed, step)`` alone, so every rank
   (and a resumed job) agrees on it, and each data-parallel rank takes its slice;
6. gather the full state (``get_model_state_dict(full_state_dict=True)``, per pipeline
   stage, merged by rank 0), and rank 0 writes ``new - global`` after refusing NaN/Inf.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from org_node.tasks import Task, TaskError, evaluate, load_state, load_task
from org_node.tasks.partition import partition_indices
from org_node.training import exchange
from org_node.training.checkpoint import JobCheckpointer, TrainerState, fingerprint
from org_node.training.errors import SpecError, TrainingError
from org_node.training.exchange import LocalResult
from org_node.training.parallel import ParallelDims
from org_node.training.parallelize import ParallelModel, parallelize
from org_node.training.spec import LocalJobSpec

__all__ = [
    "FAULT_KILL_AT_STEP_ENV",
    "DistEnv",
    "batch_indices",
    "execute",
    "main",
    "train",
    "train_round",
]

#: Fault injection for tests: rank 0 kills itself (SIGKILL) right after this step's
#: checkpoint, as a crashed host would.
FAULT_KILL_AT_STEP_ENV = "FEDWEAVE_FAULT_KILL_AT_STEP"

_EXIT_REFUSED = 2


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, from torchrun's environment variables."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    distributed: bool = False

    @classmethod
    def from_environ(cls) -> DistEnv:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return cls()
        return cls(
            rank=int(os.environ["RANK"]),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=int(os.environ["WORLD_SIZE"]),
            distributed=True,
        )


def batch_indices(seed: int, step: int, num_examples: int, batch_size: int) -> torch.Tensor:
    """The global batch of ``step``: a pure function of ``(seed, step)``.

    Without replacement inside a batch when the data suffices, with replacement otherwise.
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    if batch_size <= num_examples:
        return torch.randperm(num_examples, generator=gen)[:batch_size]
    return torch.randint(num_examples, (batch_size,), generator=gen)


def _device(spec: LocalJobSpec, env: DistEnv) -> torch.device:
    if spec.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SpecError("device", "'cuda' asked for, but torch sees no CUDA device")
    if env.local_rank >= torch.cuda.device_count():
        raise SpecError(
            "device",
            f"local rank {env.local_rank} has no GPU of its own "
            f"({torch.cuda.device_count()} visible); NCCL needs one GPU per rank",
        )
    device = torch.device("cuda", env.local_rank)
    torch.cuda.set_device(device)
    return device


def _optimizer(spec: LocalJobSpec, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if spec.optimizer == "sgd":
        return torch.optim.SGD(
            params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay
        )
    # The fused kernel updates each tensor in one pass (CPU and CUDA, plain and DTensor
    # parameters alike), where the default loops over several elementwise ops.
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, fused=True)


def _forward_backward(
    pm: ParallelModel, task: Task, x: torch.Tensor, y: torch.Tensor
) -> float | None:
    """One step's forward and backward; the loss where this rank sees it, else None."""
    if pm.schedule is None:
        loss = task.loss(pm.module(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        return float(loss.detach())
    losses: list[torch.Tensor] = []
    if pm.is_first_stage:
        pm.schedule.step(x, target=y if pm.is_last_stage else None, losses=losses)
    elif pm.is_last_stage:
        pm.schedule.step(target=y, losses=losses)
    else:
        pm.schedule.step()
    return float(torch.stack(losses).mean()) if pm.is_last_stage else None


def _agree(
    loss: float | None, over_budget: bool, device: torch.device, distributed: bool
) -> tuple[float, bool]:
    """Mean loss over the ranks that see one, and whether any rank is out of time."""
    vec = torch.tensor(
        [loss or 0.0, 0.0 if loss is None else 1.0, 1.0 if over_budget else 0.0],
        dtype=torch.float64,
        device=device,
    )
    if distributed:
        dist.all_reduce(vec)
    return float(vec[0] / vec[1]), bool(vec[2] > 0)


def _sum_over_ranks(value: float, device: torch.device, env: DistEnv) -> float:
    """``value`` summed over all ranks; collective."""
    if not env.distributed:
        return value
    vec = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(vec)
    return float(vec[0])


def _full_state(
    pm: ParallelModel, dims: ParallelDims, env: DistEnv, run_dir: Path
) -> dict[str, np.ndarray] | None:
    """The trained model's full state on rank 0 (None elsewhere); collective."""
    sd = get_model_state_dict(pm.module, options=StateDictOptions(full_state_dict=True))
    stage = {
        k: v.detach().to("cpu", torch.float32).numpy().copy()
        for k, v in sd.items()
        if isinstance(v, torch.Tensor)
    }
    if not dims.pp_enabled:
        return stage if env.rank == 0 else None
    coords = dims.coordinates(env.rank)
    if coords["dp_replicate"] == coords["dp_shard"] == coords["tp"] == 0:
        part = run_dir / f".stage-{pm.stage_index}.npz"
        exchange.atomic_write(part, exchange.npz_bytes(stage))
    dist.barrier()
    if env.rank != 0:
        return None
    merged: dict[str, np.ndarray] = {}
    for index in range(dims.pp):
        part = run_dir / f".stage-{index}.npz"
        merged.update(exchange.load_arrays(part))
        part.unlink()
    return merged


def train(
    spec: LocalJobSpec, global_state: dict[str, np.ndarray], run_dir: Path, env: DistEnv
) -> None:
    """Run the job on this rank; rank 0 writes the result (or raises before writing)."""
    result = train_round(spec, global_state, run_dir, env)
    if result is not None:
        exchange.write_result(
            run_dir,
            result.update,
            result.num_examples,
            result.steps,
            result.metrics,
            result.losses,
        )


def _partition(task: Task, spec: LocalJobSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets of this org's share of the task's training data."""
    data = task.build_data()
    part = torch.as_tensor(
        partition_indices(
            len(data),
            data.labels,
            spec.num_partitions,
            spec.partition_index,
            spec.dirichlet_alpha,
            seed=spec.partition_seed,
        )
    )
    return data.inputs[part], data.targets[part]


@dataclass
class _Rank:
    """What this rank trains with: its device, (stage of the) model, optimizer, FedProx
    anchors, progress and checkpointer."""

    device: torch.device
    pm: ParallelModel
    optimizer: torch.optim.Optimizer
    anchors: list[tuple[torch.nn.Parameter, torch.Tensor]]
    trainer: TrainerState
    ckpt: JobCheckpointer


def _set_up(
    spec: LocalJobSpec,
    task: Task,
    model: torch.nn.Module,
    dims: ParallelDims,
    env: DistEnv,
    checkpoints: Path,
) -> _Rank:
    """Init the process group (once), build the mesh, parallelize the model and make its
    optimizer and checkpointer (checkpoints under ``checkpoints``)."""
    device = _device(spec, env)
    mesh = None
    if env.distributed:
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        mesh = dims.build_mesh(device.type)
    pm = parallelize(task, model, dims, mesh, env.rank, device, spec.num_microbatches)
    optimizer = _optimizer(spec, pm.module)
    anchors = [(p, p.detach().clone()) for p in pm.module.parameters()] if spec.prox_mu > 0 else []
    trainer = TrainerState()
    ckpt = JobCheckpointer(checkpoints, pm.module, optimizer, trainer, every=spec.checkpoint_every)
    return _Rank(device, pm, optimizer, anchors, trainer, ckpt)


@dataclass
class _Clock:
    """The training loop's timing. The first step pays for lazy initialization, so the
    throughput counts the steps after it (``warm``: when it ended)."""

    start: int
    begin: float = field(default_factory=time.monotonic)
    warm: float | None = None
    warm_step: int = 0
    cpu_warm: float = 0.0
    prev: float = 0.0
    end: float = 0.0
    step_times: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.warm_step = self.start
        self.prev = self.begin

    def over(self, budget_s: float | None) -> bool:
        return budget_s is not None and time.monotonic() - self.begin >= budget_s

    def step_done(self, step: int) -> None:
        now = time.monotonic()
        if self.warm is None:
            self.warm, self.warm_step, self.cpu_warm = now, step, time.process_time()
        else:  # _agree is collective, so every rank ends the step at about the same time
            self.step_times.append(now - self.prev)
        self.prev = now

    def cpu_s(self) -> float:
        """CPU seconds of this process since the first step."""
        return time.process_time() - self.cpu_warm if self.warm is not None else 0.0


def _step(
    spec: LocalJobSpec, task: Task, rank: _Rank, x: torch.Tensor, y: torch.Tensor
) -> float | None:
    """One optimizer step (with FedProx's pull to the global model); the loss where this
    rank sees it."""
    loss = _forward_backward(rank.pm, task, x.to(rank.device), y.to(rank.device))
    if rank.anchors:
        with torch.no_grad():
            for p, anchor in rank.anchors:
                if p.grad is not None:
                    p.grad.add_(p.detach() - anchor, alpha=spec.prox_mu)
    rank.optimizer.step()
    rank.optimizer.zero_grad(set_to_none=True)
    return loss


def _train_steps(
    spec: LocalJobSpec,
    task: Task,
    rank: _Rank,
    data: tuple[torch.Tensor, torch.Tensor],
    dims: ParallelDims,
    env: DistEnv,
    clock: _Clock,
) -> int:
    """Train until the step count or the time budget is reached; the steps done."""
    xs, ys = data
    per_rank = spec.batch_size // dims.dp
    dp_rank = dims.dp_rank(env.rank) if env.distributed else 0
    fault_step = os.environ.get(FAULT_KILL_AT_STEP_ENV)
    step = clock.start
    while spec.local_steps is None or step < spec.local_steps:
        sel = batch_indices(spec.seed, step, len(xs), spec.batch_size)
        sel = sel[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        loss = _step(spec, task, rank, xs[sel], ys[sel])
        step += 1
        over = clock.over(spec.time_budget_s)
        mean_loss, stop = _agree(loss, over, rank.device, env.distributed)
        rank.trainer.losses.append(mean_loss)
        clock.step_done(step)
        if rank.ckpt.due(step):
            rank.ckpt.save(step)
        if fault_step is not None and env.rank == 0 and int(fault_step) == step:
            os.kill(os.getpid(), signal.SIGKILL)
        if stop:
            break
    clock.end = time.monotonic()
    return step


def _throughput(spec: LocalJobSpec, clock: _Clock, step: int) -> float:
    """Samples per second over the steps after the first (over all of them when only
    the first ran)."""
    timed_steps = step - clock.warm_step
    if clock.warm is not None and timed_steps > 0 and clock.end > clock.warm:
        return timed_steps * spec.batch_size / (clock.end - clock.warm)
    return (step - clock.start) * spec.batch_size / max(clock.end - clock.begin, 1e-9)


def _metrics(
    spec: LocalJobSpec,
    clock: _Clock,
    step: int,
    cpu_s: float,
    losses: list[float],
    partition_size: int,
    env: DistEnv,
) -> dict[str, float]:
    """The job's training metrics: last loss, throughput, CPU per step, and where from."""
    timed_steps = step - clock.warm_step
    samples_per_s = _throughput(spec, clock, step)
    return {
        "train_loss": losses[-1] if losses else float("nan"),
        "samples_per_s": samples_per_s,
        # the median step: robust to a few steps slowed by other load on the host
        "samples_per_s_median": (
            spec.batch_size / float(np.median(clock.step_times))
            if clock.step_times
            else samples_per_s
        ),
        "cpu_s_per_step": cpu_s / timed_steps if timed_steps > 0 else float("nan"),
        "partition_size": float(partition_size),
        "resumed_from_step": float(clock.start),
        "world_size": float(env.world_size),
    }


def train_round(
    spec: LocalJobSpec,
    global_state: dict[str, np.ndarray],
    run_dir: Path,
    env: DistEnv,
    *,
    task: Task | None = None,
) -> LocalResult | None:
    """Train one job from ``global_state`` on this rank; the result on rank 0, else None.

    ``task``: the task object (the local worker builds it with its context); by default
    ``load_task(spec.task)``. Collective over the job's ranks; the process group is
    initialised once and kept (a persistent worker trains many rounds in it).
    """
    task = task if task is not None else load_task(spec.task)
    dims = ParallelDims(spec.dp_replicate, spec.dp_shard, spec.tp, spec.pp, env.world_size)
    model = task.build_model(spec.seed)
    exchange.check_shapes(global_state, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    load_state(model, global_state)
    data = _partition(task, spec)
    checkpoints = run_dir / "checkpoints" / fingerprint(spec, global_state)
    rank = _set_up(spec, task, model, dims, env, checkpoints)
    clock = _Clock(start=rank.ckpt.load_latest())
    step = _train_steps(spec, task, rank, data, dims, env, clock)
    cpu_s = _sum_over_ranks(clock.cpu_s(), rank.device, env)

    run_dir.mkdir(exist_ok=True)  # never its parents (see exchange.atomic_write)
    new_state = _full_state(rank.pm, dims, env, run_dir)
    if new_state is None:
        return None
    update = {k: new_state[k] - global_state[k] for k in global_state}
    exchange.check_finite(update)
    losses = rank.trainer.losses
    metrics = _metrics(spec, clock, step, cpu_s, losses, len(data[0]), env)
    if spec.evaluate:
        metrics.update({f"eval_{k}": v for k, v in evaluate(task, new_state).items()})
    return LocalResult(update, step * spec.batch_size, step, metrics, list(losses))


def execute(run_dir: Path, env: DistEnv | None = None) -> int:
    """Run the job described in ``run_dir``; 0 on success, 2 when refused (error.json)."""
    env = env or DistEnv.from_environ()
    try:
        spec = exchange.read_spec(run_dir)
        global_state = exchange.read_global(run_dir)
        if env.world_size != spec.world_size:
            raise SpecError(
                "world_size",
                f"the spec's degrees need {spec.world_size} ranks, torchrun started "
                f"{env.world_size}",
            )
        train(spec, global_state, run_dir, env)
        return 0
    except (TrainingError, TaskError) as exc:
        if env.rank == 0:
            exchange.write_error(
                run_dir, exc if isinstance(exc, TrainingError) else SpecError("task", str(exc))
            )
        print(f"rank {env.rank}: {exc}", file=sys.stderr)
        return _EXIT_REFUSED
    finally:
        if env.distributed and dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m org_node.training.job", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--run-dir", type=Path, required=True, help="the run directory")
    args = parser.parse_args(argv)
    return execute(args.run_dir)


if __name__ == "__main__":
    raise SystemExit(main())
