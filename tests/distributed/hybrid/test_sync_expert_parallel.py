"""Hybrid engine with an expert-parallel actor: Megatron training at EP=2 (DP=2, two gloo
processes, each holding half of the experts as local experts 0..E/2-1; and PP=2 x EP=2 on four)
syncs into an HF rollout engine on each rank. For a tiny Qwen3-MoE and a tiny Qwen2-MoE (shared
expert): after the sync the rollout model's log-probs of a fixed batch equal the trainer's and the
HF reference model's; after one optimizer step and a second sync they equal the trainer's again;
every rank receives exactly the plan's minimum, at EP=2 the bytes of the experts it does not hold
(half of HF's fused expert tensors, counted from the HF model) and nothing else; each rank syncs
from its own plan, which covers that rank alone; the sync's verification checks every piece of
the world (the pieces the ranks' own plans receive, summed), and one byte flipped in transit
inside an expert piece stops the sync on every rank naming that expert tensor. With an expert
tensor-parallel size other than TP (TP=2, EP=2, expert TP=1, sequence parallel, four processes)
the same holds, and the weights the sync delivers after the step equal a float64 AdamW step on
the HF model."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _launch import free_ports, run_distributed  # noqa: E402
from engine_helpers import (  # noqa: E402
    adam_weight_atol,
    hf_logprobs,
    make_batch,
    make_moe_model,
    pg_loss_fn,
    reference_train_step,
    save_hf_model,
    with_state,
)

pytestmark = pytest.mark.distributed

TRAIN_CFG = dict(lr=1e-2, eps=1e-2, weight_decay=0.0, clip_grad=1.0, micro_batch_size=2)
KINDS = ("qwen3_moe", "qwen2_moe")
BUCKET = 16 * 1024
CORRUPT_RANK = 1


def _expert_piece_flipper(plan: Any, rank: int, group: Any) -> tuple[Any, str]:
    """A point-to-point transport that flips one byte of the first remote expert piece `rank`
    receives (inside that piece's span of its bucket); returns it and the piece's source name."""
    from megarl.hybrid.executor import P2PTransport

    found = [(k, pair, offset, p) for k, step in enumerate(plan.steps) for pair, pieces in step.items()
             if pair[1] == rank for i, p in enumerate(pieces)
             for offset in [sum(q.nbytes for q in pieces[:i])] if ".local_experts." in p.src_name]
    if not found:
        raise AssertionError(f"rank {rank} receives no expert piece")
    k0, pair0, offset0, piece = found[0]
    # The executor posts a pair's buckets in step order, in rounds of its own: the target is the pair's
    # n-th bucket, n = the steps before k0 that hold the pair.
    nth = sum(1 for step in plan.steps[:k0] if pair0 in step)
    byte = offset0 + piece.nbytes // 2

    class Flipper(P2PTransport):
        def __init__(self) -> None:
            super().__init__(group)
            self.seen = 0  # buckets of pair0 received so far
            self.posted: dict[int, dict] = {}

        def start(self, sends: dict, recvs: dict) -> Any:
            handle = super().start(sends, recvs)
            self.posted[id(handle)] = recvs
            return handle

        def wait(self, handle: Any) -> None:
            super().wait(handle)
            recvs = self.posted.pop(id(handle))
            if pair0 in recvs:
                if self.seen == nth:
                    recvs[pair0].view(torch.uint8)[byte] ^= 0x10
                self.seen += 1

    return Flipper(), piece.src_name


def _sync_ep(rank: int, world: int, port: int, hf_dirs: dict[str, str], layout_kw: dict,
             batch: dict, ports: list[int], engine_kw: dict | None = None) -> dict[str, Any]:
    from transformers import AutoConfig

    from megarl.hybrid.sync import WeightSync
    from megarl.hybrid.verify import WeightSyncError
    from megarl.layout import ParallelLayout
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import init_distributed
    from megarl.models.spec import ModelSpec
    from megarl.rollout.base import EngineOptions
    from megarl.rollout.hf_engine import HFRolloutEngine

    out = {}
    for i, (kind, hf_dir) in enumerate(hf_dirs.items()):
        layout = init_distributed(rank, world, "127.0.0.1", ports[i], ParallelLayout(**layout_kw))
        engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), layout,
                                EngineConfig(**TRAIN_CFG, **(engine_kw or {})))
        engine.load_hf_weights(hf_dir)
        r = engine.ranks
        assert (r.ep_size, r.pp_size, r.etp_size) == (layout_kw["ep"], layout_kw.get("pp", 1), layout.etp)
        rows = torch.arange(len(batch["responses"])).chunk(r.dp_size)[r.dp_rank]
        mine = {k: v[rows] for k, v in batch.items()}
        torch.manual_seed(1000 + rank)  # a different random model: only the sync can make it right
        rollout = HFRolloutEngine.from_config(AutoConfig.from_pretrained(hf_dir),
                                              EngineOptions(pad_token_id=0, eos_token_ids=(1,)))
        rollout.model.set_experts_implementation("eager")
        sync = WeightSync(engine, rollout, rollout_tp=1, bucket_bytes=BUCKET)

        def rollout_lp() -> torch.Tensor:
            return hf_logprobs(rollout.model, batch, dtype=torch.float32)[0]

        before = rollout_lp()
        stats1 = sync.sync()
        rollout1, train1 = rollout_lp(), engine.compute_log_prob(mine)["log_probs"]
        engine.train_step(mine, pg_loss_fn, mini_batch_size=len(rows), calculate_entropy=True)
        stats2 = sync.sync()
        rollout2, train2 = rollout_lp(), engine.compute_log_prob(mine)["log_probs"]
        trained = {k: v.clone() for k, v in rollout.model.state_dict().items()}
        transport, expert_name = (_expert_piece_flipper(sync.plan, rank, None) if rank == CORRUPT_RANK
                                  else (None, None))
        try:
            sync.sync(transport=transport)
            error = None
        except WeightSyncError as err:
            error = str(err)
        pieces = sum(len(p) for step in sync.plan.steps for pair, p in step.items() if pair[1] == rank)
        out[kind] = dict(covers=sync.plan.ranks, rows=rows, before=before, rollout1=rollout1, train1=train1,
                         rollout2=rollout2, train2=train2, stats=[stats1.as_dict(), stats2.as_dict()], error=error,
                         expert_name=expert_name, pieces=pieces, after_error=rollout_lp(), trained=trained)
    return out


def _remote_expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of the experts one of two EP ranks lacks: half of HF's fused expert tensors."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if ".mlp.experts." in n) // 2


def _check(models: dict[str, torch.nn.Module], results: list[dict], batch: dict, only_experts_move: bool) -> None:
    mask = batch["response_mask"].bool()
    for kind, model in models.items():
        ref = hf_logprobs(model, batch)[0]
        remote = _remote_expert_bytes(model)
        assert remote > 0
        errors = []
        world_pieces = sum(by_kind[kind]["pieces"] for by_kind in results)
        for rank, by_kind in enumerate(results):
            r = by_kind[kind]
            assert r["covers"] == [rank], (kind, rank, r["covers"])
            rows, m = r["rows"], mask[r["rows"]]
            assert (r["before"] - ref)[mask].abs().max() > 0.1, "the rollout model must start different"
            err = (r["rollout1"].double() - ref)[mask].abs().max().item()
            assert err < 2e-5, f"{kind} rank {rank}: synced rollout vs HF reference differs by {err}"
            for step, (got, train) in enumerate(((r["rollout1"], r["train1"]), (r["rollout2"], r["train2"]))):
                err = (got[rows] - train)[m].abs().max().item()
                assert err < 2e-5, f"{kind} rank {rank} sync {step + 1}: rollout vs trainer differs by {err}"
            assert (r["rollout2"] - r["rollout1"])[mask].abs().max() > 1e-3, f"{kind}: the step must move the weights"
            for stats in r["stats"]:
                assert stats["bytes_received"] == stats["minimum_bytes"] > 0, (kind, rank, stats)
                if only_experts_move:  # the rank's own dense weights are copied locally
                    assert stats["bytes_received"] == remote, (kind, rank, stats, remote)
                assert stats["pieces_verified"] == world_pieces > r["pieces"] > 0
            # The corrupted third sync: stopped before the engine took the weights.
            assert r["error"] is not None, f"{kind} rank {rank}: the flipped expert byte went through"
            assert (r["after_error"] - r["rollout2"]).abs().max() == 0
            errors.append(r["error"])
        name = results[CORRUPT_RANK][kind]["expert_name"]
        assert ".mlp.experts.local_experts." in name
        assert all(e == errors[0] for e in errors)
        assert errors[0].startswith("weight sync verification failed: 1 of "), errors[0]
        assert f"{name!r} [axis " in errors[0] and f"of rank {CORRUPT_RANK}" in errors[0], errors[0]
        assert ".mlp.experts." in errors[0].split(" -> ", 1)[1], errors[0]  # the HF expert tensor it was for


def test_ep2_actor_syncs_into_hf_engine_with_minimum_bytes_and_verification() -> None:
    """EP=2, DP=2 (2 processes): each rank receives exactly the other rank's experts."""
    models = {kind: make_moe_model(kind, seed=5 + i) for i, kind in enumerate(KINDS)}
    hf_dirs = {kind: save_hf_model(m) for kind, m in models.items()}
    batch = make_batch(seed=21, batch=4)
    results = run_distributed(_sync_ep, 2, hf_dirs, dict(ep=2), batch, free_ports(len(hf_dirs)), timeout=600)
    _check(models, results, batch, only_experts_move=True)


def test_pp2_ep2_actor_syncs_into_hf_engine() -> None:
    """PP=2 x EP=2 (DP=2, 4 processes), Qwen2-MoE with its shared expert: pipeline stages and expert
    shards both come from other ranks; every rank still receives only the plan's minimum."""
    models = {"qwen2_moe": make_moe_model("qwen2_moe", seed=8)}
    hf_dirs = {kind: save_hf_model(m) for kind, m in models.items()}
    batch = make_batch(seed=22, batch=4)
    results = run_distributed(_sync_ep, 4, hf_dirs, dict(pp=2, ep=2), batch, free_ports(len(hf_dirs)), timeout=600)
    _check(models, results, batch, only_experts_move=False)


def test_tp2_ep2_expert_tp1_actor_trains_and_syncs_into_hf_engine() -> None:
    """TP=2, EP=2, expert TP=1 (4 processes, DP=2, sequence parallel as Megatron requires for MoE
    training at TP > 1): attention and shared-expert weights are split over the TP ranks, each
    expert is whole, and the two TP ranks of a replica hold different halves of the experts (expert
    DP 2: ranks 0 and 2 hold the first half, ranks 1 and 3 the second).
    The sync assembles every tensor with the minimum bytes, and after the optimizer step it delivers
    the weights of a float64 AdamW step on the HF model."""
    models = {kind: make_moe_model(kind, seed=30 + i) for i, kind in enumerate(KINDS)}
    hf_dirs = {kind: save_hf_model(m) for kind, m in models.items()}
    batch = make_batch(seed=23, batch=4)
    results = run_distributed(_sync_ep, 4, hf_dirs, dict(tp=2, ep=2, etp=1), batch, free_ports(len(hf_dirs)),
                              dict(sequence_parallel=True), timeout=900)
    _check(models, results, batch, only_experts_move=False)
    for kind, model in models.items():
        want, want_norm = reference_train_step(model, batch, TRAIN_CFG["lr"], TRAIN_CFG["eps"],
                                               TRAIN_CFG["clip_grad"])
        want = with_state(model, want).state_dict()
        atol = adam_weight_atol(TRAIN_CFG["lr"], TRAIN_CFG["eps"], want_norm, TRAIN_CFG["clip_grad"])
        start = model.state_dict()
        for rank, by_kind in enumerate(results):
            got = by_kind[kind]["trained"]
            assert set(got) == set(want), (kind, rank)
            moved = 0
            for name, w in want.items():
                err = (got[name].double() - w.double()).abs().max().item()
                assert err < atol, f"{kind} rank {rank}: {name} differs from the float64 step by {err}"
                moved += int((w - start[name]).abs().max() > 1e-4)
            assert moved > len(want) // 2, f"{kind}: the step should change most tensors"
