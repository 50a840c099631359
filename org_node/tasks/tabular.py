"""Logistic regression or an MLP on the org's own CSV or Parquet table (bundled as ``tabular``).

The common cross-silo case without code: each org binds a table to the run, and this
task trains on it. Its settings are the run spec's ``config`` keys (the same at every
org, so every org builds the same model):

- ``target`` (required): the label column.
- ``features``: the feature columns, comma-separated; by default the run spec's
  ``data.columns`` without ``target``, in that order (never this org's own columns).
- ``model``: ``logreg`` (default: one linear layer) or ``mlp`` (``layers`` hidden
  layers of ``hidden`` units with ReLU; defaults 2 and 32).
- ``classes``: the class labels, comma-separated (``benign,malignant``, ``0,1,2``),
  compared as strings against the target's values (``1.0`` also matches ``1``, ``True``
  ``true``); or an integer C for the labels ``0..C-1``. Required unless the target
  column is ``bool`` (then ``false,true``).
- ``holdout`` (in [0, 0.5], default 0.2): the share of this org's rows held out, by a
  permutation seeded with ``split_seed`` (default 0), for the ``eval_*`` metrics
  (with 0 no row is held out and those metrics are NaN); the rest are trained on.
- ``standardize`` (default true): features are standardised with the *federation's*
  mean and population standard deviation (+1e-8), derived from the secure sum of every
  org's :attr:`Task.statistics`, ``[n, sum(x_1..x_d), sum(x_1^2..x_d^2)]`` over its
  training rows; no org's own moments are seen in the clear.

Boolean features become 0/1. A missing column, an empty or non-numeric feature value
or a label outside ``classes`` is refused with a :class:`TaskError` naming the column
and the 1-based data row; cell values are never quoted, since the message may leave
the org. Parsed tables are cached per file and settings within the worker process.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from org_node.datasets import DatasetBinding
from org_node.tasks import Task, TaskContext, TaskData, TaskError
from org_node.tasks.breast_cancer import accuracy_metrics, cross_entropy

__all__ = ["TabularConfig", "TabularModel", "parse_config", "task"]

Config = Mapping[str, bool | int | float | str]
_MODELS = ("logreg", "mlp")
_STD_EPS = 1e-8


@dataclass(frozen=True)
class TabularConfig:
    """The run config, checked. ``layers == 0`` for logistic regression."""

    target: str
    features: tuple[str, ...]
    classes: tuple[str, ...]
    layers: int = 0
    hidden: int = 32
    holdout: float = 0.2
    split_seed: int = 0
    standardize: bool = True


class TabularModel(nn.Module):
    """``d -> C`` (``layers == 0``), or ``d -> hidden`` (ReLU) x ``layers`` ``-> C``."""

    def __init__(self, num_features: int, num_classes: int, hidden: int = 32, layers: int = 0):
        super().__init__()
        mods: list[nn.Module] = []
        width = num_features
        for _ in range(layers):
            mods += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        mods.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- config


def _number(cfg: Config, key: str, default: float, kind: type, low: float, high: float) -> Any:
    """``cfg[key]`` as ``kind`` in ``[low, high]`` (a string holding one is accepted)."""
    value = cfg.get(key, default)
    try:
        if isinstance(value, bool) or (kind is int and isinstance(value, float)):
            raise ValueError
        number = kind(value.strip() if isinstance(value, str) else value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise TaskError(f"{key}: expected {what}, got {value!r}") from None
    if not low <= number <= high:
        bound = f">= {low}" if high == math.inf else f"in [{low}, {high}]"
        raise TaskError(f"{key}: must be {bound}, got {value!r}")
    return number


def _bool(cfg: Config, key: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if isinstance(value, bool | int) and value in (0, 1):
        return bool(value)
    raise TaskError(f"{key}: expected true or false, got {value!r}")


def _names(value: str, key: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in value.split(","))
    if any(not n for n in names):
        raise TaskError(f"{key}: empty name in {value!r}")
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise TaskError(f"{key}: {duplicate!r} is listed twice")
    return names


def _classes(cfg: Config, target: str, target_is_bool: bool) -> tuple[str, ...]:
    value = cfg.get("classes")
    if value is None:
        if target_is_bool:
            return ("false", "true")
        raise TaskError(f"classes: required (the labels of column {target!r}, or their count)")
    if isinstance(value, str) and "," not in value:
        try:
            value = int(value.strip())
        except ValueError:
            raise TaskError("classes: a classifier needs at least 2 classes") from None
    if isinstance(value, bool | float):
        raise TaskError(f"classes: expected labels or a class count, got {value!r}")
    if isinstance(value, int):
        if value < 2:
            raise TaskError(f"classes: a classifier needs at least 2 classes, got {value}")
        return tuple(str(i) for i in range(value))
    return _names(value, "classes")


def parse_config(context: TaskContext) -> TabularConfig:
    """The checked settings of ``context.run_config``; TaskError naming the key."""
    cfg = context.run_config
    target = cfg.get("target")
    if not isinstance(target, str) or not target.strip():
        raise TaskError("target: required (the name of the label column)")
    target = target.strip()
    raw_features = cfg.get("features")
    if raw_features is not None:
        if not isinstance(raw_features, str):
            raise TaskError(
                f"features: expected comma-separated column names, got {raw_features!r}"
            )
        features = _names(raw_features, "features")
        if target in features:
            raise TaskError(f"features: the target column {target!r} cannot be a feature")
    else:
        columns = context.data.columns if context.data is not None else {}
        features = tuple(name for name in columns if name != target)
    if not features:
        raise TaskError(
            "features: no feature column: set features, or list the features in the run "
            f"spec's data.columns besides the target {target!r}"
        )
    model = cfg.get("model", "logreg")
    if model not in _MODELS:
        raise TaskError(f"model: must be one of {', '.join(_MODELS)}, got {model!r}")
    spec_types = context.data.columns if context.data is not None else {}
    own_types = context.dataset.columns if context.dataset is not None else {}
    is_bool = "bool" in (spec_types.get(target), own_types.get(target))
    return TabularConfig(
        target=target,
        features=features,
        classes=_classes(cfg, target, is_bool),
        layers=_number(cfg, "layers", 2, int, 1, math.inf) if model == "mlp" else 0,
        hidden=_number(cfg, "hidden", 32, int, 1, math.inf) if model == "mlp" else 32,
        holdout=_number(cfg, "holdout", 0.2, float, 0.0, 0.5),
        split_seed=_number(cfg, "split_seed", 0, int, 0, math.inf),
        standardize=_bool(cfg, "standardize", True),
    )


# --------------------------------------------------------------------------- cells


def _feature_column(values: Sequence[Any], column: str) -> np.ndarray:
    """Numbers (or strings of numbers, or booleans as 0/1) as float64; None/'' refused."""
    try:  # fast path: plain numbers, or strings of them (numpy would take None for NaN)
        if not isinstance(values, np.ndarray) and any(v is None for v in values):
            raise ValueError
        out = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        out = np.empty(len(values), dtype=np.float64)
        for row, value in enumerate(values, start=1):
            out[row - 1] = _feature_cell(value, column, row)
    bad = np.flatnonzero(~np.isfinite(out))
    if bad.size:
        raise TaskError(f"column {column!r}, row {bad[0] + 1}: the value is not a finite number")
    return out


def _feature_cell(value: Any, column: str, row: int) -> float:
    if isinstance(value, bool):
        return float(value)
    text = "" if value is None else str(value).strip()
    if not text:
        raise TaskError(f"column {column!r}, row {row}: empty feature value")
    if text.lower() in ("true", "false"):
        return 1.0 if text.lower() == "true" else 0.0
    try:
        return float(text)
    except ValueError:
        raise TaskError(f"column {column!r}, row {row}: the value is not numeric") from None


def _label_key(value: str, index: Mapping[str, int]) -> int | None:
    if value in index:
        return index[value]
    if value.lower() in ("true", "false"):
        return index.get(value.lower())
    try:
        number = float(value)
    except ValueError:
        return None
    return index.get(str(int(number))) if number.is_integer() else None


def _label_column(values: Sequence[Any], column: str, classes: tuple[str, ...]) -> np.ndarray:
    """Each label's index in ``classes``; TaskError naming the first row that has none."""
    text = np.array(["" if v is None else str(v).strip() for v in values], dtype=str)
    unique, inverse = np.unique(text, return_inverse=True)
    index = {name: i for i, name in enumerate(classes)}
    codes = np.full(len(unique), -1, dtype=np.int64)
    for i, value in enumerate(unique):
        code = _label_key(str(value), index) if value else None
        codes[i] = -1 if code is None else code
    labels = codes[inverse.reshape(-1)]
    bad = np.flatnonzero(labels < 0)
    if bad.size:
        what = "a label that is not among classes (" + ", ".join(classes) + ")"
        row = int(bad[0])
        raise TaskError(f"column {column!r}, row {row + 1}: {what if text[row] else 'empty label'}")
    return labels


