"""The node's side of the local worker: :class:`WorkerTrainer`, the run engine's trainer.

The node never runs trainer code. :class:`WorkerTrainer` starts the worker
(:mod:`org_node.trainers.worker`: one process, or ``torchrun`` with one rank per
device for a hybrid-parallel task) in its own session, hands it each round's global
model over the channel (:mod:`org_node.trainers.channel`) and takes back the update.

* **Lifetime.** ``persistent`` (the default) keeps the worker for the whole run;
  ``per-round`` starts a fresh one for every round.
* **Death.** A worker that dies (killed, out of memory, a crashed rank) is started
  again and the request sent again, once; a second death fails the round.
* **Time.** A request that runs past its timeout (``round_timeout_s`` for a round,
  ``start_timeout_s`` for the start and the round-0 model) kills the worker's whole
  process group and fails the round with that reason.
* **The trainer's own error** (it raised, returned arrays of the wrong shape) fails
  the round with the worker's one-line reason; nothing is retried.

Every failure is a :class:`TrainerFailed` naming the trainer and the cause. The node
process, its database and the run's other state are untouched by any of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from org_node.trainers import channel
from org_node.trainers.base import Model, WorkerSpec
from org_node.training.errors import TrainingError
from org_node.training.exchange import LocalResult
from org_node.training.launch import LaunchConfig, child_env, torchrun_command
from org_node.training.spec import LocalJobSpec

__all__ = ["TrainerFailed", "WorkerLaunch", "WorkerTrainer"]

_POLL_S = 0.002
_STOP_GRACE_S = 5.0


class TrainerFailed(TrainingError):
    """The trainer could not deliver (its error, a timeout, a dead worker): one line."""


@dataclass(frozen=True)
class WorkerLaunch:
    """How the worker runs.

    world_size: ranks of a task's local job (``dp x tp x pp`` of the spec's ``job``);
        above 1, torchrun starts the worker with that many ranks on this host (and
        checks, for ``device = "cuda"``, that there are as many GPUs).
    persistent: keep the worker for the run (else a fresh one per round).
    start_timeout_s / round_timeout_s: see the module docstring.
    env: extra environment variables of the worker.
    """

    world_size: int = 1
    persistent: bool = True
    start_timeout_s: float = 300.0
    round_timeout_s: float = 3600.0
    env: Mapping[str, str] = field(default_factory=dict)


class WorkerTrainer:
    """The engine's :class:`~org_node.engine.LocalTrainer`, served by a worker process.

    Thread-safe for one caller at a time (the engine calls it from one thread per
    round); :meth:`close` may come from any thread and stops the worker.
    """

    def __init__(self, spec: WorkerSpec, directory: Path, launch: WorkerLaunch) -> None:
        self.spec = spec
        self.directory = Path(directory)
        self.launch = launch
        self._proc: subprocess.Popen[bytes] | None = None
        self._seq = 0
        self._statistics: np.ndarray | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def name(self) -> str:
        return self.spec.trainer.name

    # -- the worker process ------------------------------------------------------------

    def _command(self) -> list[str]:
        args = ["--dir", str(self.directory)]
        if self.launch.world_size == 1:
            return [sys.executable, "-m", "org_node.trainers.worker", *args]
        shape = LocalJobSpec(task=self.name, **dict(self.spec.job))
        return torchrun_command(
            shape,
            self.directory,
            LaunchConfig(rdzv_id=f"fedweave-{self.spec.session[:8]}"),
            module="org_node.trainers.worker",
            args=args,
        )

    def _start(self) -> subprocess.Popen[bytes]:
        """A new worker, after the old one (if any) is stopped; its files reset."""
        self._kill()
        if self._closed:
            raise TrainerFailed(f"trainer {self.name!r}: the run is over at this node")
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob("req-*"):
            shutil.rmtree(stale, ignore_errors=True)
        (self.directory / channel.REQUEST_FILE).unlink(missing_ok=True)
        self.spec = replace(self.spec, session=uuid.uuid4().hex, node_pid=os.getpid())
        channel.publish(
            self.directory / channel.WORKER_FILE, json.dumps(self.spec.to_dict()).encode()
        )
        self._seq = 0
        env = child_env(dict(self.launch.env), self.launch.world_size)
        with (self.directory / "worker.log").open("ab") as log:
            self._proc = subprocess.Popen(
                self._command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        return self._proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def _log_tail(self) -> str:
        try:
            text = (self.directory / "worker.log").read_text(errors="replace")
        except OSError:
            return ""
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        return lines[-1][:300] if lines else ""

    # -- requests ----------------------------------------------------------------------

    def _await(self, proc: subprocess.Popen[bytes], directory: Path, timeout: float) -> Any:
        """The reply in ``directory``; None when the worker died first."""
        end = time.monotonic() + timeout
        while True:
            try:
                reply = channel.read_reply(directory)
            except ValueError as exc:
                raise TrainerFailed(f"trainer {self.name!r}: {exc}") from None
            if reply is not None:
                return reply
            if proc.poll() is not None:
                return None
            if self._closed:
                raise TrainerFailed(f"trainer {self.name!r}: the run is over at this node")
            if time.monotonic() > end:
                self._kill()
                raise TrainerFailed(f"trainer {self.name!r} ran past {timeout:g} s and was stopped")
            time.sleep(_POLL_S)

    def _request(self, op: str, timeout: float, **inputs: Any) -> channel.Reply:
        """Send one request (starting the worker if need be); its successful reply."""
        round_ = int(inputs.pop("round", 0))
        options = dict(inputs.pop("options", {}))
        for attempt in (1, 2):
            proc = self._proc if self._proc is not None and self._proc.poll() is None else None
            started = proc is None
            proc = proc or self._start()
            self._seq += 1
            request = channel.Request(self._seq, op, round_, options)
            directory = channel.write_request(self.directory, request, **inputs)
            wait = timeout + (self.launch.start_timeout_s if started and op != "init" else 0)
            reply = self._await(proc, directory, wait)
            if reply is not None:
                if not reply.ok:
                    shutil.rmtree(directory, ignore_errors=True)
                    raise TrainerFailed(f"trainer {self.name!r}: {reply.message}")
                return reply  # type: ignore[no-any-return]
            code = proc.returncode
            if attempt == 2 or self._closed:
                tail = self._log_tail()
                raise TrainerFailed(
                    f"trainer {self.name!r}: its worker exited with status {code} twice"
                    + (f"; last output: {tail}" if tail else "")
                )
        raise AssertionError("unreachable")

    def initial_model(self) -> Model:
        """The round-0 model (starting the worker)."""
        with self._lock:
            reply = self._request("init", self.launch.start_timeout_s)
            model = channel.read_arrays(reply.directory / "model.npz")
            shutil.rmtree(reply.directory, ignore_errors=True)
            return model

    def statistics(self) -> np.ndarray | None:
        """This org's contribution to the federation's statistics, or None."""
        with self._lock:
            reply = self._request("statistics", self.launch.round_timeout_s)
            path = reply.directory / "statistics.npy"
            vector = channel.read_vector(path) if reply.meta.get("statistics") else None
            shutil.rmtree(reply.directory, ignore_errors=True)
            return vector

    def use_statistics(self, statistics: np.ndarray) -> None:
        """The federation's sum, handed to the trainer with every round."""
        self._statistics = np.asarray(statistics, dtype=np.float64)

    def train(
        self, global_state: Mapping[str, np.ndarray], round: int, options: Mapping[str, Any]
    ) -> LocalResult:
        """One round of local training in the worker."""
        with self._lock:
            reply = self._request(
                "train",
                self.launch.round_timeout_s,
                round=round,
                options=dict(options),
                model=global_state,
                statistics=self._statistics,
            )
            meta = reply.meta
            result = LocalResult(
                update=channel.read_arrays(reply.directory / "update.npz"),
                num_examples=int(meta["num_examples"]),
                steps=int(meta["steps"]),
                metrics={str(k): float(v) for k, v in dict(meta["metrics"]).items()},
                losses=[float(x) for x in meta["losses"]],
            )
            shutil.rmtree(reply.directory, ignore_errors=True)
            for old in self.directory.glob("round-*"):
                if old.name < f"round-{round:06d}":
                    shutil.rmtree(old, ignore_errors=True)
            if not self.launch.persistent:
                self._stop()
            return result

    def _stop(self) -> None:
        """Ask the worker to stop; kill it after a grace period."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            self._proc = None
            return
        self._seq += 1
        channel.write_request(self.directory, channel.Request(self._seq, "stop"))
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_STOP_GRACE_S)
        self._kill()

    def close(self) -> None:
        """The run is over here: stop the worker (any request in flight fails) and remove
        its plaintext work files (request and round directories): nothing reads them
        again once the run's last update is in the sum."""
        self._closed = True
        with self._lock:
            self._stop()
            for leftover in (*self.directory.glob("req-*"), *self.directory.glob("round-*")):
                shutil.rmtree(leftover, ignore_errors=True)
