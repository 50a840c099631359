"""Non-IID partitioning of a data set over organizations, for demos and tests.

``dirichlet_partition`` follows the label-skew scheme common in the federated-learning
literature (Hsu, Qi and Brown, "Measuring the Effects of Non-Identical Data Distribution
for Federated Visual Classification", 2019, section 3): for each class, the share of its
examples that each of the ``n`` partitions receives is drawn from Dirichlet(alpha * 1_n).
Small alpha (0.1) gives each partition few classes; large alpha (100) approaches IID.
Every function takes its randomness as ``seed`` (an int or a numpy Generator), so a
partition is reproducible on every rank and every node.
"""

from __future__ import annotations

import numpy as np

__all__ = ["PartitionError", "dirichlet_partition", "iid_partition", "partition_indices"]


class PartitionError(ValueError):
    """The partitioning parameters cannot be met."""


def _rng(seed: int | np.random.Generator | None) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def _check_count(num_partitions: int, num_examples: int) -> None:
    if num_partitions < 1:
        raise PartitionError(f"num_partitions must be >= 1, got {num_partitions}")
    if num_examples < num_partitions:
        raise PartitionError(
            f"num_partitions={num_partitions} exceeds the {num_examples} examples available"
        )


def iid_partition(
    num_examples: int, num_partitions: int, *, seed: int | np.random.Generator | None = None
) -> list[np.ndarray]:
    """A random permutation cut into ``num_partitions`` near-equal sorted index arrays."""
    _check_count(num_partitions, num_examples)
    perm = _rng(seed).permutation(num_examples)
    return [np.sort(part) for part in np.array_split(perm, num_partitions)]


def dirichlet_partition(
    labels: np.ndarray,
    num_partitions: int,
    alpha: float,
    *,
    seed: int | np.random.Generator | None = None,
    min_size: int = 1,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Split example indices by label skew: per class, shares ~ Dirichlet(alpha).

    Returns ``num_partitions`` sorted, disjoint index arrays that together cover every
    example. Draws again (up to ``max_tries``) until each partition holds at least
    ``min_size`` examples, and raises PartitionError if that never happens.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise PartitionError(f"labels must be one-dimensional, got shape {labels.shape}")
    if not np.isfinite(alpha) or alpha <= 0:
        raise PartitionError(f"alpha must be a positive finite number, got {alpha}")
    if min_size < 0:
        raise PartitionError(f"min_size must be >= 0, got {min_size}")
    _check_count(num_partitions, len(labels))
    if min_size * num_partitions > len(labels):
        raise PartitionError(
            f"min_size={min_size} for {num_partitions} partitions needs more than "
            f"{len(labels)} examples"
        )
    rng = _rng(seed)
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
        for cls in classes:
            idx = rng.permutation(np.flatnonzero(labels == cls))
            shares = rng.dirichlet(np.full(num_partitions, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(np.int64)
            for p, chunk in enumerate(np.split(idx, cuts)):
                parts[p].append(chunk)
        result = [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]
        if min(len(r) for r in result) >= min_size:
            return result
    raise PartitionError(
        f"no Dirichlet(alpha={alpha}) draw gave every one of {num_partitions} partitions "
        f"at least {min_size} examples in {max_tries} tries; raise alpha or lower min_size"
    )


def partition_indices(
    num_examples: int,
    labels: np.ndarray | None,
    num_partitions: int,
    index: int,
    alpha: float | None,
    *,
    seed: int,
) -> np.ndarray:
    """The indices of partition ``index``: Dirichlet when ``alpha`` and labels exist, else IID."""
    if not 0 <= index < num_partitions:
        raise PartitionError(f"partition_index {index} is outside 0..{num_partitions - 1}")
    if num_partitions == 1:
        return np.arange(num_examples, dtype=np.int64)
    if alpha is None or labels is None:
        return iid_partition(num_examples, num_partitions, seed=seed)[index]
    return dirichlet_partition(labels, num_partitions, alpha, seed=seed)[index]
