"""The local worker: the only process that imports and runs an org's trainer code.

The node starts it once per run (``[training] worker = "persistent"``) and keeps it::

    python -m org_node.trainers.worker --dir WORKER_DIR            (one process)
    torchrun --nproc-per-node N ... -m org_node.trainers.worker --dir WORKER_DIR

Every rank reads ``worker.json`` (:class:`~org_node.trainers.base.WorkerSpec`), then
serves requests from the channel (:mod:`org_node.trainers.channel`) until the node
asks it to stop, the node's process is gone, or the node started another worker in
the directory. Before the trainer's code is imported its content hash is checked
against the hash fixed when it was installed. A trainer that raises gets its error
reported (one line) and, alone in its process, the worker goes on serving; a worker
of several ranks exits instead (a rank may be stuck in a collective), and the node
starts a new one for the next request.

``--probe KIND REF`` imports a trainer and checks that it is what its kind says (what
``POST /v1/trainers`` runs before it installs one): it prints one JSON line and exits
0 (usable) or 2 (not, with the reason).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from org_node.datasets import DatasetError, content_hash
from org_node.tasks import TaskError
from org_node.trainers import channel
from org_node.trainers.base import Executor, TrainerError, TrainRequest, WorkerSpec
from org_node.trainers.code import CodeError, code_hash, load_object, read_flower_app
from org_node.training.errors import TrainingError
from org_node.training.job import DistEnv

__all__ = ["build_executor", "main", "probe", "serve"]

POLL_S = 0.002
"""How often a waiting worker looks for a new request (a stat of one file)."""
LIVENESS_S = 0.5
"""How often it checks that the node is alive and that it is still the node's worker."""


def _node_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _still_mine(root: Path, spec: WorkerSpec) -> bool:
    try:
        doc = json.loads((root / channel.WORKER_FILE).read_bytes())
    except (OSError, ValueError):
        return False
    return bool(doc.get("session") == spec.session) and _node_alive(spec.node_pid)


def _next_request(root: Path, after: int, spec: WorkerSpec) -> channel.Request | None:
    """Wait for a request newer than ``after``; None when this worker should stop."""
    path = root / channel.REQUEST_FILE
    seen = -1
    checked = time.monotonic()
    while True:
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            mtime = -1
        if mtime != seen:
            seen = mtime
            request = channel.read_request(root)
            if request is not None and request.seq > after:
                return request
        now = time.monotonic()
        if now - checked >= LIVENESS_S:
            checked = now
            if not _still_mine(root, spec):
                return None
        time.sleep(POLL_S)


def _hash_now(what: str, compute: Callable[[], str], errors: type[Exception]) -> str:
    """The hash ``compute`` gives now; its failure (``errors``) refuses ``what``."""
    try:
        return compute()
    except errors as exc:
        raise TrainerError(f"{what}: {exc}") from None


def _check_dataset(spec: WorkerSpec) -> None:
    """Refuse a bound dataset whose bytes changed since the org bound it to the run."""
    bound = spec.dataset
    if bound is None:
        return
    path = Path(bound.path)
    roots = [path.parent if path.is_file() else path]
    actual = _hash_now(f"dataset {bound.name!r}", lambda: content_hash(path, roots), DatasetError)
    if actual != bound.sha256:
        raise TrainerError(
            f"dataset {bound.name!r} changed since it was bound to the run "
            f"(hash {bound.sha256[:12]}, now {actual[:12]}); register it again and bind "
            "it to a new run"
        )


def build_executor(spec: WorkerSpec, env: DistEnv) -> Executor:
    """Check the trainer's code against its installed hash, then import it."""
    trainer = spec.trainer
    actual = _hash_now(
        f"trainer {trainer.name!r}", lambda: code_hash(trainer.kind, trainer.ref), CodeError
    )
    if actual != trainer.sha256:
        raise TrainerError(
            f"trainer {trainer.name!r}: its code changed since it was installed "
            f"(hash {trainer.sha256[:12]}, now {actual[:12]}); reinstall it"
        )
    _check_dataset(spec)
    if trainer.kind in ("bundled", "task"):
        from org_node.trainers.tasks import TaskExecutor

        return TaskExecutor(spec, env)
    from org_node.trainers.flower import FlowerExecutor

    return FlowerExecutor.from_spec(spec)


