"""The worker's executor for task trainers: a bundled task or the org's ``module:callable``.

Inside the worker (one process, or every torchrun rank of it) the task is built with
its :class:`~org_node.tasks.TaskContext` (the bound dataset, the run's config, this
org's node config, the federation's statistics) and trained by the hybrid-parallel
local job (:func:`org_node.training.job.train_round`): data x tensor x pipeline
parallel on one DeviceMesh, gloo on CPU, NCCL on GPU. The process group is initialised
on the first round and kept for the worker's life, so later rounds start at once.
"""

from __future__ import annotations

import hashlib
from dataclasses import fields
from typing import Any

import numpy as np
import torch.distributed as dist

from org_node.tasks import Task, TaskContext, load_task, make_task, model_state
from org_node.trainers.base import Model, TrainerError, TrainRequest, WorkerSpec
from org_node.trainers.code import load_object
from org_node.training.errors import SpecError
from org_node.training.exchange import LocalResult
from org_node.training.job import DistEnv, train_round
from org_node.training.spec import LocalJobSpec

__all__ = ["TaskExecutor"]

_JOB_FIELDS = frozenset(f.name for f in fields(LocalJobSpec)) - {"task"}


class TaskExecutor:
    """:class:`~org_node.trainers.base.Executor` of the ``bundled`` and ``task`` kinds."""

    def __init__(self, spec: WorkerSpec, env: DistEnv) -> None:
        if spec.trainer.kind not in ("bundled", "task"):
            raise TrainerError(f"a task executor cannot run a {spec.trainer.kind!r} trainer")
        self.spec = spec
        self.env = env
        self._tasks: dict[str, Task] = {}

    def _context(self, statistics: np.ndarray | None) -> TaskContext:
        s = self.spec
        return TaskContext(
            dataset=s.dataset,
            data=s.data,
            run_config=dict(s.run_config),
            node_config=dict(s.node_config),
            statistics=None if statistics is None else np.asarray(statistics, np.float64),
        )

    def _task(self, statistics: np.ndarray | None = None) -> Task:
        key = "" if statistics is None else hashlib.sha256(statistics.tobytes()).hexdigest()
        if key not in self._tasks:
            context = self._context(statistics)
            ref = self.spec.trainer.ref
            if self.spec.trainer.kind == "bundled":
                self._tasks[key] = load_task(ref, context)
            else:
                self._tasks[key] = make_task(load_object(ref), context, ref)
        return self._tasks[key]

    def initial_model(self) -> Model:
        return model_state(self._task().build_model(self.spec.model_seed))

    def statistics(self) -> np.ndarray | None:
        task = self._task()
        if task.statistics is None:
            return None
        vector = np.asarray(task.statistics(), dtype=np.float64)
        if vector.ndim != 1 or not vector.size:
            raise TrainerError(f"task {task.name!r}: statistics() must return a 1-D vector")
        return vector

    def job_spec(self, request: TrainRequest) -> LocalJobSpec:
        """This round's :class:`LocalJobSpec`: the org's settings, the strategy's options,
        and a batch seed drawn from the org's seed and the round."""
        values: dict[str, Any] = {k: v for k, v in self.spec.job.items() if k in _JOB_FIELDS}
        values |= {k: v for k, v in request.options.items() if k in _JOB_FIELDS}
        values["seed"] = int(values.get("seed", 0)) * 1_000_003 + request.round
        return LocalJobSpec(task=self.spec.trainer.name, **values)

    def train(self, global_model: Model, request: TrainRequest) -> LocalResult | None:
        spec = self.job_spec(request)
        if spec.world_size != self.env.world_size:
            raise SpecError(
                "world_size",
                f"the degrees need {spec.world_size} ranks, the worker has {self.env.world_size}",
            )
        if request.work_dir is None:
            raise TrainerError("a training round needs a work directory")
        return train_round(
            spec,
            dict(global_model),
            request.work_dir,
            self.env,
            task=self._task(request.statistics),
        )

    def close(self) -> None:
        if self.env.distributed and dist.is_initialized():
            dist.destroy_process_group()
