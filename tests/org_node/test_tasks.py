"""Bundled tasks, the task registry, and the in-process (world size 1) local job."""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.datasets import load_breast_cancer
from torch import nn

from org_node.datasets import DatasetBinding, DataSpec, inspect_table
from org_node.tasks import (
    BUILTIN_TASKS,
    PipelineModel,
    Task,
    TaskContext,
    TaskData,
    TaskError,
    TensorParallelModel,
    UnknownTaskError,
    evaluate,
    initial_state,
    load_task,
)
from org_node.tasks.breast_cancer import accuracy_metrics, cross_entropy
from org_node.tasks.gpt import CORPUS, VOCAB, CharGPT, GPTConfig, decode, encode
from org_node.training import (
    LocalJobSpec,
    NonFiniteUpdateError,
    ShapeMismatchError,
    SpecError,
    run_local_job,
)
from org_node.training.exchange import RESULT_FILE, UPDATE_FILE


def nan_task() -> Task:
    """A task whose training drives every weight to NaN: its update must never be sent."""
    base = load_task("breast_cancer")

    def poisoned_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy(outputs, targets) * float("nan")

    return Task("nan", base.build_model, base.build_data, poisoned_loss, accuracy_metrics)


def not_a_task() -> str:
    return "nothing"


def _context(name: str, tmp_path: Path) -> TaskContext | None:
    """What a bundled task needs: for ``tabular``, an org's table and the federation's sum."""
    if name != "tabular":
        return None
    x, y = load_breast_cancer(return_X_y=True)
    path = tmp_path / "org.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([*(f"x{i}" for i in range(x.shape[1])), "diagnosis"])
        writer.writerows(
            [*row, ("malignant", "benign")[label]] for row, label in zip(x, y, strict=True)
        )
    columns, rows = inspect_table(path)
    context = TaskContext(
        dataset=DatasetBinding(1, "org", str(path), "table", columns, rows, "0" * 64),
        data=DataSpec(kind="table", columns=columns),
        run_config={"target": "diagnosis", "classes": "malignant,benign", "model": "mlp"},
    )
    task = load_task("tabular", context)
    assert task.statistics is not None
    return replace(context, statistics=task.statistics())


def test_bundled_names() -> None:
    assert sorted(BUILTIN_TASKS) == ["breast_cancer", "digits", "gpt", "tabular"]


@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_bundled_tasks_load_by_name_and_reference(name: str, tmp_path: Path) -> None:
    context = _context(name, tmp_path)
    by_name = load_task(name, context)
    by_ref = load_task(BUILTIN_TASKS[name], context)
    assert by_name.name == by_ref.name == name
    data = by_name.build_data()
    assert isinstance(data, TaskData) and len(data) > 100
    with torch.no_grad():
        out = by_name.build_model(0)(data.inputs[:4])
    loss = by_name.loss(out, data.targets[:4])
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert 0.0 <= by_name.metrics(out, data.targets[:4])["accuracy"] <= 1.0


@pytest.mark.parametrize(
    "ref",
    ["no_such_task", "org_node.tasks.nowhere:task", "org_node.tasks.tabular:nope", ":task"],
)
def test_unknown_task_is_refused(ref: str) -> None:
    with pytest.raises(UnknownTaskError, match=r"^task:"):
        load_task(ref)


def test_callable_must_return_a_task() -> None:
    with pytest.raises(UnknownTaskError, match=r"expected org_node\.tasks\.Task"):
        load_task(f"{__name__}:not_a_task")


def test_initial_state_depends_on_the_seed_only() -> None:
    a, b, c = initial_state("digits", 1), initial_state("digits", 1), initial_state("digits", 2)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not all(np.array_equal(a[k], c[k]) for k in a)
    assert all(v.dtype == np.float32 for v in a.values())


def test_tabular_needs_a_bound_dataset() -> None:
    with pytest.raises(TaskError, match="dataset"):
        load_task("tabular")


