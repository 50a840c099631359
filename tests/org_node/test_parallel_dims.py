"""ParallelDims and LocalJobSpec validation: degrees, inference, coordinates, named fields."""

from __future__ import annotations

import pytest

from org_node.training import LocalJobSpec, ParallelDims, SpecError
from org_node.training.parallel import MESH_AXES


def test_degrees_multiply_to_world_size() -> None:
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, pp=1, world_size=4)
    assert dims.dp == 2
    assert dims.tp_enabled and dims.dp_shard_enabled
    assert not dims.pp_enabled and not dims.dp_replicate_enabled
    assert dims.shape == (1, 1, 2, 2)


def test_dp_shard_minus_one_is_inferred() -> None:
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, tp=2, pp=1, world_size=8)
    assert dims.dp_shard == 2


def test_inconsistent_degrees_name_the_world_size() -> None:
    with pytest.raises(SpecError) as info:
        ParallelDims(dp_replicate=1, dp_shard=2, tp=2, pp=2, world_size=4)
    assert info.value.field == "world_size"
    assert "= 8" in str(info.value)


def test_uninferable_dp_shard_is_named() -> None:
    with pytest.raises(SpecError) as info:
        ParallelDims(dp_replicate=1, dp_shard=-1, tp=3, pp=1, world_size=4)
    assert info.value.field == "dp_shard"


@pytest.mark.parametrize("field", ["dp_replicate", "tp", "pp"])
def test_zero_degree_is_named(field: str) -> None:
    kwargs = {"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, "world_size": 1, field: 0}
    with pytest.raises(SpecError) as info:
        ParallelDims(**kwargs)
    assert info.value.field == field


def test_coordinates_are_row_major_with_tp_innermost() -> None:
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, pp=2, world_size=8)
    assert tuple(dims.coordinates(0)) == MESH_AXES
    assert dims.coordinates(1) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "tp": 1}
    assert dims.coordinates(2) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "tp": 0}
    assert dims.coordinates(5) == {"pp": 1, "dp_replicate": 0, "dp_shard": 0, "tp": 1}
    assert [dims.dp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(ValueError):
        dims.coordinates(8)


def test_ddp_only_when_replication_is_alone() -> None:
    assert ParallelDims(4, 1, 1, 1, 4).ddp_only
    assert not ParallelDims(2, 1, 2, 1, 4).ddp_only
    assert not ParallelDims(2, 2, 1, 1, 4).ddp_only


def test_spec_world_size_and_round_trip() -> None:
    spec = LocalJobSpec(task="gpt", dp_shard=2, tp=2, batch_size=8)
    assert spec.world_size == 4
    assert LocalJobSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"task": "gpt", "learning_rate": 0.1}, "learning_rate"),
        ({"lr": 0.1}, "task"),
        ({"task": "gpt", "tp": 0}, "tp"),
        ({"task": "gpt", "dp_shard": True}, "dp_shard"),
        ({"task": "gpt", "lr": float("nan")}, "lr"),
        ({"task": "gpt", "device": "tpu"}, "device"),
        ({"task": "gpt", "optimizer": "lion"}, "optimizer"),
        ({"task": "gpt", "dp_shard": 3, "batch_size": 8}, "batch_size"),
        ({"task": "gpt", "pp": 2, "batch_size": 6, "microbatches": 4}, "batch_size"),
        ({"task": "gpt", "pp": 2, "microbatches": 1}, "microbatches"),
        ({"task": "gpt", "local_steps": None}, "local_steps"),
        ({"task": "gpt", "time_budget_s": -1.0}, "time_budget_s"),
        ({"task": "gpt", "partition_index": 2, "num_partitions": 2}, "partition_index"),
        ({"task": "gpt", "momentum": 1.0}, "momentum"),
        ({"task": "", "lr": 0.1}, "task"),
    ],
)
def test_bad_spec_names_the_field(data: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError) as info:
        LocalJobSpec.from_dict(data)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}:")


def test_time_budget_alone_is_enough() -> None:
    spec = LocalJobSpec(task="tabular", local_steps=None, time_budget_s=0.5)
    assert spec.local_steps is None