def _handle(executor: Executor, request: channel.Request, root: Path, env: DistEnv) -> None:
    directory = channel.request_dir(root, request.seq)
    if request.op == "init":
        if env.rank == 0:
            channel.write_reply(directory, arrays={"model": executor.initial_model()})
        return
    if request.op == "statistics":
        if env.rank == 0:
            vector = executor.statistics()
            vectors = {} if vector is None else {"statistics": vector}
            channel.write_reply(directory, meta={"statistics": vector is not None}, vectors=vectors)
        return
    model = channel.read_arrays(directory / "global.npz")
    stats_file = directory / "statistics-in.npy"
    statistics = channel.read_vector(stats_file) if stats_file.exists() else None
    work_dir = root / f"round-{request.round:06d}"
    # never its parents: a worker whose node's data directory was wiped (it outlives a
    # killed node until it notices) must not bring the directory back
    work_dir.mkdir(exist_ok=True)
    train = TrainRequest(request.round, dict(request.options), statistics, work_dir)
    started = time.monotonic()
    result = executor.train(model, train)
    if result is None or env.rank != 0:
        return
    metrics = dict(result.metrics) | {"local_compute_s": time.monotonic() - started}
    meta = {
        "num_examples": int(result.num_examples),
        "steps": int(result.steps),
        "metrics": {k: float(v) for k, v in metrics.items() if np.isfinite(v)},
        "losses": [float(x) for x in result.losses if np.isfinite(x)],
    }
    channel.write_reply(directory, meta=meta, arrays={"update": result.update})


def _named(exc: Exception) -> Exception:
    """Fedweave's own errors say what is wrong; any other one is named by its type."""
    if isinstance(exc, TrainingError | TaskError | CodeError):
        return exc
    first = (str(exc).strip().splitlines() or [""])[0]
    return TrainerError(f"{type(exc).__name__}: {first}" if first else type(exc).__name__)


def serve(root: Path, env: DistEnv | None = None) -> int:
    """Serve requests until told to stop; 0 when stopped, 2 when the worker cannot go on."""
    env = env or DistEnv.from_environ()
    spec = WorkerSpec.from_dict(json.loads((root / channel.WORKER_FILE).read_bytes()))
    print(f"rank {env.rank}: serving trainer {spec.trainer.name!r}", file=sys.stderr, flush=True)
    executor: Executor | None = None
    done = 0
    try:
        while (request := _next_request(root, done, spec)) is not None:
            done = request.seq
            if request.op == "stop":
                return 0
            try:
                if executor is None:
                    executor = build_executor(spec, env)
                _handle(executor, request, root, env)
            except Exception as exc:  # the trainer's failure: report it, in one line
                if env.rank == 0:
                    channel.write_reply(channel.request_dir(root, request.seq), error=_named(exc))
                print(f"rank {env.rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
                if executor is None or env.world_size > 1:
                    return 2
        return 0
    finally:
        if executor is not None:
            executor.close()


def probe(kind: str, ref: str) -> dict[str, Any]:
    """Import a trainer and check that it is what ``kind`` says; what was found."""
    from org_node.tasks import Task

    if kind == "bundled":
        return {"ok": True, "detail": "a bundled task"}
    if kind == "task":
        obj = load_object(ref)
        if isinstance(obj, Task) or not callable(obj):
            raise CodeError(f"{ref} is not a callable that returns a Task")
        return {"ok": True, "detail": "a task factory"}
    from flwr.client import Client, NumPyClient
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    server: Any = None
    if kind == "flower-app":
        app = read_flower_app(Path(ref))
        client = load_object(app.clientapp, "app", app_root=app.root)
        if app.serverapp:
            server = load_object(app.serverapp, "app", app_root=app.root)
            if not isinstance(server, ServerApp):
                raise CodeError(f"{app.serverapp} is a {type(server).__name__}, not a ServerApp")
    elif kind == "flower-clientapp":
        client = load_object(ref, "app")
    else:
        raise CodeError(f"unknown trainer kind {kind!r}")
    if not isinstance(client, ClientApp | NumPyClient | Client):
        raise CodeError(f"{ref} is a {type(client).__name__}, not a Flower ClientApp or client")
    detail = f"a Flower {type(client).__name__}" + (" with its ServerApp" if server else "")
    return {"ok": True, "detail": detail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m org_node.trainers.worker", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--dir", type=Path, help="the worker's directory")
    parser.add_argument("--probe", nargs=2, metavar=("KIND", "REF"), help="check a trainer")
    args = parser.parse_args(argv)
    if args.probe:
        try:
            found = probe(*args.probe)
        except Exception as exc:  # the trainer's own import error, reported in one line
            first = (str(exc).strip().splitlines() or [""])[0]
            print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {first}"}))
            return 2
        print(json.dumps(found))
        return 0
    if args.dir is None:
        parser.error("--dir is required")
    return serve(args.dir)


if __name__ == "__main__":
    raise SystemExit(main())
