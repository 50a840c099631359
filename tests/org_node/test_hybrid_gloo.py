"""Hybrid parallelism on CPU ranks (gloo) against a single-process reference, and resume.

The 4-rank runs start torchrun (marked e2e): dp x tp and pp x dp on the char-level GPT
must reproduce the single-process losses and update, since every rank draws the same
global batch and the data-parallel ranks split it evenly. The resume tests kill the job
(SIGKILL, as a crashed host) right after a DCP checkpoint and start it again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from org_node.tasks import initial_state
from org_node.training import LaunchConfig, LocalJobSpec, LocalResult, run_local_job
from org_node.training import exchange as ex
from org_node.training.job import FAULT_KILL_AT_STEP_ENV
from org_node.training.launch import free_port

GPT_BASE = {
    "task": "gpt",
    "local_steps": 3,
    "batch_size": 8,
    "lr": 0.01,
    "optimizer": "sgd",
    "evaluate": False,
}
LAUNCH = LaunchConfig(timeout_s=240)


@pytest.fixture(scope="module")
def gpt_global() -> dict[str, np.ndarray]:
    return initial_state("gpt", seed=0)


@pytest.fixture(scope="module")
def gpt_reference(
    gpt_global: dict[str, np.ndarray], tmp_path_factory: pytest.TempPathFactory
) -> LocalResult:
    return run_local_job(GPT_BASE, gpt_global, tmp_path_factory.mktemp("reference"))


def _assert_matches(result: LocalResult, reference: LocalResult) -> None:
    assert result.steps == reference.steps
    assert result.losses == pytest.approx(reference.losses, rel=1e-5)
    assert set(result.update) == set(reference.update)
    for name, value in reference.update.items():
        np.testing.assert_allclose(result.update[name], value, atol=2e-6, err_msg=name)
    # the update moved the model: the comparison is not between two zero updates
    assert max(float(np.abs(v).max()) for v in reference.update.values()) > 1e-3


@pytest.mark.e2e
def test_dp_x_tp_matches_single_process(
    gpt_global: dict[str, np.ndarray], gpt_reference: LocalResult, tmp_path: Path
) -> None:
    spec = {**GPT_BASE, "dp_shard": 2, "tp": 2}
    result = run_local_job(spec, gpt_global, tmp_path, launch=LAUNCH)
    assert result.metrics["world_size"] == 4.0
    _assert_matches(result, gpt_reference)


@pytest.mark.e2e
def test_pp_x_dp_matches_single_process(
    gpt_global: dict[str, np.ndarray], gpt_reference: LocalResult, tmp_path: Path
) -> None:
    # The multi-host code path (an explicit c10d rendezvous endpoint), on one host.
    launch = LaunchConfig(
        rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id="pp-test", timeout_s=240
    )
    spec = {**GPT_BASE, "pp": 2, "dp_shard": 2, "microbatches": 2}
    result = run_local_job(spec, gpt_global, tmp_path, launch=launch)
    assert result.metrics["world_size"] == 4.0
    _assert_matches(result, gpt_reference)
    assert not list(tmp_path.glob(".stage-*"))


TAB = {
    "task": "breast_cancer",
    "local_steps": 6,
    "batch_size": 32,
    "lr": 3e-3,
    "checkpoint_every": 1,
    "evaluate": False,
}


def test_resume_after_kill_single_process(tmp_path: Path) -> None:
    g = initial_state("breast_cancer")
    reference = run_local_job({**TAB, "checkpoint_every": 0}, g, tmp_path / "ref")
    run_dir = tmp_path / "run"
    ex.write_inputs(run_dir, LocalJobSpec.from_dict(TAB), g)
    env = {**os.environ, FAULT_KILL_AT_STEP_ENV: "3"}
    proc = subprocess.run(
        [sys.executable, "-m", "org_node.training.job", "--run-dir", str(run_dir)],
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert not (run_dir / ex.RESULT_FILE).exists()
    assert list(run_dir.glob("checkpoints/*/step-00000003/.metadata"))

    resumed = run_local_job(TAB, g, run_dir)
    assert resumed.metrics["resumed_from_step"] == 3.0
    assert resumed.steps == 6 and len(resumed.losses) == 6
    assert resumed.losses == pytest.approx(reference.losses, rel=1e-6)
    for name, value in reference.update.items():
        np.testing.assert_allclose(resumed.update[name], value, atol=1e-6, err_msg=name)


def test_checkpoints_of_another_global_model_are_ignored(tmp_path: Path) -> None:
    spec = {**TAB, "local_steps": 2}
    run_local_job(spec, initial_state("breast_cancer", 0), tmp_path)
    other = run_local_job(spec, initial_state("breast_cancer", 1), tmp_path)
    assert other.metrics["resumed_from_step"] == 0.0
    assert len(list((tmp_path / "checkpoints").iterdir())) == 2
