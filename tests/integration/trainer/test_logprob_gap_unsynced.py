"""The loud log-prob gap check on real engines: a Megatron training engine (TP=2, gloo) and an HF
rollout engine on each rank. Synced, the rollout's log-probs of the same tokens match the trainer's
and the check passes at the default threshold; after optimizer steps whose weights are deliberately
not synced, the gap is far above it and the check stops with the step, the gap and the causes; a
sync makes it pass again."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# The engine tests' launcher and helpers live beside them (tests/distributed is not a package).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "distributed"))
from _launch import run_distributed  # noqa: E402
from engine_helpers import hf_logprobs, make_batch, make_hf_model, pg_loss_fn, save_hf_model  # noqa: E402

from megarl.algorithms import RolloutMismatchError, check_logprob_gap, logprob_gap  # noqa: E402
from megarl.config.schema import RolloutConfig  # noqa: E402

pytestmark = pytest.mark.integration

MEAN = "training/rollout_logprob_abs_diff_mean"


def _gaps(rank: int, world: int, port: int, hf_dir: str, batch: dict) -> dict:
    from transformers import AutoConfig

    from megarl.hybrid.sync import WeightSync
    from megarl.layout import ParallelLayout
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import init_distributed
    from megarl.models.spec import ModelSpec
    from megarl.rollout.base import EngineOptions
    from megarl.rollout.hf_engine import HFRolloutEngine

    layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(tp=2))
    engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), layout,
                            EngineConfig(lr=1e-3, weight_decay=0.0, clip_grad=1.0, micro_batch_size=4))
    engine.load_hf_weights(hf_dir)
    rollout = HFRolloutEngine.from_config(AutoConfig.from_pretrained(hf_dir),
                                          EngineOptions(pad_token_id=0, eos_token_ids=(1,)))
    sync = WeightSync(engine, rollout, rollout_tp=1, bucket_bytes=16 * 1024)
    mask = batch["response_mask"]

    def gap() -> dict:
        trainer = engine.compute_log_prob(batch)["log_probs"]
        return logprob_gap(trainer, hf_logprobs(rollout.model, batch, dtype=torch.float32)[0], mask)

    sync.sync()
    synced = gap()
    for _ in range(5):  # the actor trains; the rollout engine keeps the weights of the first sync
        engine.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]), calculate_entropy=True)
    unsynced = gap()
    sync.sync()
    return {"synced": synced, "unsynced": unsynced, "resynced": gap()}


def test_gap_check_fires_on_unsynced_weights_only() -> None:
    hf_dir = save_hf_model(make_hf_model("qwen2"))
    batch = make_batch(seed=4, batch=8)
    batch["advantages"] = torch.where(torch.arange(8).unsqueeze(-1) % 2 == 0, 1.0, -1.0).expand(8, 5).clone()
    results = run_distributed(_gaps, 2, hf_dir, batch, timeout=400)
    default = RolloutConfig().max_logprob_gap
    for rank, r in enumerate(results):
        assert r["synced"][MEAN] < 1e-5 and r["resynced"][MEAN] < 1e-5, (rank, r)
        check_logprob_gap(1, r["synced"][MEAN], default)
        check_logprob_gap(6, r["resynced"][MEAN], default)
        assert r["unsynced"][MEAN] > default, (rank, r)
        with pytest.raises(RolloutMismatchError, match=rf"step 6: .* above rollout.max_logprob_gap = {default:g}"):
            check_logprob_gap(6, r["unsynced"][MEAN], default)
    print({k: results[0][k][MEAN] for k in ("synced", "unsynced", "resynced")})
