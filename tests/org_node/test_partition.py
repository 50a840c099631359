"""Dirichlet(alpha) and IID partitioning: a cover, disjoint, reproducible, skewed as asked."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from org_node.tasks.partition import (
    PartitionError,
    dirichlet_partition,
    iid_partition,
    partition_indices,
)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(20, 300),
    parts=st.integers(1, 5),
    classes=st.integers(1, 6),
    alpha=st.floats(0.05, 100.0),
    seed=st.integers(0, 2**31),
)
def test_dirichlet_is_a_disjoint_cover(
    n: int, parts: int, classes: int, alpha: float, seed: int
) -> None:
    labels = np.random.default_rng(seed).integers(0, classes, size=n)
    result = dirichlet_partition(labels, parts, alpha, seed=seed, min_size=0)
    assert len(result) == parts
    joined = np.concatenate(result)
    assert sorted(joined.tolist()) == list(range(n))
    for part in result:
        assert np.all(np.diff(part) > 0)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 200), parts=st.integers(1, 8), seed=st.integers(0, 2**31))
def test_iid_is_a_balanced_cover(n: int, parts: int, seed: int) -> None:
    if parts > n:
        with pytest.raises(PartitionError):
            iid_partition(n, parts, seed=seed)
        return
    result = iid_partition(n, parts, seed=seed)
    sizes = [len(p) for p in result]
    assert max(sizes) - min(sizes) <= 1
    assert sorted(np.concatenate(result).tolist()) == list(range(n))


def test_same_seed_same_partition() -> None:
    labels = np.repeat(np.arange(5), 40)
    a = dirichlet_partition(labels, 4, 0.3, seed=7)
    b = dirichlet_partition(labels, 4, 0.3, seed=7)
    c = dirichlet_partition(labels, 4, 0.3, seed=8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def _mean_label_entropy(parts: list[np.ndarray], labels: np.ndarray, classes: int) -> float:
    entropies = []
    for part in parts:
        counts = np.bincount(labels[part], minlength=classes).astype(float)
        p = counts[counts > 0] / counts.sum()
        entropies.append(float(-(p * np.log(p)).sum()))
    return float(np.mean(entropies))


def test_small_alpha_skews_labels_more_than_large_alpha() -> None:
    labels = np.repeat(np.arange(10), 100)
    skewed = dirichlet_partition(labels, 5, 0.1, seed=1)
    uniform = dirichlet_partition(labels, 5, 100.0, seed=1)
    assert _mean_label_entropy(skewed, labels, 10) < 0.7 * _mean_label_entropy(uniform, labels, 10)
    assert _mean_label_entropy(uniform, labels, 10) > 0.95 * np.log(10)


def test_min_size_is_met() -> None:
    labels = np.repeat(np.arange(3), 50)
    parts = dirichlet_partition(labels, 6, 0.5, seed=3, min_size=5)
    assert min(len(p) for p in parts) >= 5


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": float("inf")}, "alpha"),
        ({"num_partitions": 0}, "num_partitions"),
        ({"num_partitions": 31}, "num_partitions"),
        ({"min_size": 20}, "min_size"),
    ],
)
def test_bad_parameters_are_refused(kwargs: dict[str, float], needle: str) -> None:
    args: dict[str, float] = {"num_partitions": 3, "alpha": 1.0, **kwargs}
    with pytest.raises(PartitionError, match=needle):
        dirichlet_partition(
            np.arange(30) % 3,
            int(args["num_partitions"]),
            args["alpha"],
            seed=0,
            min_size=int(kwargs.get("min_size", 1)),
        )


def test_partition_indices_picks_one_share() -> None:
    labels = np.repeat(np.arange(4), 25)
    shares = [partition_indices(100, labels, 3, i, 0.5, seed=2) for i in range(3)]
    assert sorted(np.concatenate(shares).tolist()) == list(range(100))
    assert np.array_equal(partition_indices(100, None, 1, 0, None, seed=0), np.arange(100))
    with pytest.raises(PartitionError, match="partition_index"):
        partition_indices(100, labels, 3, 3, 0.5, seed=2)
