"""Data-parallel gradient sums through shared memory (`megarl.megatron.host_reduce`) on real gloo
processes: the sum equals the inputs gathered and added in rank order (bit for bit, every rank the
same), with two ranks gloo's all-reduce too; a training step of a data-parallel Megatron engine is
bit-identical with it and with gloo's all-reduce; a segment that cannot be set up (no directory,
no room on rank 0, a rank that cannot map it) is refused on every rank together, and none is left
behind."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _launch import free_ports, run_distributed  # noqa: E402
from engine_helpers import make_batch, make_hf_model, pg_loss_fn, save_hf_model, scratch_dir  # noqa: E402

pytestmark = pytest.mark.distributed

# Sizes around the chunk (64 elements a round below): one element, a partial chunk, exactly one,
# several with a remainder smaller than the number of ranks.
SIZES = (1, 37, 64, 3 * 64 + 2)


def _sums(rank: int, world: int, port: int, directory: str) -> dict[str, Any]:
    import torch.distributed as dist

    from megarl.megatron.host_reduce import HostSumReducer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out: dict[str, Any] = {"left_behind": None}
    for dtype in (torch.float32, torch.bfloat16):
        reducer = HostSumReducer(None, dtype=dtype, chunk_bytes=64 * torch.empty((), dtype=dtype).element_size(),
                                 directory=Path(directory))
        dist.barrier()  # rank 0 removes the name right after every rank has mapped the segment
        out["left_behind"] = sorted(p.name for p in Path(directory).iterdir())
        for n in SIZES:
            x = torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + n)).to(dtype) * (rank + 1)
            gathered = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(gathered, x)
            ordered = gathered[0].clone()
            for other in gathered[1:]:
                ordered += other
            got = reducer(x.clone())
            with_gloo = x.clone()
            dist.all_reduce(with_gloo)
            out[(str(dtype), n)] = (got, ordered, with_gloo)
            # Scaled (Megatron's 1/dp gradient scaling, and a factor whose products round): each
            # rank's tensor scaled as `x *= scale` scales it, then summed in rank order.
            for scale in (1 / world, 0.3):
                scaled = [g * scale for g in gathered]
                total = scaled[0].clone()
                for other in scaled[1:]:
                    total += other
                out[(str(dtype), n, scale)] = (reducer(x.clone(), scale=scale), total)
        reducer.close()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_the_shared_memory_sum_is_the_rank_ordered_sum(world: int) -> None:
    directory = scratch_dir("megarl_shm_test_")
    results = run_distributed(_sums, world, directory, timeout=120)
    for rank, r in enumerate(results):
        assert r["left_behind"] == [], "the segment's name must be gone once every rank mapped it"
        for dtype in ("torch.float32", "torch.bfloat16"):
            for n in SIZES:
                got, ordered, with_gloo = r[(dtype, n)]
                assert torch.equal(got, ordered), (rank, dtype, n)
                assert torch.equal(got, results[0][(dtype, n)][0]), "every rank holds the same sum"
                if world == 2:  # a + b is b + a: exactly gloo's result
                    assert torch.equal(got, with_gloo), (rank, dtype, n)
                for scale in (1 / world, 0.3):
                    got, expected = r[(dtype, n, scale)]
                    assert torch.equal(got, expected), (rank, dtype, n, scale)


def _unavailable(rank: int, world: int, port: int) -> str:
    import torch.distributed as dist

    from megarl.megatron.host_reduce import HostReduceUnavailable, HostSumReducer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        HostSumReducer(None, directory=Path("/nonexistent/megarl"))
    except HostReduceUnavailable as exc:
        return str(exc)
    return "no error"


def test_a_segment_that_cannot_be_made_is_refused_on_every_rank() -> None:
    for message in run_distributed(_unavailable, 2, timeout=60):
        assert message.startswith("shared-memory gradient reduction unavailable: rank 0 could not reserve")
        assert "/nonexistent/megarl" in message


def _setup_fails(rank: int, world: int, port: int, directory: str, failing: str) -> dict[str, Any]:
    """Build a reducer with rank 0's reservation (failing="fallocate") or rank 1's map ("mmap")
    failing; then check that the ranks are still in step, and that a reducer can still be built."""
    import errno
    import mmap
    import os

    import torch.distributed as dist

    from megarl.megatron.host_reduce import HostReduceUnavailable, HostSumReducer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out: dict[str, Any] = {"error": "no error"}
    real_fallocate, real_mmap = os.posix_fallocate, mmap.mmap

    def no_room(fd: int, offset: int, length: int) -> None:  # a /dev/shm too small for the segment
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def unmappable(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("mmap length is greater than file size")

    if failing == "fallocate" and rank == 0:
        os.posix_fallocate = no_room
    if failing == "mmap" and rank == 1:
        mmap.mmap = unmappable
    try:
        HostSumReducer(None, directory=Path(directory))
    except HostReduceUnavailable as exc:
        out["error"] = str(exc)
    finally:
        os.posix_fallocate, mmap.mmap = real_fallocate, real_mmap
    dist.barrier()  # rank 0 is done with the segment on every path
    out["left_behind"] = sorted(p.name for p in Path(directory).iterdir())
    x = torch.full((3,), float(rank + 1))
    dist.all_reduce(x)  # the ranks left the constructor together: the next collective pairs up
    out["gloo_sum"] = x
    reducer = HostSumReducer(None, directory=Path(directory))
    out["host_sum"] = reducer(torch.full((3,), float(rank + 1)))
    reducer.close()
    return out


@pytest.mark.parametrize("failing", ["fallocate", "mmap"])
def test_a_failed_setup_falls_back_on_every_rank_and_leaves_nothing_behind(failing: str) -> None:
    # Rank 0's fallocate failing on a small /dev/shm once sent the path of a 0-byte file: rank 1's
    # mmap raised ValueError, rank 0 waited in the gather, and the file stayed.
    directory = scratch_dir("megarl_shm_test_")
    results = run_distributed(_setup_fails, 2, directory, failing, timeout=60)
    for rank, r in enumerate(results):
        if failing == "fallocate":
            assert r["error"].startswith("shared-memory gradient reduction unavailable: rank 0 could not "
                                         "reserve"), (rank, r["error"])
            assert "No space left on device" in r["error"]
        else:
            assert r["error"].startswith("shared-memory gradient reduction unavailable: rank 1 could not "
                                         "map"), (rank, r["error"])
            assert "mmap length is greater than file size" in r["error"]
        assert r["left_behind"] == [], rank
        assert torch.equal(r["gloo_sum"], torch.full((3,), 3.0))
        assert torch.equal(r["host_sum"], torch.full((3,), 3.0))
    assert not any(Path(directory).iterdir())


def _train(rank: int, world: int, port: int, hf_dir: str, ports: list[int]) -> dict[str, Any]:
    from megarl.layout import ParallelLayout
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import destroy_distributed, init_distributed
    from megarl.models.spec import ModelSpec

    out = {}
    for i, host in enumerate((True, False)):
        init_distributed(rank, world, "127.0.0.1", ports[i], ParallelLayout(dp=2))
        engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), ParallelLayout(dp=2),
                                EngineConfig(lr=1e-2, eps=1e-2, weight_decay=0.0, micro_batch_size=2,
                                             use_distributed_optimizer=False, host_grad_reduce=host))
        engine.load_hf_weights(hf_dir)
        loaded = {n: t.detach().clone() for n, t in engine.get_named_weights()}
        batch = make_batch(seed=10 + rank, batch=4)  # each rank its own rows: the sum matters
        for _ in range(2):
            engine.train_step(batch, pg_loss_fn, mini_batch_size=4, calculate_entropy=True)
        params = {n: t.detach().clone() for n, t in engine.get_named_weights()}
        out[host] = {"buckets": engine.host_reduced_buckets, "params": params,
                     "moved": sum(not torch.equal(params[n], loaded[n]) for n in params)}
        destroy_distributed()
    return out


def test_a_data_parallel_step_is_bit_identical_with_the_shared_memory_sum() -> None:
    hf_dir = save_hf_model(make_hf_model("qwen2"))
    results = run_distributed(_train, 2, hf_dir, free_ports(2), timeout=300)
    for rank, r in enumerate(results):
        assert r[True]["buckets"] > 0 and r[False]["buckets"] == 0
        assert r[True]["moved"] == len(r[True]["params"]) > 0  # every parameter trained
        for name, tensor in r[False]["params"].items():
            assert torch.equal(r[True]["params"][name], tensor), (rank, name)
            # The ranks' rows differ, their summed gradients do not: the replicas stay equal.
            assert torch.equal(r[True]["params"][name], results[0][True]["params"][name]), (rank, name)
