"""The bundled ``tabular`` task: an org's own CSV or Parquet table, federated moments."""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from sklearn.datasets import load_breast_cancer
from torch import nn

import org_node.tasks.tabular as tabular
from org_node.datasets import DatasetBinding, DataSpec, inspect_table
from org_node.tasks import BUILTIN_TASKS, Task, TaskContext, TaskError, load_task
from org_node.tasks.tabular import TabularModel, task

Scalar = bool | int | float | str
FEATURES = [f"x{i}" for i in range(30)]
LABELS = ("malignant", "benign")  # scikit-learn's target 0 and 1


def _breast_cancer() -> tuple[np.ndarray, np.ndarray]:
    x, y = load_breast_cancer(return_X_y=True)
    return np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.int64)


def _write_csv(path: Path, columns: Mapping[str, Sequence[Any]]) -> Path:
    names = list(columns)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(names)
        for row in zip(*(columns[n] for n in names), strict=True):
            writer.writerow(["" if v is None else v for v in row])
    return path


def _write_parquet(path: Path, columns: Mapping[str, Sequence[Any]]) -> Path:
    pq.write_table(pa.table({k: list(v) for k, v in columns.items()}), path)
    return path


def _org_table(x: np.ndarray, y: np.ndarray) -> dict[str, Sequence[Any]]:
    table: dict[str, Sequence[Any]] = {
        n: [float(v) for v in x[:, j]] for j, n in enumerate(FEATURES)
    }
    table["diagnosis"] = [LABELS[int(v)] for v in y]
    return table


def _binding(path: Path, name: str = "clinic") -> DatasetBinding:
    try:
        columns, rows = inspect_table(path)
    except Exception:  # an unreadable file is bound as it was before it broke
        columns, rows = {}, 0
    return DatasetBinding(1, name, str(path), "table", columns, rows, "0" * 64)


def _context(
    path: Path | None,
    config: Mapping[str, Scalar] | None = None,
    columns: Mapping[str, str] | None = None,
    statistics: np.ndarray | None = None,
) -> TaskContext:
    cfg: dict[str, Scalar] = {"target": "diagnosis", "classes": ",".join(LABELS)}
    cfg.update(config or {})
    spec_columns = dict(columns) if columns is not None else {n: "float" for n in FEATURES}
    if columns is None:
        spec_columns["diagnosis"] = "str"
    return TaskContext(
        dataset=None if path is None else _binding(path),
        data=DataSpec(kind="table", columns=spec_columns),
        run_config=cfg,
        statistics=statistics,
    )


def _with_statistics(context: TaskContext, *tasks: Task) -> TaskContext:
    """``context`` given the sum of ``tasks``' statistics (what secure aggregation returns)."""
    vectors = [t.statistics() for t in tasks if t.statistics is not None]
    return replace(context, statistics=np.sum(vectors, axis=0))


def _raw(context: TaskContext) -> tuple[np.ndarray, np.ndarray]:
    """The org's training and held-out features, unstandardised (float64 via float32)."""
    raw = task(replace(context, run_config={**context.run_config, "standardize": False}))
    data = raw.build_data()
    return data.inputs.double().numpy(), data.eval_inputs.double().numpy()


@pytest.fixture
def two_orgs(tmp_path: Path) -> tuple[Path, Path]:
    """Breast-cancer data split unevenly, sorted by a feature so the orgs differ."""
    x, y = _breast_cancer()
    order = np.argsort(x[:, 0], kind="stable")
    a, b = order[:200], order[200:]
    return (
        _write_csv(tmp_path / "a.csv", _org_table(x[a], y[a])),
        _write_parquet(tmp_path / "b.parquet", _org_table(x[b], y[b])),
    )


# --------------------------------------------------------------------------- model


def test_logreg_is_one_linear_layer(two_orgs: tuple[Path, Path]) -> None:
    model = task(_context(two_orgs[0])).build_model(0)
    assert isinstance(model, TabularModel)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {"net.0.weight": (2, 30), "net.0.bias": (2,)}
    assert model(torch.zeros(5, 30)).shape == (5, 2)


