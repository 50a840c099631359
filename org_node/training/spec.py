"""The run spec of one local training job (``LocalJobSpec``, also exported as ``TrainSpec``).

A spec is a flat dataclass; :meth:`LocalJobSpec.from_dict` rejects unknown keys and every
invalid value with a :class:`~org_node.training.errors.SpecError` that names the field.
The world size is ``dp_replicate * dp_shard * tp * pp``; 1 runs in the node's process.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from coordinator_free.validate import check_integer, check_number

from org_node.training.errors import SpecError

__all__ = ["DEVICES", "OPTIMIZERS", "LocalJobSpec", "TrainSpec"]

DEVICES = ("cpu", "cuda")
OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class LocalJobSpec:
    """One local training job.

    task: ``"module:callable"`` returning an ``org_node.tasks.Task``, or a bundled name
        (``tabular``, ``digits``, ``gpt``).
    dp_replicate: data-parallel replicas (gradients all-reduced; DDP when alone, else the
        replicate axis of HSDP).
    dp_shard: data-parallel shards (FSDP2 ``fully_shard``).
    tp: tensor-parallel degree (DTensor ``parallelize_module``).
    pp: pipeline-parallel stages (``torch.distributed.pipelining``, 1F1B schedule).
    local_steps: optimizer steps to run; None to run on ``time_budget_s`` alone.
    time_budget_s: stop after this many seconds of training (checked after each step);
        None for no limit. At least one of the two limits must be set.
    batch_size: global batch per step, split evenly over the data-parallel ranks.
    lr: learning rate.
    optimizer: ``sgd`` or ``adamw``.
    momentum: SGD momentum (ignored by AdamW).
    weight_decay: decoupled weight decay (AdamW) or L2 (SGD).
    prox_mu: FedProx proximal coefficient (Li et al. 2020, eq. 2): adds
        ``mu * (w - w_global)`` to every gradient; 0 disables it.
    microbatches: pipeline microbatches per step; None means ``pp``.
    seed: seeds model-independent randomness (batch order).
    device: ``cpu`` (gloo) or ``cuda`` (NCCL, one GPU per rank).
    partition_index / num_partitions: which share of the task's training data this job
        trains on (for demos and tests that split one data set over organizations).
    partition_seed: seeds that split; organizations sharing one data set must agree on it.
    dirichlet_alpha: label-skew concentration of that split; None for IID.
    checkpoint_every: save a DCP checkpoint every this many steps (0: never); a job
        started again in the same run directory resumes from the newest one.
    evaluate: compute the task's metrics on its held-out split after training.
    """

    task: str
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    local_steps: int | None = 10
    time_budget_s: float | None = None
    batch_size: int = 32
    lr: float = 1e-3
    optimizer: str = "adamw"
    momentum: float = 0.0
    weight_decay: float = 0.0
    prox_mu: float = 0.0
    microbatches: int | None = None
    seed: int = 0
    device: str = "cpu"
    partition_index: int = 0
    num_partitions: int = 1
    partition_seed: int = 0
    dirichlet_alpha: float | None = None
    checkpoint_every: int = 0
    evaluate: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not self.task.strip():
            raise SpecError(
                "task", f"expected 'module:callable' or a bundled name, got {self.task!r}"
            )
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "batch_size", "num_partitions"):
            check_integer(name, getattr(self, name), SpecError, low=1)
        for name in ("seed", "partition_index", "partition_seed", "checkpoint_every"):
            check_integer(name, getattr(self, name), SpecError)
        if self.local_steps is not None:
            check_integer("local_steps", self.local_steps, SpecError, low=1)
        if self.time_budget_s is not None:
            check_number("time_budget_s", self.time_budget_s, SpecError)
        if self.local_steps is None and self.time_budget_s is None:
            raise SpecError("local_steps", "set local_steps, time_budget_s or both")
        check_number("lr", self.lr, SpecError)
        for name in ("momentum", "weight_decay", "prox_mu"):
            check_number(name, getattr(self, name), SpecError, open_low=False)
        if self.momentum >= 1:
            raise SpecError("momentum", f"must be < 1, got {self.momentum}")
        if self.optimizer not in OPTIMIZERS:
            raise SpecError("optimizer", f"expected one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.device not in DEVICES:
            raise SpecError("device", f"expected one of {DEVICES}, got {self.device!r}")
        if not isinstance(self.evaluate, bool):
            raise SpecError("evaluate", f"expected true or false, got {self.evaluate!r}")
        if self.partition_index >= self.num_partitions:
            raise SpecError(
                "partition_index",
                f"{self.partition_index} is outside 0..{self.num_partitions - 1}",
            )
        if self.dirichlet_alpha is not None:
            check_number("dirichlet_alpha", self.dirichlet_alpha, SpecError)
        if self.microbatches is not None:
            check_integer("microbatches", self.microbatches, SpecError, low=1)
            if self.pp == 1 and self.microbatches != 1:
                raise SpecError("microbatches", "only meaningful with pp > 1; leave it unset")
            if self.microbatches < self.pp:
                raise SpecError(
                    "microbatches", f"{self.microbatches} is fewer than the pp={self.pp} stages"
                )
        per_rank, rem = divmod(self.batch_size, self.dp)
        if rem:
            raise SpecError(
                "batch_size",
                f"{self.batch_size} does not split evenly over dp_replicate*dp_shard={self.dp} ranks",
            )
        if self.pp > 1 and per_rank % self.num_microbatches:
            raise SpecError(
                "batch_size",
                f"the per-rank batch {per_rank} does not split into "
                f"{self.num_microbatches} pipeline microbatches",
            )

    @property
    def dp(self) -> int:
        """Data-parallel degree: ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        """Ranks the job needs: ``dp_replicate * dp_shard * tp * pp``."""
        return self.dp * self.tp * self.pp

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else self.pp

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LocalJobSpec:
        """Build a spec from a mapping; unknown and missing keys are SpecErrors."""
        if not isinstance(data, dict):
            raise SpecError("spec", f"expected a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise SpecError(str(key), f"unknown key (known: {', '.join(sorted(known))})")
        if "task" not in data:
            raise SpecError("task", "required")
        return cls(**data)

    @classmethod
    def coerce(cls, spec: LocalJobSpec | dict[str, Any]) -> LocalJobSpec:
        return spec if isinstance(spec, LocalJobSpec) else cls.from_dict(spec)


TrainSpec = LocalJobSpec
