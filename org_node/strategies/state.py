"""The canonical bytes of a strategy's state (:meth:`Strategy.state_dict`): an ``.npz``
archive without pickle, so that a node that rebuilds itself from checkpoint shards
continues bit-identically."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from org_node.strategies.errors import StateMismatchError
from org_node.strategies.packing import NDArrays

__all__ = ["state_from_bytes", "state_to_bytes"]


def state_to_bytes(state: Mapping[str, Any]) -> bytes:
    """Canonical bytes of a :meth:`Strategy.state_dict`: an ``.npz`` archive (no pickle)
    with the JSON header under ``header`` and every buffer tensor as ``NAME/i``."""
    header = {k: v for k, v in state.items() if k != "arrays"}
    layout: dict[str, int | None] = {}
    tensors: dict[str, Any] = {}
    for key, arrays in dict(state.get("arrays", {})).items():
        layout[key] = None if arrays is None else len(arrays)
        for i, a in enumerate(arrays or []):
            tensors[f"{key}/{i}"] = np.asarray(a, dtype=np.float64)
    header["layout"] = layout
    blob = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    buf = io.BytesIO()
    tensors["header"] = np.frombuffer(blob, dtype=np.uint8)
    np.savez(buf, **tensors)
    return buf.getvalue()


def state_from_bytes(data: bytes) -> dict[str, Any]:
    """Inverse of :func:`state_to_bytes`; raises :class:`StateMismatchError` on bad input."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            header = json.loads(bytes(z["header"]).decode())
            layout = header.pop("layout")
            arrays: dict[str, NDArrays | None] = {}
            for key, count in layout.items():
                arrays[key] = None if count is None else [z[f"{key}/{i}"] for i in range(count)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StateMismatchError(f"not a strategy state: {exc}") from exc
    header["arrays"] = arrays
    return dict(header)
