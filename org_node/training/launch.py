"""Start the local job under torchrun, on this host or across several.

Single host (what :func:`launch_job` does for a spec of world size W > 1)::

    python -m torch.distributed.run --nnodes 1 --nproc-per-node W \\
        --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:<free port> --local-addr 127.0.0.1 \\
        -m org_node.training.job --run-dir RUN_DIR

Several hosts (an org's own cluster) use torchrun's c10d rendezvous: pick one host and
port everyone reaches (HEAD:29400), put the run directory on a shared file system, and
on each of the N hosts run::

    python -m org_node.training.launch --run-dir RUN_DIR --nnodes N \\
        --rdzv-endpoint HEAD:29400 --rdzv-id ROUND_ID

Each host starts ``world_size / N`` ranks; the spec's degrees must fill the whole world,
and with ``device="cuda"`` each host needs that many GPUs. Unless the environment
sets ``OMP_NUM_THREADS``, each rank gets an even share of the host's cores
(:func:`threads_per_rank`), the same for every layout, and PyTorch's CPU allocator
backs buffers of 2 MB and more with transparent huge pages (``THP_MEM_ALLOC_ENABLE=1``,
unless the environment sets it). Kubernetes' PyTorchJob and Slurm ``srun torchrun ...``
set the same flags. Rank 0 writes the result.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from org_node.passphrase import PASSPHRASE_ENV
from org_node.training import exchange
from org_node.training.errors import JobFailedError, SpecError
from org_node.training.spec import LocalJobSpec

__all__ = [
    "LaunchConfig",
    "child_env",
    "free_port",
    "launch_job",
    "main",
    "threads_per_rank",
    "torchrun_command",
]

_PROJECT_ROOT = Path(__file__).resolve().parents[2]

#: PyTorch's switch for transparent huge pages under its CPU allocations (>= 2 MB).
THP_ENV = "THP_MEM_ALLOC_ENABLE"


@dataclass(frozen=True)
class LaunchConfig:
    """Where the ranks come from.

    nnodes: hosts taking part; the world is split evenly over them.
    rdzv_endpoint: ``host:port`` of the rendezvous; None on one host (127.0.0.1 and a
        free port).
    rdzv_id: names the job at the rendezvous (use the run and round).
    timeout_s: kill the whole job after this long; None waits forever.
    """

    nnodes: int = 1
    rdzv_endpoint: str | None = None
    rdzv_id: str = "fedweave-local-job"
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise SpecError("nnodes", f"expected an integer >= 1, got {self.nnodes!r}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise SpecError("rdzv_endpoint", "required with more than one host")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise SpecError("timeout_s", f"expected a number > 0, got {self.timeout_s!r}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def torchrun_command(
    spec: LocalJobSpec,
    run_dir: Path,
    config: LaunchConfig,
    *,
    module: str = "org_node.training.job",
    args: list[str] | None = None,
) -> list[str]:
    """The torchrun command line that starts this host's share of the job: ``python -m
    module`` with ``args`` (by default ``--run-dir RUN_DIR``) on every rank."""
    per_node, rem = divmod(spec.world_size, config.nnodes)
    if rem:
        raise SpecError(
            "nnodes", f"world size {spec.world_size} does not split over {config.nnodes} hosts"
        )
    if spec.device == "cuda":
        import torch  # only to count this host's GPUs

        gpus = torch.cuda.device_count()
        if per_node > gpus:
            raise SpecError(
                "device",
                f"'cuda' with {per_node} ranks on this host needs {per_node} GPUs, found {gpus} "
                "(NCCL cannot put two ranks on one GPU)",
            )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(config.nnodes)]
    cmd += ["--nproc-per-node", str(per_node), "--rdzv-backend", "c10d"]
    if config.rdzv_endpoint is None:
        cmd += ["--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--local-addr", "127.0.0.1"]
    else:
        cmd += ["--rdzv-endpoint", config.rdzv_endpoint]
    cmd += ["--rdzv-id", config.rdzv_id, "--max-restarts", "0"]
    cmd += ["-m", module, *(args if args is not None else ["--run-dir", str(run_dir)])]
    return cmd


def threads_per_rank(ranks_on_host: int) -> int:
    """Intra-op threads for each of this host's ranks: its usable cores shared evenly.

    More threads than cores make the ranks' threads preempt one another (and spin in
    OpenMP barriers); one per rank is the floor, even when ranks outnumber cores.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, ranks_on_host))


def child_env(extra: dict[str, str] | None, ranks_on_host: int) -> dict[str, str]:
    """The environment of a local job's processes (threads per rank, huge pages); never
    the node's passphrase (:data:`~org_node.passphrase.PASSPHRASE_ENV`)."""
    env = dict(os.environ)
    env.pop(PASSPHRASE_ENV, None)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{_PROJECT_ROOT}{os.pathsep}{path}" if path else str(_PROJECT_ROOT)
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(ranks_on_host)))
    # PyTorch's CPU allocator backs buffers of 2 MB and more with transparent huge pages
    # (madvise): FSDP2 allocates its all-gather and reduce-scatter buffers and the unsharded
    # parameters and gradients afresh every step, and on 4 KB pages the kernel's page
    # faults on them cost as much CPU time as the collectives themselves.
    env.setdefault(THP_ENV, "1")
    env.update(extra or {})
    return env


def launch_job(
    spec: LocalJobSpec,
    run_dir: Path,
    config: LaunchConfig | None = None,
    *,
    env: dict[str, str] | None = None,
) -> None:
    """Run torchrun to completion; raise the job's own error, or JobFailedError.

    The job runs in its own process group, killed as a whole on timeout or interrupt.
    """
    config = config or LaunchConfig()
    cmd = torchrun_command(spec, run_dir, config)
    log = run_dir / "job.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env(env, spec.world_size // config.nnodes),
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=config.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise JobFailedError(f"the job ran past {config.timeout_s} s and was killed") from None
        except BaseException:
            _kill_group(proc)
            raise
    if code != 0:
        error = exchange.read_error(run_dir)
        if error is not None:
            raise error
        tail = log.read_text(errors="replace")[-2000:]
        raise JobFailedError(f"torchrun exited with {code}; last output:\n{tail}")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def main(argv: list[str] | None = None) -> int:
    """Start this host's ranks for the job already written to ``--run-dir``."""
    parser = argparse.ArgumentParser(
        prog="python -m org_node.training.launch", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--rdzv-endpoint", default=None, help="host:port, all hosts the same")
    parser.add_argument("--rdzv-id", default="fedweave-local-job")
    parser.add_argument("--timeout-s", type=float, default=None)
    args = parser.parse_args(argv)
    spec = exchange.read_spec(args.run_dir)
    config = LaunchConfig(args.nnodes, args.rdzv_endpoint, args.rdzv_id, args.timeout_s)
    launch_job(spec, args.run_dir, config)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
