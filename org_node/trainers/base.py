"""What the node and its local worker share: the trainer's identity, the worker's spec,
and the interface every kind of trainer implements inside the worker.

The node never imports a trainer's code. It starts a **worker** process
(``python -m org_node.trainers.worker``, or torchrun ranks of it) and hands it a
:class:`WorkerSpec` (``worker.json`` in the worker's directory); the worker resolves
the trainer named there and drives it through the :class:`Executor` interface:

* :meth:`Executor.initial_model` — the round-0 global model (every org derives the
  same one: seeded initialisation, or the Flower app's own ServerApp);
* :meth:`Executor.statistics` — this org's contribution to statistics the federation
  sums securely before round 1 (the ``tabular`` trainer's feature moments), or None;
* :meth:`Executor.train` — one round: from the global model to the update, its weight
  (examples seen) and metrics.

An executor raises :class:`TrainerError` with a one-line reason for anything the
trainer itself got wrong (it raised, returned arrays of the wrong shape or type,
named no examples); the worker reports it and the node fails the round with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from org_node.datasets import DatasetBinding, DataSpec
from org_node.training.errors import TrainingError
from org_node.training.exchange import LocalResult

__all__ = [
    "TRAINER_KINDS",
    "Executor",
    "Model",
    "Scalar",
    "TrainRequest",
    "TrainerError",
    "TrainerRef",
    "WorkerSpec",
    "check_scalars",
]

Scalar = bool | int | float | str
Model = dict[str, np.ndarray]

TRAINER_KINDS = ("bundled", "task", "flower-clientapp", "flower-app")
"""``bundled``: a task shipped with fedweave; ``task``: a ``module:callable`` (or
``file.py:callable``) returning an :class:`org_node.tasks.Task`; ``flower-clientapp``: a
Flower ``ClientApp`` (``module:attr`` or ``file.py:attr``); ``flower-app``: a Flower App
directory whose ``pyproject.toml`` names its components."""


class TrainerError(TrainingError):
    """The trainer's own code failed or returned something unusable (one-line reason)."""


def check_scalars(values: Mapping[str, Any], what: str) -> dict[str, Scalar]:
    """``values`` as a dict of str -> bool/int/float/str; ValueError naming the key."""
    out: dict[str, Scalar] = {}
    for key, value in values.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"{what}: keys must be non-empty strings, got {key!r}")
        if not isinstance(value, bool | int | float | str):
            raise ValueError(f"{what}[{key!r}] must be a bool, number or string, got {value!r}")
        if isinstance(value, float) and value != value:  # NaN
            raise ValueError(f"{what}[{key!r}] must not be NaN")
        out[key] = value
    return out


@dataclass(frozen=True)
class TrainerRef:
    """An installed trainer: its name at this org, its kind, its code, its content hash."""

    name: str
    kind: str
    ref: str
    sha256: str

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "kind": self.kind, "ref": self.ref, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainerRef:
        return cls(
            str(values["name"]), str(values["kind"]), str(values["ref"]), str(values["sha256"])
        )


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs, written by the node as ``worker.json``.

    session: the node's id for this worker; a worker that finds another session in
        its directory stops (the node started a new one).
    node_pid: the node's process id; the worker stops when that process is gone.
    org_id / run_key: whose worker, for which run.
    trainer: the installed trainer to run (checked against its hash before import).
    run_config: the run spec's ``config`` (Flower's ``run_config``).
    node_config: what this org sets (Flower's ``node_config``): partition, dataset.
    data: the run spec's data requirement, if any. dataset: the bound dataset, if any.
    job: the local job's settings (``LocalJobSpec`` fields but ``task``) for task kinds.
    model_seed: seeds the round-0 model, the same at every org.
    participants: how many orgs take part (a Flower ServerApp sees that many nodes).
    """

    session: str
    node_pid: int
    org_id: str
    run_key: str
    trainer: TrainerRef
    run_config: Mapping[str, Scalar] = field(default_factory=dict)
    node_config: Mapping[str, Scalar] = field(default_factory=dict)
    data: DataSpec | None = None
    dataset: DatasetBinding | None = None
    job: Mapping[str, Any] = field(default_factory=dict)
    model_seed: int = 0
    participants: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "session": self.session,
            "node_pid": self.node_pid,
            "org_id": self.org_id,
            "run_key": self.run_key,
            "trainer": self.trainer.to_dict(),
            "run_config": dict(self.run_config),
            "node_config": dict(self.node_config),
            "data": None if self.data is None else self.data.to_dict(),
            "dataset": None if self.dataset is None else self.dataset.to_dict(),
            "job": dict(self.job),
            "model_seed": self.model_seed,
            "participants": self.participants,
        }

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> WorkerSpec:
        return cls(
            session=str(values["session"]),
            node_pid=int(values["node_pid"]),
            org_id=str(values["org_id"]),
            run_key=str(values["run_key"]),
            trainer=TrainerRef.from_dict(values["trainer"]),
            run_config=check_scalars(values.get("run_config", {}), "run_config"),
            node_config=check_scalars(values.get("node_config", {}), "node_config"),
            data=None if values.get("data") is None else DataSpec.from_dict(values["data"]),
            dataset=(
                None
                if values.get("dataset") is None
                else DatasetBinding.from_dict(values["dataset"])
            ),
            job=dict(values.get("job", {})),
            model_seed=int(values.get("model_seed", 0)),
            participants=int(values.get("participants", 1)),
        )


@dataclass(frozen=True)
class TrainRequest:
    """One round for the trainer.

    round: the 0-based training round (Flower's ``server-round`` is ``round + 1``).
    options: the strategy's local settings for this round (e.g. ``prox_mu``).
    statistics: the federation's secure sum of every org's :meth:`Executor.statistics`,
        or None when the trainer asked for none.
    work_dir: a directory the trainer may use for this round (checkpoints, scratch).
    """

    round: int
    options: Mapping[str, Any] = field(default_factory=dict)
    statistics: np.ndarray | None = None
    work_dir: Path | None = None


class Executor(Protocol):
    """A trainer as the worker drives it (one object per worker process and rank)."""

    def initial_model(self) -> Model:
        """The round-0 global model, ``{name: array}``; the same at every org."""
        ...

    def statistics(self) -> np.ndarray | None:
        """This org's contribution to the federation's pre-training statistics, or None."""
        ...

    def train(self, global_model: Model, request: TrainRequest) -> LocalResult | None:
        """Train one round; the result on the rank that reports it (None on the others)."""
        ...

    def close(self) -> None:
        """Release what the trainer holds (process groups, files)."""
        ...
