"""Apply the job's parallel layout to a task's model, one step at a time.

The order follows torchtitan's ``parallelize_*`` functions: cut the pipeline stage
first (so each rank holds only its stage), then tensor parallelism, then data
parallelism (FSDP2 shards the DTensor parameters TP made), then wrap the stage in a
pipeline schedule. Each ``apply_*`` takes a mesh and plain values, not the whole spec.

- :func:`apply_pipeline_cut`: ``PipelineModel.pipeline_stage``.
- :func:`apply_tp`: ``parallelize_module`` with the model's ``tensor_parallel_plan``.
- :func:`apply_fsdp`: ``fully_shard`` on each of the model's ``fsdp_units`` then the
  root, over the ``dp_shard`` axis or, with replicas too, the 2-D HSDP mesh
  ``("dp_replicate", "dp_shard")``; parameters stay gathered from forward to backward
  when :func:`reshard_after_forward` says so.
- :func:`apply_ddp`: ``DistributedDataParallel`` when replication is the only parallelism.
- :func:`build_schedule`: a ``PipelineStage`` on the ``pp`` axis and a 1F1B schedule.

No collective is written by hand: gradients move by FSDP2, DDP, DTensor and the pipeline
schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel

from org_node.tasks import PipelineModel, Task, TensorParallelModel
from org_node.training.errors import SpecError
from org_node.training.parallel import ParallelDims

__all__ = [
    "ParallelModel",
    "apply_ddp",
    "apply_fsdp",
    "apply_pipeline_cut",
    "apply_tp",
    "build_schedule",
    "check_supported",
    "parallelize",
    "reshard_after_forward",
]


@dataclass
class ParallelModel:
    """What a rank trains: its (stage of the) model and, with pp > 1, the schedule."""

    module: nn.Module
    schedule: PipelineScheduleSingle | None
    stage_index: int
    num_stages: int

    @property
    def is_first_stage(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == self.num_stages - 1


def check_supported(task: Task, model: nn.Module, dims: ParallelDims) -> None:
    """Raise SpecError naming ``tp`` or ``pp`` when the model cannot take that degree."""
    if dims.tp_enabled and not isinstance(model, TensorParallelModel):
        raise SpecError("tp", f"task {task.name!r}'s model does not support tensor parallelism")
    if dims.pp_enabled:
        if not isinstance(model, PipelineModel):
            raise SpecError(
                "pp", f"task {task.name!r}'s model does not support pipeline parallelism"
            )
        units = model.num_pipeline_units()
        if dims.pp > units:
            raise SpecError("pp", f"{dims.pp} stages exceed the model's {units} blocks")


def apply_pipeline_cut(model: nn.Module, stage_index: int, num_stages: int) -> nn.Module:
    """Keep only what stage ``stage_index`` runs."""
    assert isinstance(model, PipelineModel)
    return model.pipeline_stage(stage_index, num_stages)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split the model's layers over the ``tp`` axis (DTensor parameters)."""
    assert isinstance(model, TensorParallelModel)
    parallelize_module(model, tp_mesh, model.tensor_parallel_plan())


def reshard_after_forward(dims: ParallelDims) -> bool:
    """Whether FSDP2 frees each unit's gathered parameters after its forward.

    Freeing them (ZeRO-3) costs a second all-gather per unit in the backward, to save
    ``1 - 1/dp_shard`` of the parameter memory. Kept gathered (ZeRO-2) under
    pipelining, where every microbatch would re-gather (as torchtitan), and at
    ``dp_shard <= 2``, where the saving is at most half the parameters (a rank then holds
    no more than DDP's full replica would) and the second all-gather is pure cost.
    """
    return not dims.pp_enabled and dims.dp_shard > 2


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, *, reshard_after_forward: bool) -> None:
    """FSDP2: shard each unit the model names, then the root."""
    units: Callable[[], list[nn.Module]] | None = getattr(model, "fsdp_units", None)
    for unit in units() if units is not None else []:
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """Plain data parallelism: gradients all-reduced over the ``dp_replicate`` axis."""
    device_ids = [device.index] if device.type == "cuda" else None
    # Gradients live in the all-reduce buckets: no copy into and out of them.
    return DistributedDataParallel(
        model,
        device_ids=device_ids,
        process_group=dp_mesh.get_group(),
        gradient_as_bucket_view=True,
    )


def build_schedule(
    stage_module: nn.Module,
    pp_mesh: DeviceMesh,
    stage_index: int,
    num_stages: int,
    device: torch.device,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> PipelineScheduleSingle:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): after ``num_stages`` forwards, each
    stage alternates one forward and one backward.

    The bubble is GPipe's, ``(p - 1) / (m + p - 1)`` of a step, but a stage holds the
    activations of at most ``p`` microbatches instead of all ``m``. FSDP2 reduce-scatters
    a stage's gradients once per step, after its last microbatch's backward.

    Gradients are scaled by ``1 / microbatches``, so a mean loss per microbatch gives the
    gradient of the whole batch's mean loss.
    """
    stage = PipelineStage(stage_module, stage_index, num_stages, device, group=pp_mesh.get_group())
    return Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)


def parallelize(
    task: Task,
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    rank: int,
    device: torch.device,
    microbatches: int,
) -> ParallelModel:
    """The linear recipe: pipeline cut -> TP -> FSDP2/DDP -> pipeline schedule."""
    check_supported(task, model, dims)
    stage_index = dims.coordinates(rank)["pp"] if dims.world_size > 1 else 0
    if dims.pp_enabled:
        model = apply_pipeline_cut(model, stage_index, dims.pp)
    model.to(device)
    if mesh is None:
        return ParallelModel(model, None, 0, 1)
    if dims.tp_enabled:
        apply_tp(model, mesh["tp"])
    if dims.ddp_only:
        model = apply_ddp(model, mesh["dp_replicate"], device)
    elif dims.dp_enabled:
        if dims.dp_replicate_enabled and dims.dp_shard_enabled:
            dp_mesh = mesh["dp_replicate", "dp_shard"]
        elif dims.dp_shard_enabled:
            dp_mesh = mesh["dp_shard"]
        else:
            dp_mesh = mesh["dp_replicate"]
        apply_fsdp(model, dp_mesh, reshard_after_forward=reshard_after_forward(dims))
    schedule = None
    if dims.pp_enabled:
        schedule = build_schedule(
            model, mesh["pp"], stage_index, dims.pp, device, microbatches, task.loss
        )
    return ParallelModel(model, schedule, stage_index, dims.pp)