def test_mlp_has_the_configured_hidden_layers(two_orgs: tuple[Path, Path]) -> None:
    ctx = _context(two_orgs[0], {"model": "mlp", "hidden": 8, "layers": 3, "classes": 4})
    model = task(ctx).build_model(0)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(30, 8), (8, 8), (8, 8), (8, 4)]
    default = task(_context(two_orgs[0], {"model": "mlp"})).build_model(0)
    shapes = [tuple(m.weight.shape) for m in default.modules() if isinstance(m, nn.Linear)]
    assert shapes == [(32, 30), (32, 32), (2, 32)]


def test_build_model_depends_on_the_seed_only(two_orgs: tuple[Path, Path]) -> None:
    t_a, t_b = task(_context(two_orgs[0])), task(_context(two_orgs[1]))
    a, b, c = t_a.build_model(3), t_b.build_model(3), t_a.build_model(4)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.state_dict()["net.0.weight"], c.state_dict()["net.0.weight"])


# --------------------------------------------------------------------------- statistics


def test_statistics_are_n_sums_and_sums_of_squares(tmp_path: Path) -> None:
    x, y = _breast_cancer()
    path = _write_csv(tmp_path / "org.csv", _org_table(x[:150], y[:150]))
    everything = task(_context(path, {"holdout": 0.0})).statistics
    assert everything is not None
    vec = everything()
    assert vec.dtype == np.float64 and vec.shape == (1 + 2 * 30,)
    assert vec[0] == 150
    np.testing.assert_allclose(vec[1:31], x[:150].sum(axis=0), rtol=1e-12)
    np.testing.assert_allclose(vec[31:], (x[:150] ** 2).sum(axis=0), rtol=1e-12)

    ctx = _context(path, {"holdout": 0.2})
    held = task(ctx).statistics
    assert held is not None
    train, evald = _raw(ctx)
    vec = held()
    assert vec[0] == len(train) == 120 and len(evald) == 30
    np.testing.assert_allclose(vec[1:31], train.sum(axis=0), rtol=1e-6)
    np.testing.assert_allclose(vec[31:], (train**2).sum(axis=0), rtol=1e-6)


def test_two_orgs_standardise_with_the_global_moments(two_orgs: tuple[Path, Path]) -> None:
    ctx_a, ctx_b = _context(two_orgs[0]), _context(two_orgs[1])
    tasks = task(ctx_a), task(ctx_b)
    (tr_a, ev_a), (tr_b, ev_b) = _raw(ctx_a), _raw(ctx_b)
    union = np.concatenate([tr_a, tr_b])
    mean, std = union.mean(axis=0), union.std(axis=0) + 1e-8  # population std
    assert not np.allclose(tr_a.mean(axis=0), mean, rtol=0.05)  # the orgs do differ

    for ctx, (train, held) in ((ctx_a, (tr_a, ev_a)), (ctx_b, (tr_b, ev_b))):
        data = task(_with_statistics(ctx, *tasks)).build_data()
        np.testing.assert_allclose(data.inputs.numpy(), (train - mean) / std, atol=1e-4)
        np.testing.assert_allclose(data.eval_inputs.numpy(), (held - mean) / std, atol=1e-4)
    both = np.concatenate(
        [task(_with_statistics(c, *tasks)).build_data().inputs.numpy() for c in (ctx_a, ctx_b)]
    )
    np.testing.assert_allclose(both.mean(axis=0), 0.0, atol=1e-4)
    np.testing.assert_allclose(both.std(axis=0), 1.0, atol=1e-4)


def test_standardize_needs_the_federations_statistics(two_orgs: tuple[Path, Path]) -> None:
    ctx = _context(two_orgs[0])
    with pytest.raises(TaskError, match="feature statistics are not available yet"):
        task(ctx).build_data()
    with pytest.raises(TaskError, match=r"statistics: expected 61 values"):
        task(replace(ctx, statistics=np.ones(7))).build_data()