def test_labels_exist_for_classification_only(tmp_path: Path) -> None:
    assert load_task("tabular", _context("tabular", tmp_path)).build_data().labels is not None
    assert load_task("breast_cancer").build_data().labels is not None
    assert load_task("digits").build_data().labels is not None
    assert load_task("gpt").build_data().labels is None


def test_corpus_is_shipped_and_in_vocabulary() -> None:
    text = CORPUS.read_text(encoding="utf-8")
    # long enough that the model does not learn it by heart within a benchmark's rounds
    assert len(text) > 50_000
    assert set(text) <= set(VOCAB)
    assert decode(encode(text)) == text
    assert decode(encode("caf\u00e9")) == "caf?"


def test_gpt_supports_tensor_and_pipeline_parallelism() -> None:
    model = CharGPT(GPTConfig(n_layers=3))
    assert isinstance(model, TensorParallelModel) and isinstance(model, PipelineModel)
    names = dict(model.named_modules())
    plan = model.tensor_parallel_plan()
    assert len(plan) == 3 * 7 and all(fqn in names for fqn in plan)
    assert not isinstance(load_task("breast_cancer").build_model(0), TensorParallelModel)


def test_gpt_pipeline_stages_partition_the_model_and_compose() -> None:
    torch.manual_seed(0)
    model = CharGPT(GPTConfig(n_layers=3))
    stages = [model.pipeline_stage(i, 3) for i in range(3)]
    keys = [set(s.state_dict()) for s in stages]
    assert set().union(*keys) == set(model.state_dict())
    assert sum(len(k) for k in keys) == len(model.state_dict())
    for stage, stage_keys in zip(stages, keys, strict=True):
        for key in stage_keys:
            assert torch.equal(stage.state_dict()[key], model.state_dict()[key])
    x = torch.randint(len(VOCAB), (2, 16))
    with torch.no_grad():
        h = x
        for stage in stages:
            h = stage(h)
        assert torch.allclose(h, model(x), atol=1e-6)
    with pytest.raises(ValueError, match="pp"):
        model.pipeline_stage(0, 4)


def test_evaluate_reports_loss_and_accuracy() -> None:
    metrics = evaluate("breast_cancer", initial_state("breast_cancer"))
    assert set(metrics) == {"loss", "accuracy"}
    assert 0.3 < metrics["loss"] < 2.0


def _job(task: str = "breast_cancer", **kw: object) -> LocalJobSpec:
    fields: dict[str, object] = {"task": task, "local_steps": 15, "batch_size": 32, "lr": 3e-3}
    fields.update(kw)
    return LocalJobSpec.from_dict(fields)


def test_in_process_job_trains_and_returns_an_update(tmp_path: Path) -> None:
    global_state = initial_state("breast_cancer")
    result = run_local_job(_job(), global_state, tmp_path / "run")
    assert result.steps == 15 and result.num_examples == 15 * 32
    assert set(result.update) == set(global_state)
    assert all(
        v.dtype == np.float32 and v.shape == global_state[k].shape for k, v in result.update.items()
    )
    assert len(result.losses) == 15 and result.losses[-1] < result.losses[0]
    assert result.metrics["eval_accuracy"] > 0.8
    assert result.metrics["world_size"] == 1.0
    # the same spec and global model give the same update
    again = run_local_job(_job(), tmp_path / "run" / "global.npz", tmp_path / "again")
    assert all(np.array_equal(result.update[k], again.update[k]) for k in global_state)


def test_partitioned_job_sees_only_its_share(tmp_path: Path) -> None:
    spec = _job(num_partitions=3, partition_index=1, dirichlet_alpha=0.5, local_steps=2)
    result = run_local_job(spec, initial_state("breast_cancer"), tmp_path)
    assert 0 < result.metrics["partition_size"] < 455


def test_time_budget_stops_the_job(tmp_path: Path) -> None:
    spec = _job(local_steps=None, time_budget_s=0.2, evaluate=False)
    result = run_local_job(spec, initial_state("breast_cancer"), tmp_path)
    assert result.steps >= 1
    assert len(result.losses) == result.steps


