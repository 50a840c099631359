"""The harness-only debug export of a run engine: its rounds' plaintext updates on disk.

With a directory set (the node allows it only when its config says ``harness = true``),
each round's *plaintext* packed vector is written to ``DIR/<org>/<run>/round-<r>.npy``
(and the round-0 model to ``initial.npz`` beside them) so that a test harness can
recompute plain FedAvg, and while a file ``round-<r>.hold`` sits next to it the engine
waits before it sends anything of that round (the harness kills an org there: its
update made, not yet in the secure sum, every other org already in the round). Never on
by default; never for a real deployment.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from coordinator_free.sealed import atomic_write

from org_node.training.exchange import npz_bytes

__all__ = ["DebugExport"]


class DebugExport:
    """Where one org's run exports its rounds (``directory`` None: nothing is written)."""

    def __init__(self, directory: Path | None, org: str, run_key: str) -> None:
        self.directory = directory
        self.org = org
        self.run_key = run_key

    def path(self, round: int, suffix: str) -> Path | None:
        """``DIR/<org>/<run>/round-<r><suffix>``, if the export is on."""
        if self.directory is None:
            return None
        return self.directory / self.org / self.run_key / f"round-{round:06d}{suffix}"

    def initial(self, model: Mapping[str, np.ndarray]) -> None:
        """The round-0 model (public to the federation) beside the exports."""
        target = self.path(0, ".npy")
        if target is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(target.parent / "initial.npz", npz_bytes(dict(model)))

    def update(self, round: int, packed: np.ndarray) -> None:
        """Round ``round``'s packed plaintext update (under a compression, written again
        once encoded: what the org's compressed vector carries)."""
        target = self.path(round, ".npy")
        if target is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
            np.save(target, packed)

    async def held(self, round: int) -> None:
        """Wait while ``round-<r>.hold`` sits next to the round's export."""
        hold = self.path(round, ".hold")
        while hold is not None and hold.exists():
            await asyncio.sleep(0.05)
