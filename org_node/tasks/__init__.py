"""Training tasks: a model factory, a data factory and a loss/metrics pair, named by reference.

A task is resolved inside the local worker, never in the node's process, from an
installed trainer (:mod:`org_node.trainers`): a bundled short name or the org's own
``"module:callable"``. The callable takes no argument, or one :class:`TaskContext`
(the dataset this org bound to the run, the run's config, the org's node config and
the federation's summed statistics), and returns a :class:`Task`. The bundled tasks are

- ``tabular``: logistic regression or an MLP on the org's own CSV or Parquet table,
  with features standardised by statistics the federation sums securely;
- ``breast_cancer``: an MLP on scikit-learn's breast-cancer data (the hospital demo);
- ``digits``: a small CNN on scikit-learn's 8x8 digits;
- ``gpt``: a small character-level GPT on the text corpus shipped in ``data/corpus.txt``
  (a story in thirteen chapters, about 64k characters of original prose), whose blocks
  support tensor and pipeline parallelism.

A model that supports tensor parallelism implements :class:`TensorParallelModel`; one
that supports pipeline parallelism implements :class:`PipelineModel`. The trainer in
``org_node.training`` checks these before it builds the mesh.

What it owns: the :class:`Task` protocol and its context, the bundled tasks (a module
each), their shipped data and the non-IID split of a data set over orgs
(``partition``).

What it may import: torch, numpy, scikit-learn, pyarrow and :mod:`org_node.datasets`
(the bound dataset); nothing else of ``org_node``, nor ``coordinator_free`` or ``api``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from org_node.datasets import DatasetBinding, DataSpec

__all__ = [
    "BUILTIN_TASKS",
    "PipelineModel",
    "Task",
    "TaskContext",
    "TaskData",
    "TaskError",
    "TensorParallelModel",
    "UnknownTaskError",
    "evaluate",
    "initial_state",
    "load_state",
    "load_task",
    "make_task",
    "model_state",
]


class TaskError(ValueError):
    """A task reference or a task object is not usable."""


class UnknownTaskError(TaskError):
    """The run spec's ``task`` field names no importable task."""


@dataclass(frozen=True)
class TaskData:
    """A task's examples, already as tensors.

    inputs / targets: the training examples; the first dimension indexes examples.
    eval_inputs / eval_targets: a held-out split, the same for every organization.
    labels: one integer class label per training example, used for Dirichlet non-IID
        partitioning; None when examples have no single class (then partitions are IID).
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    eval_inputs: torch.Tensor
    eval_targets: torch.Tensor
    labels: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.inputs.shape[0] != self.targets.shape[0]:
            raise TaskError(
                f"inputs has {self.inputs.shape[0]} examples but targets has {self.targets.shape[0]}"
            )
        if self.eval_inputs.shape[0] != self.eval_targets.shape[0]:
            raise TaskError("eval_inputs and eval_targets differ in their number of examples")
        if self.labels is not None and len(self.labels) != self.inputs.shape[0]:
            raise TaskError("labels must hold one label per training example")

    def __len__(self) -> int:
        return int(self.inputs.shape[0])


@dataclass(frozen=True)
class TaskContext:
    """What a task factory that takes one argument is given.

    dataset: the dataset this org bound to the run when it accepted it (path, kind,
        columns, rows, content hash), or None when the run needs no data.
    data: the run spec's data requirement (its columns are the same at every org,
        unlike a dataset's), or None.
    run_config: the run spec's ``config`` values.
    node_config: this org's own settings (partition, dataset fields).
    statistics: the federation's secure sum of every org's :attr:`Task.statistics`,
        once it has been computed (before round 1); None before, or when unused.
    """

    dataset: DatasetBinding | None = None
    data: DataSpec | None = None
    run_config: Mapping[str, bool | int | float | str] = field(default_factory=dict)
    node_config: Mapping[str, bool | int | float | str] = field(default_factory=dict)
    statistics: np.ndarray | None = None


@dataclass(frozen=True)
class Task:
    """What the trainer needs to know about a task (torchtitan's ``TrainSpec`` idea).

    name: a short name used in logs and metrics.
    build_model: builds the model on CPU, its initialization drawn from ``seed``.
    build_data: loads the examples; deterministic, so every rank sees the same tensors.
    loss: ``loss(outputs, targets)``, a mean over the batch (a scalar tensor).
    metrics: ``metrics(outputs, targets)``, floats such as accuracy, on a batch.
    statistics: optional; this org's contribution (a float vector of a fixed length,
        the same at every org) to statistics the federation sums securely before the
        first round; the sum comes back as :attr:`TaskContext.statistics`.
    """

    name: str
    build_model: Callable[[int], nn.Module]
    build_data: Callable[[], TaskData]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    metrics: Callable[[torch.Tensor, torch.Tensor], dict[str, float]]
    statistics: Callable[[], np.ndarray] | None = None


@runtime_checkable
class TensorParallelModel(Protocol):
    """A model whose layers can be split over a tensor-parallel mesh axis."""

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        """Module FQN -> DTensor parallel style, for ``parallelize_module``."""
        ...


@runtime_checkable
class PipelineModel(Protocol):
    """A model that can be cut into pipeline stages."""

    def num_pipeline_units(self) -> int:
        """How many blocks can be spread over stages (each stage needs at least one)."""
        ...

    def pipeline_stage(self, stage_index: int, num_stages: int) -> nn.Module:
        """This model, keeping only what stage ``stage_index`` of ``num_stages`` runs.

        Parameter names (FQNs) stay those of the full model, so the stages' state
        dicts merge back into the full one.
        """
        ...


BUILTIN_TASKS: dict[str, str] = {
    "tabular": "org_node.tasks.tabular:task",
    "breast_cancer": "org_node.tasks.breast_cancer:task",
    "digits": "org_node.tasks.digits:task",
    "gpt": "org_node.tasks.gpt:task",
}


def _call_factory(factory: Callable[..., object], context: TaskContext | None) -> object:
    """``factory(context)`` if it takes an argument, else ``factory()``."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    takes_one = any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
        for p in params.values()
    )
    return factory(context or TaskContext()) if takes_one else factory()