# --------------------------------------------------------------------------- files


def _read_csv(path: Path, label: str, columns: tuple[str, ...]) -> dict[str, list[str]]:
    """The raw cells of ``columns``; TaskError naming the column or the row."""
    try:
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = [h.strip() for h in next(reader, [])]
            if not header:
                raise TaskError(f"{label} has no header row")
            missing = next((c for c in columns if c not in header), None)
            if missing is not None:
                raise TaskError(f"column {missing!r} is missing from {label}")
            picks = [header.index(c) for c in columns]
            cells: dict[str, list[str]] = {c: [] for c in columns}
            lists = [cells[c] for c in columns]
            for row, record in enumerate(reader, start=1):
                if len(record) != len(header):
                    raise TaskError(
                        f"{label}: row {row} has {len(record)} fields, the header {len(header)}"
                    )
                for target, i in zip(lists, picks, strict=True):
                    target.append(record[i])
    except UnicodeDecodeError:
        raise TaskError(f"{label} is not UTF-8 text") from None
    except csv.Error as exc:
        raise TaskError(f"{label} is not a readable CSV file: {exc}") from None
    except OSError as exc:
        raise TaskError(f"cannot read {label}: {exc.strerror or 'I/O error'}") from None
    return cells


def _read_parquet(path: Path, label: str, columns: tuple[str, ...]) -> dict[str, Sequence[Any]]:
    """Each of ``columns`` as a numpy array (numbers, booleans) or a list (others)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        names = file.schema_arrow.names
    except Exception:  # pyarrow raises ArrowInvalid, OSError, ...
        raise TaskError(f"{label} is not a readable Parquet file") from None
    missing = next((c for c in columns if c not in names), None)
    if missing is not None:
        raise TaskError(f"column {missing!r} is missing from {label}")
    try:
        table = file.read(columns=list(columns))
    except Exception:
        raise TaskError(f"{label} is not a readable Parquet file") from None
    out: dict[str, Sequence[Any]] = {}
    for name in columns:
        col, t = table.column(name), table.column(name).type
        plain = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
        out[name] = col.to_numpy() if plain and col.null_count == 0 else col.to_pylist()
    return out


@dataclass(frozen=True)
class _Split:
    x_train: np.ndarray
    y_train: np.ndarray
    x_eval: np.ndarray
    y_eval: np.ndarray


def _split_rows(n: int, cfg: TabularConfig, label: str) -> tuple[np.ndarray, np.ndarray]:
    n_eval = round(cfg.holdout * n)
    if cfg.holdout > 0 and n > 1:
        n_eval = max(n_eval, 1)
    if n - n_eval < 1:
        raise TaskError(f"{label} has {n} rows: too few to train on with holdout {cfg.holdout}")
    perm = np.random.default_rng(cfg.split_seed).permutation(n)
    return np.sort(perm[n_eval:]), np.sort(perm[:n_eval])


@lru_cache(maxsize=8)
def _load_split(path: str, _stamp: tuple[int, int], label: str, cfg: TabularConfig) -> _Split:
    """The table's features and labels, split; cached per file version and settings."""
    file = Path(path)
    columns = (*cfg.features, cfg.target)
    suffix = file.suffix.lower()
    cells: Mapping[str, Sequence[Any]]
    if suffix == ".csv":
        cells = _read_csv(file, label, columns)
    elif suffix == ".parquet":
        cells = _read_parquet(file, label, columns)
    else:
        raise TaskError(f"{label} is neither a .csv nor a .parquet file")
    n = len(cells[cfg.target])
    if n == 0:
        raise TaskError(f"{label} has no data rows")
    x = np.empty((n, len(cfg.features)), dtype=np.float64)
    for j, name in enumerate(cfg.features):
        x[:, j] = _feature_column(cells[name], name)
    y = _label_column(cells[cfg.target], cfg.target, cfg.classes)
    train, held = _split_rows(n, cfg, label)
    arrays = (x[train], y[train], x[held], y[held])
    for a in arrays:
        a.setflags(write=False)
    return _Split(*arrays)