def test_without_standardize_there_are_no_statistics(two_orgs: tuple[Path, Path]) -> None:
    ctx = _context(two_orgs[0], {"standardize": False, "holdout": 0.0})
    t = task(ctx)
    assert t.statistics is None
    x, _ = _breast_cancer()
    inputs = t.build_data().inputs.numpy()
    np.testing.assert_allclose(np.sort(inputs[:, 0]), np.sort(x[:, 0])[:200], rtol=1e-6)


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("model", ["logreg", "mlp"])
def test_a_few_sgd_steps_lower_the_loss(two_orgs: tuple[Path, Path], model: str) -> None:
    ctx = _context(two_orgs[1], {"model": model})
    t = task(_with_statistics(ctx, task(ctx)))
    data = t.build_data()
    net = t.build_model(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    losses = []
    for _ in range(20):
        loss = t.loss(net(data.inputs), data.targets)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    with torch.no_grad():
        accuracy = t.metrics(net(data.eval_inputs), data.eval_targets)["accuracy"]
    assert 0.0 <= accuracy <= 1.0
    assert data.labels is not None
    assert np.array_equal(data.labels, data.targets.numpy())


def test_load_task_by_name_and_reference(two_orgs: tuple[Path, Path]) -> None:
    ctx = _context(two_orgs[0])
    for ref in ("tabular", BUILTIN_TASKS["tabular"]):
        t = load_task(ref, ctx)
        assert t.name == "tabular" and t.statistics is not None
    with pytest.raises(TaskError, match="dataset"):
        load_task("tabular")


# --------------------------------------------------------------------------- data


def test_features_default_to_the_data_spec_columns(tmp_path: Path) -> None:
    path = _write_csv(
        tmp_path / "t.csv",
        {"a": [1, 2, 3, 4], "label": [0, 1, 1, 0], "extra": [9, 9, 9, 9], "b": [5, 6, 7, 8]},
    )
    columns = {"b": "float", "label": "int", "a": "number"}
    ctx = _context(path, {"target": "label", "classes": 2, "holdout": 0.0}, columns=columns)
    assert tabular.parse_config(ctx).features == ("b", "a")
    t = task(replace(ctx, run_config={**ctx.run_config, "standardize": False}))
    data = t.build_data()
    assert data.inputs.tolist() == [[5, 1], [6, 2], [7, 3], [8, 4]]
    assert data.targets.tolist() == [0, 1, 1, 0]
    assert tuple(t.build_model(0).state_dict()["net.0.weight"].shape) == (2, 2)
    explicit: dict[str, Scalar] = {"target": "label", "classes": 2, "features": "extra, a"}
    assert tabular.parse_config(replace(ctx, run_config=explicit)).features == ("extra", "a")


def test_parquet_and_csv_give_the_same_data(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    table: dict[str, Sequence[Any]] = {
        "age": [int(v) for v in rng.integers(20, 80, 60)],
        "dose": [float(v) for v in rng.normal(size=60)],
        "smoker": [bool(v) for v in rng.integers(0, 2, 60)],
        "outcome": [["none", "mild", "severe"][int(v)] for v in rng.integers(0, 3, 60)],
    }
    results = []
    for path in (
        _write_csv(tmp_path / "t.csv", table),
        _write_parquet(tmp_path / "t.parquet", table),
    ):
        ctx = _context(path, {"target": "outcome", "classes": "none,mild,severe"}, columns={})
        ctx = replace(ctx, run_config={**ctx.run_config, "features": "age,dose,smoker"})
        vec = task(ctx).statistics()  # type: ignore[misc]
        results.append((vec, task(replace(ctx, statistics=vec)).build_data()))
    (vec_c, csv_data), (vec_p, pq_data) = results
    np.testing.assert_array_equal(vec_c, vec_p)
    for field in ("inputs", "targets", "eval_inputs", "eval_targets"):
        assert torch.equal(getattr(csv_data, field), getattr(pq_data, field)), field
    assert np.array_equal(csv_data.labels, pq_data.labels)  # type: ignore[arg-type]
    assert set(torch.unique(csv_data.targets).tolist()) <= {0, 1, 2}


def test_booleans_become_zero_and_one_and_a_bool_target_needs_no_classes(tmp_path: Path) -> None:
    table: dict[str, Sequence[Any]] = {
        "flag": ["true", "False", "TRUE", "false"],
        "sick": [True, False, True, True],
    }
    for path in (
        _write_csv(tmp_path / "b.csv", table),
        _write_parquet(
            tmp_path / "b.parquet",
            {"flag": [True, False, True, False], "sick": [True, False, True, True]},
        ),
    ):
        cfg: dict[str, Scalar] = {"target": "sick", "features": "flag", "holdout": 0.0}
        ctx = TaskContext(dataset=_binding(path), run_config={**cfg, "standardize": False})
        assert tabular.parse_config(ctx).classes == ("false", "true")
        data = task(ctx).build_data()
        assert data.inputs.flatten().tolist() == [1.0, 0.0, 1.0, 0.0]
        assert data.targets.tolist() == [1, 0, 1, 1]


def test_a_class_count_matches_integer_labels(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "c.csv", {"v": [0.5, 1.5, 2.5], "y": ["2", "0.0", "1"]})
    for classes in (3, "3", "0,1,2"):
        cfg: dict[str, Scalar] = {"target": "y", "classes": classes, "features": "v"}
        ctx = TaskContext(dataset=_binding(path), run_config={**cfg, "holdout": 0.0})
        assert task(replace(ctx, statistics=np.ones(3))).build_data().targets.tolist() == [2, 0, 1]


def test_the_split_is_deterministic_and_seeded(two_orgs: tuple[Path, Path]) -> None:
    def held(seed: int) -> np.ndarray:
        return _raw(_context(two_orgs[0], {"split_seed": seed}))[1]

    assert np.array_equal(held(0), held(0))
    assert not np.array_equal(held(0), held(1))
    assert len(held(0)) == 40
    train, evald = _raw(_context(two_orgs[0], {"holdout": 0.0}))
    assert len(train) == 200 and len(evald) == 0


def test_parsed_tables_are_cached_per_file_and_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    real = tabular._read_csv

    def counting(path: Path, label: str, columns: tuple[str, ...]) -> dict[str, list[str]]:
        calls.append(path)
        return real(path, label, columns)

    monkeypatch.setattr(tabular, "_read_csv", counting)
    path = _write_csv(tmp_path / "k.csv", {"v": [1, 2, 3, 4, 5], "y": [0, 1, 0, 1, 0]})
    ctx = _context(path, {"target": "y", "classes": 2, "features": "v"})
    t = task(ctx)
    stats = t.statistics()  # type: ignore[misc]
    t2 = task(replace(ctx, statistics=stats, run_config={**ctx.run_config, "model": "mlp"}))
    t2.build_data()
    t2.build_data()
    assert len(calls) == 1
    task(replace(ctx, run_config={**ctx.run_config, "split_seed": 5})).statistics()  # type: ignore[misc]
    assert len(calls) == 2
    _write_csv(path, {"v": [1, 2, 3, 4, 5, 6], "y": [0, 1, 0, 1, 0, 1]})
    assert t.statistics()[0] == 5  # type: ignore[misc]  # 6 rows, 1 held out
    assert len(calls) == 3


# --------------------------------------------------------------------------- refusals


def _refusal(tmp_path: Path, case: str) -> tuple[TaskContext, str]:
    good: dict[str, Sequence[Any]] = {
        "v": [1.0, 2.0, 3.0, 4.0],
        "w": [0.5, 0.5, 1.5, 2.0],
        "y": ["a", "b", "a", "b"],
    }
    cfg: dict[str, Scalar] = {"target": "y", "classes": "a,b", "features": "v,w"}
    path: Path = _write_csv(tmp_path / "good.csv", good)
    want: str
    if case == "no dataset":
        return TaskContext(run_config=cfg), "dataset"
    if case == "missing file":
        path, want = tmp_path / "gone.csv", "dataset 'clinic'"
    elif case == "not utf-8":
        path, want = tmp_path / "latin.csv", "not UTF-8"
        path.write_bytes("v,w,y\n1,2,\xe9\n".encode("latin-1"))
    elif case == "not parquet":
        path, want = tmp_path / "junk.parquet", "not a readable Parquet file"
        path.write_bytes(b"definitely not parquet")
    elif case == "missing target":
        cfg["target"], want = "outcome", "column 'outcome' is missing"
    elif case == "missing feature":
        cfg["features"], want = "v,height", "column 'height' is missing"
    elif case == "missing parquet feature":
        path = _write_parquet(tmp_path / "p.parquet", good)
        cfg["features"], want = "v,height", "column 'height' is missing"
    elif case == "non-numeric":
        path = _write_csv(tmp_path / "n.csv", {**good, "w": [0.5, 1, "high", 2]})
        want = "column 'w', row 3: the value is not numeric"
    elif case == "empty value":
        path = _write_csv(tmp_path / "e.csv", {**good, "v": [1, 2, 3, ""]})
        want = "column 'v', row 4: empty feature value"
    elif case == "null parquet value":
        path = _write_parquet(tmp_path / "null.parquet", {**good, "w": [0.5, None, 1.0, 2.0]})
        want = "column 'w', row 2: empty feature value"
    elif case == "not finite":
        path = _write_csv(tmp_path / "i.csv", {**good, "v": [1, "inf", 3, 4]})
        want = "column 'v', row 2"
    elif case == "unknown label":
        path = _write_csv(tmp_path / "l.csv", {**good, "y": ["a", "b", "c", "a"]})
        want = "column 'y', row 3: a label that is not among classes (a, b)"
    elif case == "empty label":
        path = _write_parquet(tmp_path / "l.parquet", {**good, "y": ["a", None, "b", "a"]})
        want = "column 'y', row 2: empty label"
    else:
        raise AssertionError(case)
    return TaskContext(dataset=_binding(path), run_config=cfg, statistics=np.ones(5)), want


@pytest.mark.parametrize(
    "case",
    [
        "no dataset",
        "missing file",
        "not utf-8",
        "not parquet",
        "missing target",
        "missing feature",
        "missing parquet feature",
        "non-numeric",
        "empty value",
        "null parquet value",
        "not finite",
        "unknown label",
        "empty label",
    ],
)
def test_bad_data_is_refused_naming_the_column(tmp_path: Path, case: str) -> None:
    ctx, want = _refusal(tmp_path, case)
    with pytest.raises(TaskError) as info:
        t = task(ctx)
        t.build_data()
    assert want in str(info.value)
    assert "\n" not in str(info.value)
    if case not in ("no dataset",):
        with pytest.raises(TaskError, match=want.split(":")[0]):
            t.statistics()  # type: ignore[misc]  # the statistics read the same file


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"target": ""}, "target"),
        ({"classes": None}, "classes"),
        ({"classes": "a"}, "classes"),
        ({"classes": 1}, "classes"),
        ({"classes": "a,a"}, "classes"),
        ({"features": "v,,w"}, "features"),
        ({"features": "v,y"}, "features"),
        ({"model": "forest"}, "model"),
        ({"model": "mlp", "hidden": 0}, "hidden"),
        ({"model": "mlp", "layers": "two"}, "layers"),
        ({"holdout": 0.7}, "holdout"),
        ({"holdout": True}, "holdout"),
        ({"split_seed": -1}, "split_seed"),
        ({"standardize": "maybe"}, "standardize"),
    ],
)
def test_bad_config_is_refused_naming_the_key(
    tmp_path: Path, config: dict[str, Scalar | None], key: str
) -> None:
    path = _write_csv(tmp_path / "t.csv", {"v": [1, 2], "w": [3, 4], "y": ["a", "b"]})
    cfg: dict[str, Scalar] = {"target": "y", "classes": "a,b", "features": "v,w"}
    for k, v in config.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    with pytest.raises(TaskError, match=rf"^{key}:"):
        task(TaskContext(dataset=_binding(path), run_config=cfg))


def test_no_feature_at_all_is_refused(tmp_path: Path) -> None:
    path = _write_csv(tmp_path / "t.csv", {"v": [1, 2], "y": ["a", "b"]})
    cfg: dict[str, Scalar] = {"target": "y", "classes": "a,b"}
    for data in (None, DataSpec(kind="table", columns={"y": "str"})):
        with pytest.raises(TaskError, match=r"^features:"):
            task(TaskContext(dataset=_binding(path), data=data, run_config=cfg))
