"""What an org trains with: installed trainers, and the local worker that runs them.

* :mod:`~org_node.trainers.catalog` — the trainers an org installed (bundled, config,
  admin API), each pinned by the content hash of its code (:mod:`~.code`);
* :mod:`~org_node.trainers.local` — the node's side of the worker process
  (:class:`~org_node.trainers.local.WorkerTrainer`, the run engine's trainer);
* :mod:`~org_node.trainers.worker` — the worker process, the only one that imports a
  trainer's code, and its executors: :mod:`~.tasks` (bundled and ``module:callable``
  tasks, hybrid-parallel under torchrun) and :mod:`~.flower` (Flower apps, unchanged);
* :mod:`~org_node.trainers.channel` — the files between the two.

What it owns: installed trainers (their kinds, code hashes and catalog), the worker
process and the protocol between it and the node, and the executors that run bundled
tasks and Flower apps.

What it may import: ``org_node.training`` (the local job), ``org_node.tasks``,
``org_node.datasets``, the run states and the database models (the catalog), Flower,
torch and numpy; never the node, the run engine or ``api``.
"""

from org_node.trainers.base import TRAINER_KINDS, TrainerError, TrainerRef, WorkerSpec

__all__ = ["TRAINER_KINDS", "TrainerError", "TrainerRef", "WorkerSpec"]
