"""The node <-> worker channel: files in the worker's directory, written then renamed.

The node writes ``worker.json`` (the :class:`~org_node.trainers.base.WorkerSpec`)
before it starts the worker. Each request gets a directory ``req-NNNNNN`` holding its
inputs, and then ``request.json`` names it (its ``seq``); every rank of the worker
polls ``request.json``. The rank that reports writes its outputs into the request's
directory and ``reply.json`` last, so a reader that sees ``reply.json`` sees complete
outputs (each output's SHA-256 is in the reply and checked on read).

==================  ======  =================================================
file                writer  content
==================  ======  =================================================
``worker.json``     node    the worker's spec (trainer, configs, dataset)
``request.json``    node    ``{"seq", "op", "round", "options"}``
``req-N/global.npz``  node  the global model of a ``train`` request
``req-N/statistics-in.npy``  node  the federation's statistics (``train``)
``req-N/model.npz``   worker  the round-0 model (``init``)
``req-N/statistics.npy``  worker  this org's statistics (``statistics``)
``req-N/update.npz``  worker  ``new - global`` (``train``)
``req-N/reply.json``  worker  ``{"ok", "error", "meta", "files"}``, last
==================  ======  =================================================

The files carry no secrets beyond what the org's own training uses; the directory
lives under the node's data directory and never leaves the org. Writes are renames,
not fsyncs: a crash loses the request, and the node restarts the worker and asks again.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from org_node.training.exchange import npz_bytes

__all__ = [
    "OPS",
    "REPLY_FILE",
    "REQUEST_FILE",
    "WORKER_FILE",
    "Reply",
    "Request",
    "read_arrays",
    "read_reply",
    "read_request",
    "read_vector",
    "request_dir",
    "write_reply",
    "write_request",
]

WORKER_FILE = "worker.json"
REQUEST_FILE = "request.json"
REPLY_FILE = "reply.json"
OPS = ("init", "statistics", "train", "stop")


def publish(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` by a temporary file and a rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, allow_nan=False).encode()


def _vector_bytes(vector: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(vector, dtype=np.float64), allow_pickle=False)
    return buf.getvalue()


@dataclass(frozen=True)
class Request:
    """One request to the worker; ``seq`` grows by one per request of a worker's life."""

    seq: int
    op: str
    round: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "op": self.op, "round": self.round, "options": dict(self.options)}


def request_dir(root: Path, seq: int) -> Path:
    return root / f"req-{seq:06d}"


def write_request(
    root: Path,
    request: Request,
    *,
    model: Mapping[str, np.ndarray] | None = None,
    statistics: np.ndarray | None = None,
) -> Path:
    """The node's side: the request's inputs, then ``request.json``; its directory."""
    if request.op not in OPS:
        raise ValueError(f"unknown worker op {request.op!r}")
    directory = request_dir(root, request.seq)
    directory.mkdir(parents=True, exist_ok=True)
    if model is not None:
        publish(directory / "global.npz", npz_bytes(dict(model)))
    if statistics is not None:
        publish(directory / "statistics-in.npy", _vector_bytes(statistics))
    publish(root / REQUEST_FILE, _json(request.to_dict()))
    return directory


def read_request(root: Path) -> Request | None:
    """The worker's side: the current request, or None (none yet, or unreadable)."""
    try:
        doc = json.loads((root / REQUEST_FILE).read_bytes())
        return Request(int(doc["seq"]), str(doc["op"]), int(doc["round"]), dict(doc["options"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Reply:
    """What the worker answered: ``ok``, or an ``error`` (``{"kind", "message"}``)."""

    ok: bool
    error: Mapping[str, str] | None
    meta: Mapping[str, Any]
    directory: Path

    @property
    def message(self) -> str:
        error = self.error or {}
        return str(error.get("message", "the trainer failed"))


def write_reply(
    directory: Path,
    *,
    error: BaseException | None = None,
    meta: Mapping[str, Any] | None = None,
    arrays: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    vectors: Mapping[str, np.ndarray] | None = None,
) -> None:
    """The worker's side: outputs (``NAME.npz`` / ``NAME.npy``), then ``reply.json``."""
    files: dict[str, str] = {}
    for name, model in (arrays or {}).items():
        data = npz_bytes(dict(model))
        publish(directory / f"{name}.npz", data)
        files[f"{name}.npz"] = hashlib.sha256(data).hexdigest()
    for name, vector in (vectors or {}).items():
        data = _vector_bytes(vector)
        publish(directory / f"{name}.npy", data)
        files[f"{name}.npy"] = hashlib.sha256(data).hexdigest()
    doc: dict[str, Any] = {"ok": error is None, "meta": dict(meta or {}), "files": files}
    if error is not None:
        first = str(error).strip().splitlines()
        doc["error"] = {
            "kind": type(error).__name__,
            "message": first[0] if first else type(error).__name__,
        }
    publish(directory / REPLY_FILE, _json(doc))


def read_reply(directory: Path) -> Reply | None:
    """The node's side: the reply once it is complete, with its outputs checked."""
    try:
        doc = json.loads((directory / REPLY_FILE).read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"unreadable worker reply in {directory}: {exc}") from None
    for name, digest in dict(doc.get("files", {})).items():
        data = (directory / name).read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"{name} in {directory} does not match its digest")
    error = doc.get("error")
    return Reply(bool(doc.get("ok")), error, dict(doc.get("meta", {})), directory)


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    """A model file of the channel (``.npz`` of float32 arrays)."""
    with np.load(path, allow_pickle=False) as npz:
        return {k: np.asarray(npz[k], dtype=np.float32) for k in npz.files}


def read_vector(path: Path) -> np.ndarray:
    """A vector file of the channel (``.npy``, float64)."""
    return np.asarray(np.load(path, allow_pickle=False), dtype=np.float64)
