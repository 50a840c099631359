"""What an org binds at consent, and the checks before the run starts (or resumes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine
from sqlmodel import Session

from org_node.config import TrainerSection
from org_node.consent import ConsentRefused, bind_run, binding_of
from org_node.db.engine import make_engine, migrate
from org_node.db.models import Dataset, Run
from org_node.policy import RunSpec
from org_node.trainers.catalog import TrainerCatalog
from org_node.trainers.code import code_hash

SPEC: dict[str, Any] = {"trainer": "mine", "rounds": 2, "participants": ["a", "b"]}
DATA = {"kind": "table", "columns": {"x": "number", "y": "int"}}


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    e = make_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    migrate(e)
    yield e
    e.dispose()


@pytest.fixture
def code(tmp_path: Path) -> Path:
    path = tmp_path / "code" / "mine.py"
    path.parent.mkdir()
    path.write_text("def task():\n    raise RuntimeError('never called here')\n")
    return path


def _catalog(code: Path) -> TrainerCatalog:
    return TrainerCatalog({"mine": TrainerSection("task", f"{code}:task")})


def _accepted(
    session: Session, catalog: TrainerCatalog, spec: dict[str, Any], ds: str | None
) -> Run:
    binding = bind_run(session, catalog, RunSpec.from_dict(spec), ds)
    row = Run(id="r" * 32, name="n", spec=spec, proposed_by="x", **binding.row_values())
    session.add(row)
    session.commit()
    return row


def _dataset(session: Session, tmp_path: Path) -> Dataset:
    row = Dataset(
        name="wards",
        path=str(tmp_path / "w.csv"),
        kind="table",
        columns={"x": "float", "y": "int", "z": "str"},
        row_count=10,
        content_hash="a" * 64,
    )
    session.add(row)
    session.commit()
    return row


def test_a_config_trainer_binds_its_hash_and_starts_while_unchanged(
    engine: Engine, code: Path
) -> None:
    catalog = _catalog(code)
    with Session(engine) as session:
        row = _accepted(session, catalog, SPEC, None)
        assert row.trainer_hash == code_hash("task", f"{code}:task")
        assert binding_of(session, catalog, row).trainer.name == "mine"
        code.write_text(code.read_text() + "# edited\n")
        with pytest.raises(ConsentRefused, match=r"code changed since this org accepted"):
            binding_of(session, catalog, row)


def test_a_config_pin_that_differs_makes_the_trainer_unusable(engine: Engine, code: Path) -> None:
    catalog = TrainerCatalog({"mine": TrainerSection("task", f"{code}:task", sha256="0" * 64)})
    with Session(engine) as session, pytest.raises(ConsentRefused, match=r"config pins 000000"):
        bind_run(session, catalog, RunSpec.from_dict(SPEC), None)


def test_the_bound_dataset_must_still_be_registered_with_its_hash(
    engine: Engine, code: Path, tmp_path: Path
) -> None:
    catalog = _catalog(code)
    spec = SPEC | {"data": DATA}
    with Session(engine) as session:
        ds = _dataset(session, tmp_path)
        row = _accepted(session, catalog, spec, "wards")
        assert (row.dataset_id, row.dataset_rows, row.dataset_hash) == (ds.id, 10, "a" * 64)
        assert binding_of(session, catalog, row).dataset is not None
        ds.content_hash = "b" * 64
        session.add(ds)
        session.commit()
        with pytest.raises(ConsentRefused, match=r"dataset 'wards' changed since it was bound"):
            binding_of(session, catalog, row)
        session.delete(ds)
        session.commit()
        with pytest.raises(ConsentRefused, match=r"not registered here"):
            binding_of(session, catalog, row)


def test_a_rebuilt_node_finds_its_dataset_again_by_name(
    engine: Engine, code: Path, tmp_path: Path
) -> None:
    catalog = _catalog(code)
    spec = SPEC | {"data": DATA}
    with Session(engine) as session:
        row = Run(
            id="q" * 32,
            name="n",
            spec=spec,
            proposed_by="recovery",
            state="running",
            trainer_hash=code_hash("task", f"{code}:task"),
            dataset_name="wards",
            dataset_hash="a" * 64,
            dataset_rows=10,
        )
        session.add(row)
        session.commit()
        with pytest.raises(ConsentRefused, match=r"register it again"):
            binding_of(session, catalog, row)
        _dataset(session, tmp_path)
        found = binding_of(session, catalog, row).dataset
        assert found is not None and found.name == "wards" and found.sha256 == "a" * 64
