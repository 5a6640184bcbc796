"""Hybrid engine end to end on two gloo processes: the Megatron training engine (TP2, PP2 or DP2)
syncs its weights into an HF rollout engine on each rank (rollout TP1), writing into the engine's
own tensors. After the sync the rollout model's
log-probs of a fixed sequence equal the training engine's and the HF reference model's; after one
optimizer step and a second sync they change the same way."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _launch import free_ports, run_distributed  # noqa: E402
from engine_helpers import hf_logprobs, make_batch, make_hf_model, pg_loss_fn, save_hf_model  # noqa: E402

pytestmark = pytest.mark.distributed

TRAIN_CFG = dict(lr=1e-2, eps=1e-2, weight_decay=0.0, clip_grad=1.0, micro_batch_size=2)
CASES = {"qwen2-tp2": ("qwen2", dict(tp=2)), "qwen2-pp2": ("qwen2", dict(pp=2)),
         "llama_tied-pp2": ("llama_tied", dict(pp=2)), "qwen2-dp2": ("qwen2", dict(dp=2)),
         "qwen2-tp2-unverified": ("qwen2", dict(tp=2)),
         # Llama 3.x RoPE scaling: the trainer and the HF rollout engine compute the same RoPE.
         "llama_rope-tp2": ("llama_rope", dict(tp=2))}
# Written straight into the HF engine's parameters: syncs that are not verified (verified ones fill
# new tensors and hand them over after the check), at DP=2 because nothing crosses a process.
UNVERIFIED = {"qwen2-tp2-unverified"}
# The rollout engine of this case takes its weights this much slower: `seconds` is the whole sync,
# the engine's `update_weights` included (it covered only the exchange).
SLOW_TAKE_S = {"qwen2-tp2": 0.3}


def _sync_all(rank: int, world: int, port: int, hf_dirs: dict[str, str], batch: dict,
              ports: list[int]) -> dict[str, Any]:
    from transformers import AutoConfig

    from megarl.hybrid.sync import WeightSync
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed
    from megarl.models.spec import ModelSpec
    from megarl.rollout.base import EngineOptions
    from megarl.rollout.hf_engine import HFRolloutEngine

    out = {}
    for i, (name, (kind, layout_kw)) in enumerate(CASES.items()):
        hf_dir = hf_dirs[kind]
        layout = init_distributed(rank, world, "127.0.0.1", ports[i], ParallelLayout(**layout_kw))
        engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), layout, EngineConfig(**TRAIN_CFG))
        engine.load_hf_weights(hf_dir)
        torch.manual_seed(1000 + rank)  # a different random model: only the sync can make it right
        rollout = HFRolloutEngine.from_config(AutoConfig.from_pretrained(hf_dir),
                                              EngineOptions(pad_token_id=0, eos_token_ids=(1,)))
        if name in SLOW_TAKE_S:
            take = rollout.update_weights

            def slow_take(named_tensors: Any, take: Any = take, delay: float = SLOW_TAKE_S[name]) -> int:
                time.sleep(delay)
                return take(named_tensors)

            rollout.update_weights = slow_take
        sync = WeightSync(engine, rollout, rollout_tp=1, bucket_bytes=16 * 1024,
                          verify_every=0 if name in UNVERIFIED else 1)

        def rollout_lp() -> torch.Tensor:
            return hf_logprobs(rollout.model, batch, dtype=torch.float32)[0]

        before = rollout_lp()
        stats1 = sync.sync()
        rollout1, train1 = rollout_lp(), engine.compute_log_prob(batch)["log_probs"]
        engine.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]), calculate_entropy=True)
        stats2 = sync.sync()
        rollout2, train2 = rollout_lp(), engine.compute_log_prob(batch)["log_probs"]
        out[name] = dict(before=before, rollout1=rollout1, train1=train1, rollout2=rollout2, train2=train2,
                         stats=[stats1.as_dict(), stats2.as_dict()])
    return out


def test_rollout_log_probs_follow_training_engine_through_sync_and_step() -> None:
    kinds = sorted({kind for kind, _ in CASES.values()})
    models = {kind: make_hf_model(kind) for kind in kinds}
    hf_dirs = {kind: save_hf_model(m) for kind, m in models.items()}
    batch = make_batch(seed=3, batch=4)
    mask = batch["response_mask"].bool()
    results = run_distributed(_sync_all, 2, hf_dirs, batch, free_ports(len(CASES)), timeout=400)
    for name, (kind, _) in CASES.items():
        ref = hf_logprobs(models[kind], batch)[0]
        for rank, by_case in enumerate(results):
            r = by_case[name]
            assert (r["before"] - ref)[mask].abs().max() > 0.1, "the rollout model must start different"
            for key in ("rollout1", "train1"):
                err = (r[key].double() - ref)[mask].abs().max().item()
                assert err < 2e-5, f"{name} rank {rank} {key}: max error {err} vs HF"
            assert (r["rollout1"] - r["train1"])[mask].abs().max() < 2e-5
            d_rollout = (r["rollout2"] - r["rollout1"]).double()
            d_train = (r["train2"] - r["train1"]).double()
            assert d_train[mask].abs().max() > 1e-3, f"{name}: the step must change the log-probs"
            err = (d_rollout - d_train)[mask].abs().max().item()
            assert err < 2e-5, f"{name} rank {rank}: log-prob change differs by {err}"
            for stats in r["stats"]:
                assert stats["seconds"] >= SLOW_TAKE_S.get(name, 0.0) + stats["verify_seconds"], (name, stats)
                if name.endswith("dp2"):  # every rank holds the whole model: nothing moves, nothing to verify
                    assert stats["bytes_received"] == stats["minimum_bytes"] == stats["pieces_verified"] == 0
                else:  # verify_every=1: both syncs verified, every piece that moved checked
                    assert stats["bytes_received"] == stats["minimum_bytes"] > 0
                    assert (stats["pieces_verified"] > 0) == (name not in UNVERIFIED)
