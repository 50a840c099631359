"""The GPT's tensor-parallel plan moves as few activations as Megatron-LM's, checked by
counting DTensor's collectives on an in-process fake group of two ranks; and the layout
choices the job makes (FSDP2 resharding, threads per rank, huge pages) follow
their rules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from org_node.tasks.gpt import GPTConfig, build_model
from org_node.training import ParallelDims
from org_node.training.launch import THP_ENV, child_env, threads_per_rank
from org_node.training.parallelize import reshard_after_forward


@pytest.fixture
def fake_group() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _all_reduces(mode: CommDebugMode) -> int:
    return sum(n for op, n in mode.get_comm_counts().items() if "all_reduce" in str(op))


@pytest.mark.usefixtures("fake_group")
@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_tp_plan_costs_one_all_reduce_per_block_half_each_way() -> None:
    layers = 3
    model = build_model(0, GPTConfig(n_layers=layers))
    parallelize_module(model, init_device_mesh("cpu", (2,)), model.tensor_parallel_plan())
    tokens = torch.randint(0, 96, (2, 16))
    with CommDebugMode() as forward:  # type: ignore[no-untyped-call]
        logits = model(tokens)
    with CommDebugMode() as backward:  # type: ignore[no-untyped-call]
        logits.float().pow(2).mean().backward()
    # attention and MLP: one all-reduce each forward (row-parallel outputs) and one each
    # backward (the gradient of the replicated input; q, k and v share theirs)
    assert _all_reduces(forward) == 2 * layers
    assert _all_reduces(backward) == 2 * layers
    # nothing else is gathered: the embeddings and the head stay replicated and local
    assert sum(forward.get_comm_counts().values()) == 2 * layers
    assert sum(backward.get_comm_counts().values()) == 2 * layers


@pytest.mark.parametrize(
    ("degrees", "expected"),
    [
        ((1, 2, 2, 1), False),  # dp=2 x tp=2: keep gathered, no second all-gather
        ((1, 2, 1, 2), False),  # pipelining: never re-gather per microbatch
        ((1, 4, 1, 1), True),  # dp_shard=4: resharding saves 3/4 of the parameters
        ((2, 2, 2, 1), False),
        ((1, 8, 1, 2), False),
    ],
)
def test_reshard_after_forward_rule(degrees: tuple[int, int, int, int], expected: bool) -> None:
    dp_replicate, dp_shard, tp, pp = degrees
    dims = ParallelDims(dp_replicate, dp_shard, tp, pp, dp_replicate * dp_shard * tp * pp)
    assert reshard_after_forward(dims) is expected


def test_threads_per_rank_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert threads_per_rank(4) == 4
    assert threads_per_rank(3) == 5
    assert threads_per_rank(32) == 1


def test_ranks_get_huge_pages_unless_the_environment_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(THP_ENV, raising=False)
    assert child_env(None, 4)[THP_ENV] == "1"
    monkeypatch.setenv(THP_ENV, "0")
    assert child_env(None, 4)[THP_ENV] == "0"
    assert child_env({THP_ENV: "0"}, 4)[THP_ENV] == "0"
