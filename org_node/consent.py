"""What an org binds to a run when it consents, and the checks before it starts.

Accepting a run (:func:`bind_run`) resolves the trainer the spec names among this
org's installed trainers (a missing one, or one whose hash differs from the spec's pin,
is refused: nothing is imported, no code runs) and, for a run that needs data, binds
one of this org's registered datasets after checking it against the spec's data
requirement (every mismatch is named). The run's row keeps the trainer's hash and the
dataset's id, name, content hash and rows (:meth:`RunBinding.row_values`).

Starting it (:func:`binding_of`) checks that all of that still holds: the trainer is
still installed and its code still hashes to the bound hash, and the dataset is still
registered with the bound content hash. The worker checks the dataset's bytes against
that hash again before the trainer reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlmodel import Session, col, select

from org_node.datasets import DatasetBinding, mismatches
from org_node.db.models import Dataset, Run
from org_node.policy import RunSpec
from org_node.trainers.catalog import InstalledTrainer, TrainerCatalog, TrainerRefused

__all__ = ["ConsentRefused", "RunBinding", "bind_run", "binding_of", "dataset_binding"]


class ConsentRefused(Exception):
    """This org cannot consent to (or start) the run as it stands; one line says why."""


@dataclass(frozen=True)
class RunBinding:
    """The trainer and dataset this org runs a run with."""

    trainer: InstalledTrainer
    dataset: DatasetBinding | None

    def row_values(self) -> dict[str, Any]:
        d = self.dataset
        return {
            "trainer_hash": self.trainer.sha256,
            "dataset_id": None if d is None else d.id,
            "dataset_name": None if d is None else d.name,
            "dataset_hash": None if d is None else d.sha256,
            "dataset_rows": None if d is None else d.rows,
        }


def dataset_binding(row: Dataset) -> DatasetBinding:
    assert row.id is not None
    return DatasetBinding(
        row.id, row.name, row.path, row.kind, dict(row.columns), row.row_count, row.content_hash
    )


def _matching(session: Session, spec: RunSpec) -> list[str]:
    assert spec.data is not None
    rows = session.exec(select(Dataset).order_by(col(Dataset.name))).all()
    return [r.name for r in rows if not mismatches(spec.data, r.kind, r.columns, r.row_count)]


def bind_run(
    session: Session, catalog: TrainerCatalog, spec: RunSpec, dataset: str | None
) -> RunBinding:
    """The binding of a run this org accepts; ConsentRefused naming what is wrong."""
    try:
        trainer = catalog.resolve(session, spec.trainer, spec.trainer_hash)
    except TrainerRefused as exc:
        raise ConsentRefused(str(exc)) from None
    if spec.data is None:
        if dataset is not None:
            raise ConsentRefused("the run needs no data: accept it without a dataset")
        return RunBinding(trainer, None)
    if dataset is None:
        fits = _matching(session, spec)
        hint = f" (datasets that fit: {', '.join(fits)})" if fits else " (none of this org's fits)"
        raise ConsentRefused(
            f"the run needs a {spec.data.kind!r} dataset: name one of this org's datasets "
            f"to bind to it{hint}"
        )
    row = session.exec(select(Dataset).where(Dataset.name == dataset)).first()
    if row is None:
        raise ConsentRefused(f"this org has no dataset named {dataset!r}")
    problems = mismatches(spec.data, row.kind, row.columns, row.row_count)
    if problems:
        raise ConsentRefused(f"dataset {dataset!r} does not fit the run: {'; '.join(problems)}")
    return RunBinding(trainer, dataset_binding(row))


def binding_of(session: Session, catalog: TrainerCatalog, row: Run) -> RunBinding:
    """The binding recorded on an accepted run, checked again (see the module docstring)."""
    spec = RunSpec.from_dict(row.spec)
    try:
        trainer = catalog.resolve(session, spec.trainer, spec.trainer_hash)
        catalog.check_unchanged(trainer, row.trainer_hash)
    except TrainerRefused as exc:
        raise ConsentRefused(str(exc)) from None
    if row.trainer_hash is not None and trainer.sha256 != row.trainer_hash:
        raise ConsentRefused(
            f"trainer {trainer.name!r} was reinstalled since this org accepted the run "
            f"(hash {row.trainer_hash[:12]}…, now {trainer.sha256[:12]}…)"
        )
    if spec.data is None:
        return RunBinding(trainer, None)
    if row.dataset_id is not None:
        dataset = session.get(Dataset, row.dataset_id)
    elif row.dataset_name is not None:  # a run rebuilt from peers' shards: find it by name
        dataset = session.exec(select(Dataset).where(Dataset.name == row.dataset_name)).first()
    else:
        raise ConsentRefused("the run needs data, and this org bound no dataset to it")
    if dataset is None:
        raise ConsentRefused(
            f"dataset {row.dataset_name!r} bound to the run is not registered here: register "
            "it again (the same content, under the same name)"
        )
    if dataset.content_hash != row.dataset_hash:
        raise ConsentRefused(
            f"dataset {dataset.name!r} changed since it was bound to the run "
            f"(hash {str(row.dataset_hash)[:12]}…, now {dataset.content_hash[:12]}…)"
        )
    return RunBinding(trainer, dataset_binding(dataset))
