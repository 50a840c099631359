"""The local worker: trainer code runs in its own process, never in the node's; the worker
lives for the run; a trainer that raises, hangs or exits is contained, and every failure
is one readable reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from org_node.datasets import DatasetBinding
from org_node.engine import TrainingConfig
from org_node.trainers import channel
from org_node.trainers.base import TrainerRef, WorkerSpec
from org_node.trainers.code import code_hash
from org_node.trainers.local import TrainerFailed, WorkerLaunch, WorkerTrainer

PROBE_TASK = '''\
"""A task whose behaviour the run config picks (tests of the worker)."""
import os
import time

import torch

from org_node.tasks import Task, TaskContext, TaskData


def task(context: TaskContext) -> Task:
    mode = context.run_config.get("mode", "ok")
    marker = str(context.run_config.get("marker", ""))

    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Linear(3, 2)

    def data() -> TaskData:
        if mode == "raise":
            raise ValueError("bad value in row 7\\nsecond line")
        if mode == "hang":
            time.sleep(3600)
        if mode == "exit":
            os._exit(3)
        if mode == "exit-once" and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(4)
        x = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
        y = (x[:, 0] > 0).long()
        if mode == "nan":
            x[:, 0] = float("nan")
        return TaskData(x, y, x, y)

    return Task("probe", build, data, torch.nn.functional.cross_entropy, lambda o, t: {})
'''


@pytest.fixture
def probe(tmp_path: Path) -> TrainerRef:
    code = tmp_path / "code"
    code.mkdir()
    (code / "probe_task.py").write_text(PROBE_TASK)
    ref = f"{code / 'probe_task.py'}:task"
    return TrainerRef("probe", "task", ref, code_hash("task", ref))


def _trainer(
    tmp_path: Path, trainer: TrainerRef, persistent: bool = True, **config: Any
) -> WorkerTrainer:
    spec = WorkerSpec(
        session="",
        node_pid=os.getpid(),
        org_id="org-a",
        run_key="k" * 32,
        trainer=trainer,
        run_config=config,
        job=TrainingConfig(local_steps=2, batch_size=8, evaluate=False).job_fields(),
    )
    launch = WorkerLaunch(persistent=persistent, start_timeout_s=120, round_timeout_s=60)
    return WorkerTrainer(spec, tmp_path / "worker", launch)


def test_the_worker_lives_for_the_run_and_trains_every_round(
    tmp_path: Path, probe: TrainerRef
) -> None:
    trainer = _trainer(tmp_path, probe)
    try:
        model = trainer.initial_model()
        assert {k: v.shape for k, v in model.items()} == {"weight": (2, 3), "bias": (2,)}
        assert trainer._proc is not None
        pid = trainer._proc.pid
        assert pid != os.getpid()
        for r in range(3):
            result = trainer.train(model, r, {})
            assert result.steps == 2 and result.num_examples == 16
            assert result.metrics["local_compute_s"] > 0
            assert any(float(np.abs(u).max()) > 0 for u in result.update.values())
            model = {k: model[k] + result.update[k] for k in model}
        assert trainer._proc is not None and trainer._proc.pid == pid  # one worker, kept
        assert not list((tmp_path / "worker").glob("req-*"))  # requests cleaned up
    finally:
        trainer.close()
    assert trainer._proc is None


def test_per_round_mode_starts_a_fresh_worker_each_round(tmp_path: Path, probe: TrainerRef) -> None:
    trainer = _trainer(tmp_path, probe, persistent=False)
    try:
        model = trainer.initial_model()
        trainer.train(model, 0, {})
        assert trainer._proc is None  # stopped after the round
        trainer.train(model, 1, {})
        log = (tmp_path / "worker" / "worker.log").read_text()
        assert trainer._proc is None and log is not None
    finally:
        trainer.close()


def test_the_same_seed_gives_the_same_initial_model_at_every_org(
    tmp_path: Path, probe: TrainerRef
) -> None:
    a, b = _trainer(tmp_path / "a", probe), _trainer(tmp_path / "b", probe)
    try:
        ma, mb = a.initial_model(), b.initial_model()
    finally:
        a.close()
        b.close()
    for k in ma:
        np.testing.assert_array_equal(ma[k], mb[k])


def test_a_trainer_that_raises_fails_the_round_with_its_reason_and_the_worker_goes_on(
    tmp_path: Path, probe: TrainerRef
) -> None:
    trainer = _trainer(tmp_path, probe, mode="raise")
    try:
        model = trainer.initial_model()
        pid = trainer._proc.pid if trainer._proc else None
        with pytest.raises(
            TrainerFailed, match=r"^trainer 'probe': ValueError: bad value in row 7$"
        ):
            trainer.train(model, 0, {})
        assert trainer._proc is not None and trainer._proc.poll() is None
        assert trainer._proc.pid == pid
    finally:
        trainer.close()


def test_a_trainer_that_hangs_is_stopped_at_its_timeout(tmp_path: Path, probe: TrainerRef) -> None:
    trainer = _trainer(tmp_path, probe, mode="hang")
    trainer.launch = WorkerLaunch(start_timeout_s=120, round_timeout_s=3)
    try:
        model = trainer.initial_model()
        proc = trainer._proc
        assert proc is not None
        with pytest.raises(TrainerFailed, match=r"ran past 3 s and was stopped"):
            trainer.train(model, 0, {})
        assert proc.poll() is not None  # the worker's whole process group is gone
    finally:
        trainer.close()


def test_a_worker_that_dies_is_started_again_once(tmp_path: Path, probe: TrainerRef) -> None:
    marker = tmp_path / "died-once"
    trainer = _trainer(tmp_path, probe, mode="exit-once", marker=str(marker))
    try:
        model = trainer.initial_model()
        first = trainer._proc
        result = trainer.train(model, 0, {})
        assert marker.exists() and result.steps == 2
        assert first is not None and trainer._proc is not None and trainer._proc is not first
    finally:
        trainer.close()


def test_a_worker_that_keeps_dying_fails_the_round(tmp_path: Path, probe: TrainerRef) -> None:
    trainer = _trainer(tmp_path, probe, mode="exit")
    try:
        model = trainer.initial_model()
        with pytest.raises(TrainerFailed, match=r"its worker exited with status 3 twice"):
            trainer.train(model, 0, {})
    finally:
        trainer.close()


def test_a_non_finite_update_is_refused_in_the_worker(tmp_path: Path, probe: TrainerRef) -> None:
    trainer = _trainer(tmp_path, probe, mode="nan")
    try:
        model = trainer.initial_model()
        with pytest.raises(TrainerFailed, match=r"NaN/Inf"):
            trainer.train(model, 0, {})
    finally:
        trainer.close()


def test_code_changed_since_installation_is_refused_before_import(
    tmp_path: Path, probe: TrainerRef
) -> None:
    path = Path(probe.ref.rpartition(":")[0])
    path.write_text(PROBE_TASK.replace("Linear(3, 2)", "Linear(3, 5)"))
    trainer = _trainer(tmp_path, probe)
    try:
        with pytest.raises(TrainerFailed, match=r"code changed since it was installed"):
            trainer.initial_model()
    finally:
        trainer.close()


def test_a_bound_dataset_whose_bytes_changed_is_refused(tmp_path: Path, probe: TrainerRef) -> None:
    data = tmp_path / "d.csv"
    data.write_text("a,b\n1,2\n")
    stale = DatasetBinding(1, "d", str(data), "table", {"a": "int", "b": "int"}, 1, "0" * 64)
    trainer = _trainer(tmp_path, probe)
    trainer.spec = WorkerSpec(**{**trainer.spec.__dict__, "dataset": stale})
    try:
        with pytest.raises(TrainerFailed, match=r"dataset 'd' changed since it was bound"):
            trainer.initial_model()
    finally:
        trainer.close()


def _worker_dir(tmp_path: Path, trainer: TrainerRef, node_pid: int) -> Path:
    root = tmp_path / "w"
    root.mkdir()
    spec = WorkerSpec("s1", node_pid, "org-a", "k" * 32, trainer)
    (root / channel.WORKER_FILE).write_text(json.dumps(spec.to_dict()))
    return root


def test_a_worker_stops_when_the_node_is_gone(tmp_path: Path, probe: TrainerRef) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    root = _worker_dir(tmp_path, probe, gone.pid)
    proc = subprocess.Popen([sys.executable, "-m", "org_node.trainers.worker", "--dir", str(root)])
    assert proc.wait(timeout=60) == 0


def test_a_worker_stops_when_the_node_starts_another(tmp_path: Path, probe: TrainerRef) -> None:
    root = _worker_dir(tmp_path, probe, os.getpid())
    proc = subprocess.Popen(
        [sys.executable, "-m", "org_node.trainers.worker", "--dir", str(root)],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None and "serving trainer 'probe'" in proc.stderr.readline()
    time.sleep(1.0)
    assert proc.poll() is None  # serving, waiting for a request
    doc = json.loads((root / channel.WORKER_FILE).read_text()) | {"session": "s2"}
    (root / channel.WORKER_FILE).write_text(json.dumps(doc))
    assert proc.wait(timeout=60) == 0


def test_probe_reports_an_import_failure_in_one_line(tmp_path: Path) -> None:
    from org_node.trainers.catalog import TrainerRefused, probe_trainer

    bad = tmp_path / "broken.py"
    bad.write_text("import no_such_module_anywhere\napp = None\n")
    with pytest.raises(TrainerRefused, match=r"ModuleNotFoundError: No module named"):
        probe_trainer("flower-clientapp", str(bad))
    notapp = tmp_path / "notapp.py"
    notapp.write_text("app = 42\n")
    with pytest.raises(TrainerRefused, match=r"is a int, not a Flower ClientApp"):
        probe_trainer("flower-clientapp", str(notapp))


def _ranked(tmp_path: Path, trainer: TrainerRef, **config: Any) -> WorkerTrainer:
    spec = WorkerSpec(
        session="",
        node_pid=os.getpid(),
        org_id="org-a",
        run_key="k" * 32,
        trainer=trainer,
        run_config=config,
        job=TrainingConfig(
            local_steps=2, batch_size=8, dp_replicate=2, evaluate=False
        ).job_fields(),
    )
    launch = WorkerLaunch(world_size=2, start_timeout_s=180, round_timeout_s=120)
    return WorkerTrainer(spec, tmp_path / "worker", launch)


def test_torchrun_ranks_live_for_the_run_and_train_every_round(
    tmp_path: Path, probe: TrainerRef
) -> None:
    trainer = _ranked(tmp_path, probe)
    try:
        model = trainer.initial_model()
        assert trainer._proc is not None
        launcher = trainer._proc.pid  # torchrun, with one worker rank per data-parallel replica
        for r in range(2):
            result = trainer.train(model, r, {})
            assert result.steps == 2 and result.metrics["world_size"] == 2.0
            model = {k: model[k] + result.update[k] for k in model}
        assert trainer._proc.pid == launcher
        log = (tmp_path / "worker" / "worker.log").read_text()
        assert "rank 0: serving" in log and "rank 1: serving" in log
    finally:
        trainer.close()


def test_a_failing_rank_ends_the_ranks_and_the_next_round_starts_new_ones(
    tmp_path: Path, probe: TrainerRef
) -> None:
    trainer = _ranked(tmp_path, probe, mode="raise")
    try:
        model = trainer.initial_model()
        first = trainer._proc
        with pytest.raises(TrainerFailed, match=r"ValueError: bad value in row 7"):
            trainer.train(model, 0, {})
        assert first is not None and first.wait(timeout=60) != 0  # the ranks are gone
    finally:
        trainer.close()


def test_finding_6_a_rounds_plaintext_work_files_go_once_its_update_is_in_the_sum(
    tmp_path: Path, probe: TrainerRef
) -> None:
    """The global model in and the update out (``req-N``) go as soon as the update is
    read; a round's work directory (``round-N``: the local model's checkpoints) goes when
    the next round trains, its update being in the sum by then; the last one when the
    run ends (before: kept for ever)."""
    trainer = _trainer(tmp_path, probe)
    worker = tmp_path / "worker"
    try:
        model = trainer.initial_model()
        for r in range(2):
            result = trainer.train(model, r, {})
            model = {k: model[k] + result.update[k] for k in model}
            assert not list(worker.glob("req-*"))
            assert [p.name for p in worker.glob("round-*")] == [f"round-{r:06d}"]
    finally:
        trainer.close()
    assert not list(worker.glob("round-*")) and not list(worker.glob("req-*"))
    assert not list(worker.rglob("*.npz"))
    assert (worker / "worker.log").exists()  # the log is kept