def test_proximal_term_shrinks_the_update(tmp_path: Path) -> None:
    g = initial_state("digits")
    plain = run_local_job(_job("digits", optimizer="sgd", lr=0.5), g, tmp_path / "a")
    prox = run_local_job(_job("digits", optimizer="sgd", lr=0.5, prox_mu=1.0), g, tmp_path / "b")

    def norm(u: dict[str, np.ndarray]) -> float:
        return float(np.sqrt(sum(float((v**2).sum()) for v in u.values())))

    assert norm(prox.update) < norm(plain.update)


def test_unknown_task_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        run_local_job(_job("no_such_task"), initial_state("breast_cancer"), tmp_path)
    assert info.value.field == "task"
    assert not (tmp_path / "spec.json").exists()


def test_mismatched_global_model_names_the_parameter(tmp_path: Path) -> None:
    state = initial_state("breast_cancer")
    state["net.0.weight"] = np.zeros((5, 30), dtype=np.float32)
    with pytest.raises(ShapeMismatchError) as info:
        run_local_job(_job(), state, tmp_path)
    assert info.value.parameter == "net.0.weight"
    state = initial_state("breast_cancer")
    del state["net.4.bias"]
    with pytest.raises(ShapeMismatchError, match=r"net\.4\.bias"):
        run_local_job(_job(), state, tmp_path)


def test_nan_in_global_model_is_refused(tmp_path: Path) -> None:
    state = initial_state("breast_cancer")
    state["net.2.bias"][3] = np.inf
    with pytest.raises(NonFiniteUpdateError, match=r"net\.2\.bias"):
        run_local_job(_job(), state, tmp_path)


@pytest.mark.parametrize(
    ("task", "kw", "field"),
    [
        ("breast_cancer", {"tp": 2}, "tp"),
        ("digits", {"pp": 2}, "pp"),
        ("gpt", {"pp": 8, "batch_size": 64}, "pp"),
    ],
)
def test_unsupported_parallelism_names_the_degree(
    tmp_path: Path, task: str, kw: dict[str, int], field: str
) -> None:
    with pytest.raises(SpecError) as info:
        run_local_job(_job(task, **kw), initial_state(task), tmp_path)
    assert info.value.field == field


def test_nan_update_is_never_sent(tmp_path: Path) -> None:
    spec = _job(f"{__name__}:nan_task", local_steps=2)
    with pytest.raises(NonFiniteUpdateError) as info:
        run_local_job(spec, initial_state("breast_cancer"), tmp_path)
    assert info.value.parameter.startswith("net.")
    assert not (tmp_path / UPDATE_FILE).exists()
    assert not (tmp_path / RESULT_FILE).exists()


@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_tasks_build_models_on_cpu(name: str, tmp_path: Path) -> None:
    model = load_task(name, _context(name, tmp_path)).build_model(0)
    assert isinstance(model, nn.Module)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_a_job_whose_work_tree_was_wiped_does_not_bring_it_back(tmp_path: Path) -> None:
    """A worker outlives its killed node until it notices; if the node's data directory
    is wiped meanwhile, the round it was training fails rather than recreating the
    directory (which would then block ``fedweave recover``: "not empty")."""
    from org_node.training import LocalJobSpec
    from org_node.training.exchange import atomic_write
    from org_node.training.job import DistEnv, train_round

    node_dir = tmp_path / "hosp2"
    run_dir = node_dir / "runs" / "key" / "worker" / "round-000008"
    with pytest.raises(FileNotFoundError):
        atomic_write(run_dir / "update.npz", b"x")
    task = load_task("breast_cancer")
    spec = LocalJobSpec(task="breast_cancer", local_steps=1, batch_size=8)
    with pytest.raises(FileNotFoundError):
        train_round(spec, initial_state(task, seed=0), run_dir, DistEnv(), task=task)
    assert not node_dir.exists()
