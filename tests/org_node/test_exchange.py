"""The run-directory exchange between node and job: atomic files, digests, errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from org_node.training import (
    JobFailedError,
    LaunchConfig,
    LocalJobSpec,
    NonFiniteUpdateError,
    ShapeMismatchError,
    SpecError,
)
from org_node.training import exchange as ex
from org_node.training.launch import torchrun_command


def _update() -> dict[str, np.ndarray]:
    return {
        "layer.weight": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
        "layer.bias": np.array([-1.5, 2.0], dtype=np.float32),
    }


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "file.bin"
    ex.atomic_write(target, b"one")
    ex.atomic_write(target, b"two")
    assert target.read_bytes() == b"two"
    assert [p.name for p in target.parent.iterdir()] == ["file.bin"]


def test_inputs_round_trip(tmp_path: Path) -> None:
    spec = LocalJobSpec(task="gpt", dp_shard=2, tp=2, batch_size=8, lr=0.01)
    ex.write_inputs(tmp_path, spec, _update())
    assert ex.read_spec(tmp_path) == spec
    loaded = ex.read_global(tmp_path)
    assert all(np.array_equal(loaded[k], v) for k, v in _update().items())


def test_read_spec_rejects_unknown_keys(tmp_path: Path) -> None:
    (tmp_path / ex.SPEC_FILE).write_text(json.dumps({"task": "gpt", "epochs": 3}))
    with pytest.raises(SpecError) as info:
        ex.read_spec(tmp_path)
    assert info.value.field == "epochs"
    with pytest.raises(SpecError, match="run_dir"):
        ex.read_spec(tmp_path / "missing")


def test_result_round_trip(tmp_path: Path) -> None:
    ex.write_result(tmp_path, _update(), 96, 3, {"train_loss": 0.5}, [0.9, 0.7, 0.5])
    result = ex.read_result(tmp_path)
    assert result.num_examples == 96 and result.steps == 3
    assert result.metrics == {"train_loss": 0.5}
    assert result.losses == pytest.approx([0.9, 0.7, 0.5])
    assert all(np.array_equal(result.update[k], v) for k, v in _update().items())


def test_nan_update_is_refused_before_writing(tmp_path: Path) -> None:
    update = _update()
    update["layer.bias"][1] = np.nan
    with pytest.raises(NonFiniteUpdateError) as info:
        ex.write_result(tmp_path, update, 1, 1, {}, [])
    assert info.value.parameter == "layer.bias" and info.value.count == 1
    assert not any(tmp_path.iterdir())


def test_tampered_update_fails_its_digest(tmp_path: Path) -> None:
    ex.write_result(tmp_path, _update(), 1, 1, {}, [])
    other = _update()
    other["layer.bias"][0] = 9.0
    (tmp_path / ex.UPDATE_FILE).write_bytes(ex.npz_bytes(other))
    with pytest.raises(JobFailedError, match="digest"):
        ex.read_result(tmp_path)


def test_reading_a_nan_update_is_refused_even_with_a_good_digest(tmp_path: Path) -> None:
    ex.write_result(tmp_path, _update(), 1, 1, {}, [])
    bad = _update()
    bad["layer.weight"][0, 0] = np.inf
    blob = ex.npz_bytes(bad)
    (tmp_path / ex.UPDATE_FILE).write_bytes(blob)
    meta = json.loads((tmp_path / ex.RESULT_FILE).read_text())
    meta["update_sha256"] = hashlib.sha256(blob).hexdigest()
    (tmp_path / ex.RESULT_FILE).write_text(json.dumps(meta))
    with pytest.raises(NonFiniteUpdateError, match=r"layer\.weight"):
        ex.read_result(tmp_path)


def test_missing_result_is_a_failed_job(tmp_path: Path) -> None:
    with pytest.raises(JobFailedError, match=ex.RESULT_FILE):
        ex.read_result(tmp_path)


@pytest.mark.parametrize(
    "error",
    [
        SpecError("tp", "task 'tabular' does not support tensor parallelism"),
        ShapeMismatchError("net.0.weight", "global model has shape (5, 30)"),
        NonFiniteUpdateError("net.2.bias", 3),
    ],
    ids=["spec", "shape", "nonfinite"],
)
def test_job_errors_cross_the_run_dir_intact(tmp_path: Path, error: Exception) -> None:
    ex.write_error(tmp_path, error)
    with pytest.raises(type(error)) as info:
        ex.read_result(tmp_path)
    assert str(info.value) == str(error)


def test_unexpected_job_error_becomes_job_failed(tmp_path: Path) -> None:
    ex.write_error(tmp_path, RuntimeError("boom"))
    with pytest.raises(JobFailedError, match="RuntimeError: boom"):
        ex.read_result(tmp_path)


def test_clear_outputs_removes_an_old_result(tmp_path: Path) -> None:
    ex.write_result(tmp_path, _update(), 1, 1, {}, [])
    ex.write_error(tmp_path, SpecError("tp", "x"))
    ex.clear_outputs(tmp_path)
    assert not any(tmp_path.iterdir())


def test_check_shapes_names_the_parameter() -> None:
    ref = {"a": (2, 3), "b": (2,)}
    ex.check_shapes({"a": np.zeros((2, 3)), "b": np.zeros(2)}, ref)
    with pytest.raises(ShapeMismatchError, match=r"'b'.*missing"):
        ex.check_shapes({"a": np.zeros((2, 3))}, ref)
    with pytest.raises(ShapeMismatchError, match="'c'"):
        ex.check_shapes({"a": np.zeros((2, 3)), "b": np.zeros(2), "c": np.zeros(1)}, ref)
    with pytest.raises(ShapeMismatchError, match=r"'a'.*\(3, 2\)"):
        ex.check_shapes({"a": np.zeros((3, 2)), "b": np.zeros(2)}, ref)


def test_global_model_with_nan_is_not_written(tmp_path: Path) -> None:
    bad = _update()
    bad["layer.weight"][1, 2] = -np.inf
    with pytest.raises(NonFiniteUpdateError, match="global model"):
        ex.write_inputs(tmp_path, LocalJobSpec(task="tabular"), bad)
    assert not (tmp_path / ex.GLOBAL_FILE).exists()


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_single_host_command_uses_loopback_rendezvous(tmp_path: Path) -> None:
    spec = LocalJobSpec(task="gpt", dp_shard=2, tp=2, batch_size=8)
    cmd = torchrun_command(spec, tmp_path, LaunchConfig())
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert _flag(cmd, "--nproc-per-node") == "4" and _flag(cmd, "--nnodes") == "1"
    host, port = _flag(cmd, "--rdzv-endpoint").split(":")
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    assert _flag(cmd, "--local-addr") == "127.0.0.1"
    assert cmd[cmd.index("-m", 3) + 1] == "org_node.training.job"
    assert _flag(cmd, "--run-dir") == str(tmp_path)


def test_multi_host_command_splits_the_world(tmp_path: Path) -> None:
    spec = LocalJobSpec(task="gpt", dp_replicate=2, dp_shard=2, tp=2, batch_size=8)
    config = LaunchConfig(nnodes=2, rdzv_endpoint="head.example:29400", rdzv_id="run7-r3")
    cmd = torchrun_command(spec, tmp_path, config)
    assert _flag(cmd, "--nnodes") == "2" and _flag(cmd, "--nproc-per-node") == "4"
    assert _flag(cmd, "--rdzv-endpoint") == "head.example:29400"
    assert _flag(cmd, "--rdzv-id") == "run7-r3"
    assert "--local-addr" not in cmd


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"nnodes": 2}, "rdzv_endpoint"), ({"nnodes": 0}, "nnodes"), ({"timeout_s": 0}, "timeout_s")],
)
def test_bad_launch_config_names_the_field(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(SpecError) as info:
        LaunchConfig(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_world_must_split_over_hosts(tmp_path: Path) -> None:
    spec = LocalJobSpec(task="gpt", dp_shard=3, batch_size=9)
    with pytest.raises(SpecError) as info:
        torchrun_command(spec, tmp_path, LaunchConfig(nnodes=2, rdzv_endpoint="h:1"))
    assert info.value.field == "nnodes"


def test_cuda_needs_a_gpu_per_rank(tmp_path: Path) -> None:
    spec = LocalJobSpec(task="gpt", dp_shard=2, batch_size=8, device="cuda")
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU per rank")
    with pytest.raises(SpecError) as info:
        torchrun_command(spec, tmp_path, LaunchConfig())
    assert info.value.field == "device"
    assert "NCCL" in str(info.value)