def _split(dataset: DatasetBinding, cfg: TabularConfig) -> _Split:
    label = f"dataset {dataset.name!r}"
    try:
        st = os.stat(dataset.path)
    except FileNotFoundError:
        raise TaskError(f"{label}: its file is missing") from None
    except OSError as exc:
        raise TaskError(f"cannot read {label}: {exc.strerror or 'I/O error'}") from None
    data_cfg = replace(cfg, layers=0, hidden=32, standardize=True)  # what the data depends on
    return _load_split(dataset.path, (st.st_mtime_ns, st.st_size), label, data_cfg)


# --------------------------------------------------------------------------- task


def _moments(statistics: np.ndarray | None, d: int) -> tuple[np.ndarray, np.ndarray]:
    """The federation's feature means and standard deviations from the summed vector."""
    if statistics is None:
        raise TaskError("the federation's feature statistics are not available yet")
    stats = np.asarray(statistics, dtype=np.float64).reshape(-1)
    if stats.shape[0] != 1 + 2 * d:
        raise TaskError(
            f"statistics: expected {1 + 2 * d} values (n, {d} sums, {d} sums of squares), "
            f"got {stats.shape[0]}"
        )
    if not np.all(np.isfinite(stats)) or stats[0] <= 0:
        raise TaskError("statistics: the federation's sum is not finite or counts no rows")
    n = stats[0]
    mean = stats[1 : 1 + d] / n
    var = np.maximum(stats[1 + d :] / n - mean**2, 0.0)
    return mean, np.sqrt(var) + _STD_EPS


