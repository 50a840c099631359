"""The org node: the runtime of one org, composed of its parts.

Owns the node's lifecycle and everything it does between the layers below and the
admin API above:

* :mod:`~org_node.node.assembly` — :class:`OrgNode`, the composition root of the
  node: builds the layers in order, starts and stops them, and serves
  :class:`~org_node.services.NodeServices` by handing each call to one part;
* :mod:`~org_node.node.context` — :class:`NodeContext`, the state the parts share, and
  the two ways another thread reaches what the node's event loop owns;
* :mod:`~org_node.node.federation` — membership proposals, installing a manifest
  version, and whom the peer port trusts;
* :mod:`~org_node.node.proposals` — runs proposed once, consented to, started together;
* :mod:`~org_node.node.runs` — the active run's engine behind one thread-safe façade;
* :mod:`~org_node.node.checkpoints` — this org's checkpoints at its peers, and recovery.

May import ``coordinator_free``, ``secure_agg`` (through them) and the rest of
``org_node``; never ``api`` (which imports this package: ``api.serve`` starts the node).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from org_node.node.files import NodeError, load_secret, read_chain, save_secret, write_chain

if TYPE_CHECKING:
    from org_node.node.assembly import HARNESS_EXPORT_ENV, OrgNode
    from org_node.node.checkpoints import RecoveredRun, recover_runs, recover_state
    from org_node.node.context import NodeContext
    from org_node.node.runs import TrainerFactory

_LAZY = {
    "HARNESS_EXPORT_ENV": "org_node.node.assembly",
    "OrgNode": "org_node.node.assembly",
    "RecoveredRun": "org_node.node.checkpoints",
    "recover_runs": "org_node.node.checkpoints",
    "recover_state": "org_node.node.checkpoints",
    "NodeContext": "org_node.node.context",
    "TrainerFactory": "org_node.node.runs",
}
"""Names imported on first use: the node's layers import torch, which a command that
only reads the node's files (:mod:`org_node.node.files`) never needs."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "HARNESS_EXPORT_ENV",
    "NodeContext",
    "NodeError",
    "OrgNode",
    "RecoveredRun",
    "TrainerFactory",
    "load_secret",
    "read_chain",
    "recover_runs",
    "recover_state",
    "save_secret",
    "write_chain",
]
