"""Node <-> job exchange through files in the run directory.

The node writes the job's inputs; the job (rank 0) writes its result or its error. Every
file is written to a temporary name in the same directory, fsynced, then renamed, so a
reader never sees half a file, and ``result.json`` is written last: its presence means
the update beside it is complete (its SHA-256 is recorded in it and checked on read).

=================  ======  ==================================================
file               writer  content
=================  ======  ==================================================
``spec.json``      node    the :class:`LocalJobSpec`
``global.npz``     node    global weights, float32, keyed by parameter name
``update.npz``     job     ``new - global``, float32, same keys
``result.json``    job     num_examples, steps, metrics, step losses, digest
``error.json``     job     ``{"kind", "field", "message"}`` when the job refused
``checkpoints/``   job     DCP checkpoints (see ``checkpoint.py``)
=================  ======  ==================================================

An update holding NaN or Inf is refused before it is written
(:func:`check_finite`), and refused again when read: it is never sent.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from coordinator_free import files

from org_node.training.errors import (
    JobFailedError,
    NonFiniteUpdateError,
    ShapeMismatchError,
    SpecError,
    TrainingError,
)
from org_node.training.spec import LocalJobSpec

__all__ = [
    "ERROR_FILE",
    "GLOBAL_FILE",
    "RESULT_FILE",
    "SPEC_FILE",
    "UPDATE_FILE",
    "LocalResult",
    "atomic_write",
    "check_finite",
    "check_shapes",
    "clear_outputs",
    "load_arrays",
    "npz_bytes",
    "read_error",
    "read_global",
    "read_result",
    "read_spec",
    "write_error",
    "write_inputs",
    "write_result",
]

SPEC_FILE = "spec.json"
GLOBAL_FILE = "global.npz"
UPDATE_FILE = "update.npz"
RESULT_FILE = "result.json"
ERROR_FILE = "error.json"


@dataclass(frozen=True)
class LocalResult:
    """What a local job hands back to the node.

    update: ``new - global`` per parameter, float32, finite.
    num_examples: training examples processed (steps x global batch), the update's weight.
    steps: optimizer steps taken.
    metrics: floats such as ``train_loss``, ``eval_loss``, ``eval_accuracy``,
        ``samples_per_s`` (mean after the first step), ``samples_per_s_median`` (from the
        median step time), ``cpu_s_per_step`` (CPU seconds of all ranks together per
        timed step), ``partition_size``, ``resumed_from_step``.
    losses: the mean training loss of every step, in order.
    """

    update: dict[str, np.ndarray]
    num_examples: int
    steps: int
    metrics: dict[str, float]
    losses: list[float] = field(default_factory=list)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` by temp file + fsync + rename (+ directory fsync).

    The directory is made if missing, never its parents: a job whose work tree was
    removed under it (its node's data directory wiped) fails instead of rebuilding it."""
    path.parent.mkdir(exist_ok=True)
    files.atomic_write(path, data)


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    contents: dict[str, Any] = {
        k: np.ascontiguousarray(v, dtype=np.float32) for k, v in arrays.items()
    }
    np.savez(buf, **contents)
    return buf.getvalue()


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def load_arrays(path: Path | str) -> dict[str, np.ndarray]:
    """Read an ``.npz`` of named arrays as float32."""
    with np.load(Path(path), allow_pickle=False) as npz:
        return {k: np.asarray(npz[k], dtype=np.float32) for k in npz.files}


def check_finite(arrays: dict[str, np.ndarray], what: str = "update") -> None:
    """Raise NonFiniteUpdateError naming the first parameter holding NaN or Inf."""
    for name, value in arrays.items():
        bad = int(np.size(value) - np.count_nonzero(np.isfinite(value)))
        if bad:
            raise NonFiniteUpdateError(name, bad, what)


def check_shapes(
    state: dict[str, np.ndarray], reference: dict[str, tuple[int, ...]], what: str = "global model"
) -> None:
    """Raise ShapeMismatchError naming the first parameter that is missing, extra or mis-shaped."""
    for name in sorted(reference):
        if name not in state:
            raise ShapeMismatchError(name, f"missing from the {what}")
    for name in sorted(state):
        if name not in reference:
            raise ShapeMismatchError(name, f"in the {what} but not in the task's model")
        shape = tuple(np.shape(state[name]))
        if shape != tuple(reference[name]):
            raise ShapeMismatchError(
                name, f"{what} has shape {shape}, the task's model has {tuple(reference[name])}"
            )


