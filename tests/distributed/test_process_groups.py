"""Process groups from torchrun's environment variables and from explicit arguments (Ray actors)."""

from __future__ import annotations

import os

import pytest

from _launch import run_distributed

pytestmark = pytest.mark.distributed


def _groups(rank: int, world: int, port: int, from_env: bool) -> dict:
    import torch
    import torch.distributed as dist

    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import current_ranks, init_distributed

    layout = ParallelLayout(tp=2)
    if from_env:  # what torchrun sets
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        resolved = init_distributed(layout=layout)
    else:
        resolved = init_distributed(rank, world, "127.0.0.1", port, layout)
    ranks = current_ranks()
    x = torch.tensor([float(rank + 1)])
    from megatron.core import parallel_state as ps

    dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
    return {"backend": dist.get_backend(), "resolved": resolved, "ranks": ranks, "tp_sum": float(x)}


def test_tp2_groups_from_torchrun_environment_on_gloo() -> None:
    # The explicit form (Ray actors) is what every other distributed test uses.
    results = run_distributed(_groups, 2, True)
    for rank, res in enumerate(results):
        assert res["backend"] == "gloo"
        assert (res["resolved"].tp, res["resolved"].dp, res["resolved"].pp) == (2, 1, 1)
        assert (res["ranks"].tp_rank, res["ranks"].tp_size, res["ranks"].dp_size) == (rank, 2, 1)
        assert res["tp_sum"] == 3.0  # 1 + 2 across the TP group
