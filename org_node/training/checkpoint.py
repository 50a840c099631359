"""Local checkpoint and resume with ``torch.distributed.checkpoint`` (DCP).

Each rank saves its own shards (FSDP2/DTensor shards, its pipeline stage) into one DCP
checkpoint directory; the model and optimizer go through ``get_state_dict`` /
``set_state_dict`` and the trainer's step counter is a ``Stateful`` too, as in
torchtitan. A checkpoint is complete once DCP has written its ``.metadata`` file (the
coordinator writes it after every rank has finished), so a job killed mid-save leaves
an incomplete directory that :meth:`JobCheckpointer.latest_step` ignores.

Checkpoints live under ``run_dir/checkpoints/<fingerprint>/step-NNNNNNNN``, where the
fingerprint hashes the spec and the global weights: a run directory reused for another
round or another spec never resumes from a stale checkpoint. With several hosts the run
directory must be on a file system every host sees.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from org_node.training.spec import LocalJobSpec

__all__ = ["JobCheckpointer", "ModelOptimizerState", "TrainerState", "fingerprint"]

_STEP_DIR = re.compile(r"^step-(\d{8})$")


def fingerprint(spec: LocalJobSpec, global_state: dict[str, np.ndarray]) -> str:
    """16 hex digits of SHA-256 over the spec and the global weights."""
    h = hashlib.sha256(repr(sorted(spec.to_dict().items())).encode())
    for name in sorted(global_state):
        h.update(name.encode())
        h.update(np.ascontiguousarray(global_state[name], dtype=np.float32).tobytes())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns when used without a process group; world size 1 does so on purpose."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class TrainerState(Stateful):
    """The trainer's own progress: steps done and the (rank-averaged) losses seen so far.

    Both are plain values, identical on every rank, stored by DCP as bytes.
    """

    def __init__(self) -> None:
        self.step = 0
        self.losses: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "losses": json.dumps(self.losses)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.losses = [float(x) for x in json.loads(state_dict["losses"])]


class ModelOptimizerState(Stateful):
    """Model and optimizer, through the distributed state-dict API (sharded)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )


class JobCheckpointer:
    """Save every ``every`` steps; load the newest complete checkpoint on start."""

    def __init__(
        self,
        directory: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer: TrainerState,
        *,
        every: int,
        keep: int = 2,
    ) -> None:
        self.directory = directory
        self.every = every
        self.keep = keep
        self.trainer = trainer
        self._app = ModelOptimizerState(model, optimizer)

    def _state(self) -> dict[str, Stateful]:
        return {"app": self._app, "trainer": self.trainer}

    def _path(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}"

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for child in self.directory.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / ".metadata").is_file():
                found.append(int(match.group(1)))
        return sorted(found)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int) -> None:
        """Collective: every rank calls it with the same step."""
        self.trainer.step = step
        with _single_process_quiet():
            dcp_save(self._state(), checkpoint_id=str(self._path(step)))
        if not dist.is_initialized() or dist.get_rank() == 0:
            for old in self.steps()[: -self.keep]:
                shutil.rmtree(self._path(old), ignore_errors=True)

    def load_latest(self) -> int:
        """Load the newest complete checkpoint; return its step (0 when there is none)."""
        step = self.latest_step()
        if step is None:
            return 0
        state = self._state()
        with _single_process_quiet():
            dcp_load(state, checkpoint_id=str(self._path(step)))
        return self.trainer.step
