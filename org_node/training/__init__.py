"""The org's local training job with hybrid parallelism.

The node calls one function::

    result = run_local_job(spec, global_state, run_dir)

``spec`` is a :class:`LocalJobSpec` (or a dict of its fields), ``global_state`` the
global model as ``{name: float32 array}`` (or the path of an ``.npz``), ``run_dir`` a
directory the job may use. World size 1 trains in this process; a larger world size
starts ``torchrun`` (``launch.py``) with one process per rank, on one DeviceMesh of
``pp x dp_replicate x dp_shard x tp`` (``parallel.py``): FSDP2 for data parallelism,
DTensor for tensor parallelism, ``torch.distributed.pipelining`` for pipelines (gloo on
CPU, NCCL on GPU). The job hands back a :class:`LocalResult`: ``update = new - global``
(float32, never NaN/Inf), the examples processed, the steps and metrics.

Bad input is refused before any process starts, with an error naming the field: a
spec with unknown keys or inconsistent degrees (:class:`SpecError`), an unknown task,
a global model whose names or shapes disagree with the task's model
(:class:`ShapeMismatchError`), NaN/Inf in the global model or the update
(:class:`NonFiniteUpdateError`).

It imports torch and the bundled tasks (:mod:`org_node.tasks`) only when a job is checked
or run, so that reading a node's config (which checks the training settings against
:class:`LocalJobSpec`) stays light; for its spec's checks it imports
:mod:`coordinator_free.validate`; never the node, the run engine or ``api``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from org_node.training import exchange
from org_node.training.errors import (
    JobFailedError,
    NonFiniteUpdateError,
    ShapeMismatchError,
    SpecError,
    TrainingError,
)
from org_node.training.exchange import LocalResult
from org_node.training.launch import LaunchConfig, launch_job
from org_node.training.parallel import ParallelDims
from org_node.training.spec import LocalJobSpec, TrainSpec

__all__ = [
    "JobFailedError",
    "LaunchConfig",
    "LocalJobSpec",
    "LocalResult",
    "NonFiniteUpdateError",
    "ParallelDims",
    "ShapeMismatchError",
    "SpecError",
    "TrainSpec",
    "TrainingError",
    "run_local_job",
    "validate_job",
]


def validate_job(spec: LocalJobSpec, global_state: dict[str, np.ndarray]) -> None:
    """Everything that can be checked without starting a rank; raises naming the field."""
    from org_node.tasks import TaskError, load_task  # torch: imported when a job is checked
    from org_node.training.parallelize import check_supported

    try:
        task = load_task(spec.task)
    except TaskError as exc:
        raise SpecError("task", str(exc).removeprefix("task: ")) from exc
    model = task.build_model(spec.seed)
    exchange.check_shapes(global_state, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    exchange.check_finite(global_state, "global model")
    dims = ParallelDims(spec.dp_replicate, spec.dp_shard, spec.tp, spec.pp, spec.world_size)
    check_supported(task, model, dims)


def run_local_job(
    spec: LocalJobSpec | dict[str, Any],
    global_state: dict[str, np.ndarray] | str | Path,
    run_dir: str | Path,
    *,
    launch: LaunchConfig | None = None,
    force_torchrun: bool = False,
    env: dict[str, str] | None = None,
) -> LocalResult:
    """Train locally from the global model and return the update.

    launch: how torchrun places the ranks (several hosts: ``nnodes``/``rdzv_endpoint``).
    force_torchrun: use torchrun even for world size 1 (e.g. to exercise NCCL).
    env: extra environment variables for the job's processes.
    """
    spec = LocalJobSpec.coerce(spec)
    run_dir = Path(run_dir)
    state = (
        exchange.load_arrays(global_state)
        if isinstance(global_state, str | Path)
        else {k: np.asarray(v, dtype=np.float32) for k, v in global_state.items()}
    )
    validate_job(spec, state)
    exchange.write_inputs(run_dir, spec, state)
    if spec.world_size == 1 and not force_torchrun and (launch is None or launch.nnodes == 1):
        from org_node.training.job import DistEnv, execute

        execute(run_dir, DistEnv())
    else:
        launch_job(spec, run_dir, launch, env=env)
    return exchange.read_result(run_dir)
