"""The state a run engine keeps: the model (its canonical bytes and hash, and the check
of an update against it), the persisted :class:`EngineState`, and the per-round
:class:`RoundReport` and final :class:`RunOutcome`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from coordinator_free.sealed import SealedError, pack_parts, unpack_parts

from org_node.run_config import EngineError, UpdateRejected
from org_node.strategies import StrategyError, state_from_bytes, state_to_bytes

__all__ = [
    "EngineState",
    "Model",
    "RoundReport",
    "RunOutcome",
    "check_update",
    "model_from_bytes",
    "model_hash",
    "model_to_bytes",
]


Model = dict[str, np.ndarray]


def model_hash(model: Mapping[str, np.ndarray]) -> bytes:
    """SHA-256 over every tensor's name, dtype, shape and little-endian bytes, by name."""
    h = hashlib.sha256(b"fedweave/model/v1\x00")
    for name in sorted(model):
        a = np.ascontiguousarray(model[name])
        le = a.astype(a.dtype.newbyteorder("<"), copy=False)
        header = json.dumps([name, le.dtype.str, list(a.shape)]).encode()
        h.update(len(header).to_bytes(4, "big") + header + le.tobytes())
    return h.digest()


def model_to_bytes(model: Mapping[str, np.ndarray]) -> bytes:
    """Canonical bytes of a model: every node holding the same model writes the same bytes
    (one framed part per tensor: JSON header of dtype and shape, then little-endian data)."""
    parts = {}
    for name, value in model.items():
        a = np.ascontiguousarray(value)
        le = a.astype(a.dtype.newbyteorder("<"), copy=False)
        header = json.dumps({"dtype": le.dtype.str, "shape": list(a.shape)}).encode()
        parts[name] = header + b"\n" + le.tobytes()
    return pack_parts(parts)


def model_from_bytes(data: bytes) -> Model:
    """Inverse of :func:`model_to_bytes`; :class:`EngineError` on malformed bytes."""
    try:
        out: Model = {}
        for name, raw in unpack_parts(data).items():
            header, _, body = raw.partition(b"\n")
            meta = json.loads(header)
            a = np.frombuffer(body, dtype=np.dtype(meta["dtype"])).reshape(meta["shape"])
            out[name] = a.astype(a.dtype.newbyteorder("="), copy=True)
        return out
    except (SealedError, ValueError, KeyError, TypeError) as exc:
        raise EngineError("model", f"not a model: {exc}") from None


def check_update(update: Mapping[str, np.ndarray], model: Mapping[str, np.ndarray]) -> None:
    """Refuse an update whose names or shapes differ from the model, or holding NaN/Inf."""
    missing = sorted(set(model) - set(update))
    if missing:
        raise UpdateRejected(f"update.{missing[0]}", "missing from the update")
    extra = sorted(set(update) - set(model))
    if extra:
        raise UpdateRejected(f"update.{extra[0]}", "not a parameter of the global model")
    for name in sorted(model):
        u = np.asarray(update[name])
        if u.shape != np.shape(model[name]):
            raise UpdateRejected(
                f"update.{name}",
                f"shape {u.shape} differs from the global model's {np.shape(model[name])}",
            )
        if not np.issubdtype(u.dtype, np.floating) or not np.isfinite(u).all():
            raise UpdateRejected(f"update.{name}", "holds NaN or Inf (or is not a float array)")


@dataclass
class EngineState:
    """What the engine persists: the next round, the model and the private state."""

    run_key: str
    round: int
    model: Model
    strategy: dict[str, Any]
    accountant: dict[str, Any] | None = None
    status: str = "running"
    plan: dict[str, Any] = field(default_factory=dict)
    """``{"name": ..., "spec": ...}``: enough to rebuild the run after a wiped disk."""
    statistics: np.ndarray | None = None
    """The federation's secure sum of the trainer's pre-training statistics, if any."""
    compression: bytes | None = None
    """The update compressor's state (:meth:`org_node.compressor.Compressor.to_bytes`)."""

    def to_bytes(self) -> bytes:
        meta = {
            "run_key": self.run_key,
            "round": self.round,
            "status": self.status,
            "plan": self.plan,
        }
        parts = {
            "meta": json.dumps(meta, sort_keys=True).encode(),
            "model": model_to_bytes(self.model),
            "strategy": state_to_bytes(self.strategy),
        }
        if self.accountant is not None:
            parts["accountant"] = json.dumps(self.accountant).encode()
        if self.statistics is not None:
            parts["statistics"] = np.ascontiguousarray(self.statistics, dtype="<f8").tobytes()
        if self.compression is not None:
            parts["compression"] = self.compression
        return pack_parts(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> EngineState:
        try:
            parts = unpack_parts(data)
            meta = json.loads(parts["meta"])
            return cls(
                run_key=str(meta["run_key"]),
                round=int(meta["round"]),
                model=model_from_bytes(parts["model"]),
                strategy=state_from_bytes(parts["strategy"]),
                accountant=json.loads(parts["accountant"]) if "accountant" in parts else None,
                status=str(meta.get("status", "running")),
                plan=dict(meta.get("plan", {})),
                statistics=(
                    np.frombuffer(parts["statistics"], dtype="<f8").astype(np.float64)
                    if "statistics" in parts
                    else None
                ),
                compression=parts.get("compression"),
            )
        except (SealedError, KeyError, ValueError, OSError, StrategyError) as exc:
            raise EngineError("state", f"unreadable engine state: {exc}") from None


@dataclass(frozen=True)
class RoundReport:
    """One completed round, as the node records it (metrics, events)."""

    run_key: str
    round: int
    model_hash: str
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    attempts: int
    local_steps: int
    examples: int
    metrics: dict[str, float]
    epsilon_spent: float | None
    bytes_sent: int


@dataclass(frozen=True)
class RunOutcome:
    """How a run ended at this node: ``completed`` or ``budget_exhausted``."""

    status: str
    rounds_done: int
    model_hash: str
    reason: str = ""