def task(context: TaskContext) -> Task:
    """The ``tabular`` task for this org's bound table (see the module docstring)."""
    dataset = context.dataset
    if dataset is None:
        raise TaskError("dataset: the tabular task needs a table bound to the run")
    cfg = parse_config(context)
    d, num_classes = len(cfg.features), len(cfg.classes)

    def build_model(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return TabularModel(d, num_classes, hidden=cfg.hidden, layers=cfg.layers)

    def statistics() -> np.ndarray:
        x = _split(dataset, cfg).x_train
        n = np.array([x.shape[0]], dtype=np.float64)
        return np.concatenate([n, x.sum(axis=0), (x * x).sum(axis=0)]).astype(np.float64)

    def build_data() -> TaskData:
        split = _split(dataset, cfg)
        x_train, x_eval = split.x_train, split.x_eval
        if cfg.standardize:
            mean, std = _moments(context.statistics, d)
            x_train, x_eval = (x_train - mean) / std, (x_eval - mean) / std
        return TaskData(
            inputs=torch.tensor(x_train, dtype=torch.float32),
            targets=torch.tensor(split.y_train, dtype=torch.long),
            eval_inputs=torch.tensor(x_eval, dtype=torch.float32),
            eval_targets=torch.tensor(split.y_eval, dtype=torch.long),
            labels=np.array(split.y_train),
        )

    return Task(
        name="tabular",
        build_model=build_model,
        build_data=build_data,
        loss=cross_entropy,
        metrics=accuracy_metrics,
        statistics=statistics if cfg.standardize else None,
    )
