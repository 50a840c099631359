"""The local trainer of a run at this node: a worker process of its own, started with the
run's spec, this org's Flower ``node_config`` (its partition and bound dataset) and the
job's torchrun layout (the node never imports the trainer)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from org_node.consent import RunBinding
from org_node.engine import LocalTrainer, RunPlan
from org_node.node.context import NodeContext
from org_node.policy import RunSpec
from org_node.trainers.base import WorkerSpec
from org_node.trainers.local import WorkerLaunch, WorkerTrainer
from org_node.training.spec import LocalJobSpec

__all__ = ["node_config", "worker_trainer"]


def node_config(ctx: NodeContext, binding: RunBinding) -> dict[str, Any]:
    """This org's Flower ``node_config``: its partition (demos) and bound dataset."""
    training = ctx.config.training
    out: dict[str, Any] = {}
    if training.num_partitions > 1:
        out |= {
            "partition-id": training.partition_index,
            "num-partitions": training.num_partitions,
        }
    d = binding.dataset
    if d is not None:
        out |= {
            "dataset-name": d.name,
            "dataset-path": d.path,
            "dataset-kind": d.kind,
            "dataset-rows": d.rows,
            "dataset-sha256": d.sha256,
            "dataset-columns": json.dumps(dict(d.columns), sort_keys=True),
        }
    return out | dict(training.node_config)


def worker_trainer(
    ctx: NodeContext, plan: RunPlan, work_dir: Path, binding: RunBinding
) -> LocalTrainer:
    """The run's trainer, in a worker process of its own (never in this one)."""
    training = ctx.config.training
    spec = RunSpec.from_dict(plan.spec)
    trainer = binding.trainer.reference
    job = training.job_fields()
    worker = WorkerSpec(
        session="",
        node_pid=os.getpid(),
        org_id=ctx.me,
        run_key=plan.run_key,
        trainer=trainer,
        run_config=dict(spec.config),
        node_config=node_config(ctx, binding),
        data=spec.data,
        dataset=binding.dataset,
        job=job,
        model_seed=ctx.config.engine.model_seed,
        participants=len(plan.participants),
    )
    task_kind = trainer.kind in ("bundled", "task")
    world = LocalJobSpec(task=trainer.name, **job).world_size if task_kind else 1
    launch = WorkerLaunch(
        world_size=world,
        persistent=training.worker == "persistent",
        start_timeout_s=training.start_timeout_s,
        round_timeout_s=training.round_timeout_s,
    )
    return WorkerTrainer(worker, work_dir, launch)