def clear_outputs(run_dir: Path) -> None:
    """Remove a previous result or error (checkpoints stay, for resume)."""
    for name in (UPDATE_FILE, RESULT_FILE, ERROR_FILE):
        with contextlib.suppress(FileNotFoundError):
            (run_dir / name).unlink()


def write_inputs(run_dir: Path, spec: LocalJobSpec, global_state: dict[str, np.ndarray]) -> None:
    """The node's side: the spec and the global weights, after a finiteness check."""
    check_finite(global_state, "global model")
    run_dir.mkdir(parents=True, exist_ok=True)
    clear_outputs(run_dir)
    atomic_write(run_dir / GLOBAL_FILE, npz_bytes(global_state))
    atomic_write(run_dir / SPEC_FILE, _json_bytes(spec.to_dict()))


def read_spec(run_dir: Path) -> LocalJobSpec:
    try:
        data = json.loads((run_dir / SPEC_FILE).read_text())
    except FileNotFoundError as exc:
        raise SpecError("run_dir", f"no {SPEC_FILE} in {run_dir}") from exc
    return LocalJobSpec.from_dict(data)


def read_global(run_dir: Path) -> dict[str, np.ndarray]:
    state = load_arrays(run_dir / GLOBAL_FILE)
    check_finite(state, "global model")
    return state


def write_result(
    run_dir: Path,
    update: dict[str, np.ndarray],
    num_examples: int,
    steps: int,
    metrics: dict[str, float],
    losses: list[float],
) -> None:
    """The job's side: refuse a non-finite update, then update.npz, then result.json."""
    check_finite(update)
    blob = npz_bytes(update)
    atomic_write(run_dir / UPDATE_FILE, blob)
    atomic_write(
        run_dir / RESULT_FILE,
        _json_bytes(
            {
                "num_examples": int(num_examples),
                "steps": int(steps),
                "metrics": {k: float(v) for k, v in metrics.items()},
                "losses": [float(x) for x in losses],
                "update_sha256": hashlib.sha256(blob).hexdigest(),
            }
        ),
    )


def write_error(run_dir: Path, error: BaseException) -> None:
    """Record why the job refused, so the node can raise the same kind of error."""
    record: dict[str, Any] = {"kind": type(error).__name__, "message": str(error)}
    if isinstance(error, SpecError):
        record.update(field=error.field, detail=error.detail)
    elif isinstance(error, ShapeMismatchError):
        record.update(parameter=error.parameter, detail=error.detail)
    elif isinstance(error, NonFiniteUpdateError):
        record.update(parameter=error.parameter, count=error.count, what=error.what)
    atomic_write(run_dir / ERROR_FILE, _json_bytes(record))


def read_error(run_dir: Path) -> TrainingError | None:
    """The job's recorded error as an exception of the same kind, or None."""
    try:
        data = json.loads((run_dir / ERROR_FILE).read_text())
    except FileNotFoundError:
        return None
    kind = data.get("kind")
    if kind == "SpecError":
        return SpecError(str(data["field"]), str(data["detail"]))
    if kind == "ShapeMismatchError":
        return ShapeMismatchError(str(data["parameter"]), str(data["detail"]))
    if kind == "NonFiniteUpdateError":
        return NonFiniteUpdateError(str(data["parameter"]), int(data["count"]), str(data["what"]))
    return JobFailedError(f"the job failed: {kind}: {data.get('message')}")


def read_result(run_dir: Path) -> LocalResult:
    """Read and verify the job's result; raise the job's own error if it left one."""
    error = read_error(run_dir)
    if error is not None:
        raise error
    try:
        meta = json.loads((run_dir / RESULT_FILE).read_text())
    except FileNotFoundError as exc:
        raise JobFailedError(f"the job left no {RESULT_FILE} in {run_dir}") from exc
    blob = (run_dir / UPDATE_FILE).read_bytes()
    if hashlib.sha256(blob).hexdigest() != meta["update_sha256"]:
        raise JobFailedError(f"{UPDATE_FILE} does not match the digest in {RESULT_FILE}")
    update = load_arrays(run_dir / UPDATE_FILE)
    check_finite(update)
    return LocalResult(
        update=update,
        num_examples=int(meta["num_examples"]),
        steps=int(meta["steps"]),
        metrics={k: float(v) for k, v in meta["metrics"].items()},
        losses=[float(x) for x in meta["losses"]],
    )
