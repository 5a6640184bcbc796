"""Weight-sync verification over real gloo processes: a bucket changed in transit (one bit of one
received buffer flipped after the transfer, before unpacking) must stop the first sync on every
rank with an error naming the tensor, slice and ranks; an intact sync passes with every bucket
checked; verification off lets the damage through (so the check is what catches it)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "hybrid"))

from _corrupt import corrupting_transport  # noqa: E402
from _launch import run_distributed  # noqa: E402
from hybrid_reference import hf_shapes, id_state_dict, tiny_config  # noqa: E402

pytestmark = pytest.mark.distributed

LAYERS = 2
BUCKET = 4096


def _sync(rank: int, world: int, port: int, corrupt_rank: int | None, verify: bool) -> dict[str, Any]:
    import torch.distributed as dist

    from megarl.hybrid.executor import execute_plan
    from megarl.hybrid.plan import build_reshard_plan
    from megarl.hybrid.verify import WeightSyncError
    from megarl.layout import ParallelLayout
    from megarl.models.spec import ModelSpec
    from megarl.models.weight_map import hf_to_megatron_state_dict

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    spec = ModelSpec.from_hf_config(tiny_config(False, LAYERS))
    shapes = hf_shapes(False, LAYERS)
    hf = id_state_dict(shapes)
    train = ParallelLayout(tp=2, dp=1)
    c = train.coord(rank)
    mine = hf_to_megatron_state_dict(hf, spec, c.tp_rank, train.tp, c.pp_rank, train.pp)
    plan = build_reshard_plan(spec, train, ParallelLayout.rollout(1, world), "hf", torch.float64, BUCKET,
                              hf_shapes=shapes)
    transport = corrupting_transport(None, nth=2, byte=1001) if rank == corrupt_rank else None
    try:
        tensors, stats = execute_plan(plan, mine, verify=verify, transport=transport)
    except WeightSyncError as err:
        return {"error": str(err)}
    wrong = sorted(k for k in hf if not torch.equal(tensors[k], hf[k]))
    pieces = sum(len(p) for step in plan.steps for p in step.values())
    return {"error": None, "wrong": wrong, "stats": stats.as_dict(), "pieces": pieces}


def test_intact_sync_checks_every_bucket() -> None:
    results = run_distributed(_sync, 2, None, True, timeout=180)
    assert sum(r["stats"]["buckets_received"] for r in results) > 2
    for r in results:
        assert r["error"] is None and not r["wrong"]
        assert r["stats"]["pieces_verified"] == r["pieces"] > 2


def test_corrupted_bucket_stops_the_first_sync_on_every_rank() -> None:
    results = run_distributed(_sync, 2, 1, True, timeout=180)
    for r in results:  # both ranks stop, with the same message
        err = r["error"]
        assert err is not None, "the corrupted bucket went through"
        assert err.startswith("weight sync verification failed: 1 of ") and "in 1 bucket(s)" in err
        assert "step 2, rank 0 -> rank 1" in err  # the third bucket rank 1 received, from rank 0
        assert "of rank 0 -> " in err and "of rank 1" in err and "[axis " in err  # tensor, slice, ranks
    assert results[0]["error"] == results[1]["error"]


def test_without_verification_the_damage_goes_through() -> None:
    results = run_distributed(_sync, 2, 1, False, timeout=180)
    assert results[0]["error"] is None and not results[0]["wrong"]
    assert results[1]["error"] is None and len(results[1]["wrong"]) == 1  # silently wrong weights