def load_task(ref: str, context: TaskContext | None = None) -> Task:
    """Resolve ``"module:callable"`` (or a bundled short name) and call it.

    The callable gets ``context`` if it takes an argument. Raises UnknownTaskError
    naming the field ``task`` when the module, the attribute or the result is not a task.
    """
    if not isinstance(ref, str) or not ref:
        raise UnknownTaskError(f"task: expected 'module:callable' or a bundled name, got {ref!r}")
    target = BUILTIN_TASKS.get(ref, ref)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UnknownTaskError(
            f"task: {ref!r} is neither a bundled task ({', '.join(sorted(BUILTIN_TASKS))}) "
            "nor of the form 'module:callable'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownTaskError(f"task: cannot import module {module_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UnknownTaskError(f"task: module {module_name!r} has no callable {attr!r}")
    return make_task(factory, context, target)


def make_task(factory: object, context: TaskContext | None, ref: str) -> Task:
    """Call a task factory (with ``context`` if it takes an argument); refuse a non-Task."""
    if not callable(factory):
        raise UnknownTaskError(f"task: {ref!r} is not callable")
    task = _call_factory(factory, context)
    if not isinstance(task, Task):
        raise UnknownTaskError(
            f"task: {ref!r} returned {type(task).__name__}, expected org_node.tasks.Task"
        )
    return task


def model_state(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's state dict as float32 numpy arrays (copies, on CPU)."""
    return {
        k: v.detach().to("cpu", torch.float32).numpy().copy() for k, v in model.state_dict().items()
    }


def initial_state(task: Task | str, seed: int = 0) -> dict[str, np.ndarray]:
    """The global model of round 0: the task's model initialized from ``seed``."""
    resolved = load_task(task) if isinstance(task, str) else task
    return model_state(resolved.build_model(seed))


def load_state(model: nn.Module, state: dict[str, np.ndarray]) -> None:
    """Load ``state`` into ``model``, refusing missing, extra or mis-shaped entries.

    Raises TaskError naming the first offending parameter.
    """
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing:
        raise TaskError(f"global model lacks parameter {missing[0]!r} of the task's model")
    if extra:
        raise TaskError(f"global model has parameter {extra[0]!r} that the task's model lacks")
    for key, ref in own.items():
        shape = tuple(np.shape(state[key]))
        if shape != tuple(ref.shape):
            raise TaskError(
                f"parameter {key!r}: global model has shape {shape}, "
                f"the task's model has {tuple(ref.shape)}"
            )
    model.load_state_dict(
        {k: torch.as_tensor(np.asarray(v)).to(own[k].dtype) for k, v in state.items()}
    )


def evaluate(task: Task | str, state: dict[str, np.ndarray]) -> dict[str, float]:
    """The task's loss and metrics of the model ``state`` on the held-out split (CPU)."""
    resolved = load_task(task) if isinstance(task, str) else task
    model = resolved.build_model(0)
    load_state(model, state)
    data = resolved.build_data()
    model.eval()
    with torch.no_grad():
        out = model(data.eval_inputs)
        result = {"loss": float(resolved.loss(out, data.eval_targets))}
        result.update(resolved.metrics(out, data.eval_targets))
    return result
