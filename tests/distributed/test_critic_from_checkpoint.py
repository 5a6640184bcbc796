"""`critic.model_path`: a critic started from its own checkpoint, e.g. a reward model, takes that
checkpoint's `score` head as its value head (the usual PPO setup); with its offload keys set it
starts offloaded and gives the same values once onloaded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _launch import run_distributed
from engine_helpers import make_batch, make_hf_model

pytestmark = pytest.mark.distributed


def _critic_values(rank: int, world: int, port: int, rm_dir: str, batch: dict) -> dict:
    # Megatron is imported in the rank process only (see engine_helpers).
    from megarl.layout import ParallelLayout
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import init_distributed
    from megarl.workers.roles import CriticRole
    from megarl.workers.specs import EngineRoleSpec, OffloadSpec

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    spec = EngineRoleSpec(name="critic", model_dir=rm_dir, layout=ParallelLayout(),
                          engine=EngineConfig(role="value", micro_batch_size=2),
                          offload=OffloadSpec(params=True, grads=True, optimizer=True))
    critic = CriticRole(SimpleNamespace(rank=rank), spec)
    critic.init_model()
    offloaded_after_init = critic.engine.offloaded is not None
    critic.onload()
    values = critic.compute_values(batch)["values"]
    critic.offload()
    return {"values": values, "offloaded_after_init": offloaded_after_init,
            "offloaded_again": critic.engine.offloaded is not None}


def test_critic_starts_from_a_reward_model_checkpoint(tmp_path) -> None:
    from transformers import AutoModelForSequenceClassification

    config = make_hf_model("qwen2", seed=3).config
    config.num_labels = 1
    config.pad_token_id = 0
    torch.manual_seed(11)
    rm = AutoModelForSequenceClassification.from_config(config).float().eval()
    with torch.no_grad():
        rm.score.weight.normal_(0.0, 0.5)  # a trained-looking head, far from a fresh value head
    rm.save_pretrained(tmp_path / "rm", safe_serialization=True)
    batch = make_batch(seed=2, batch=4)

    got = run_distributed(_critic_values, 1, str(tmp_path / "rm"), batch)[0]

    with torch.no_grad():
        hidden = rm.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          position_ids=batch["position_ids"]).last_hidden_state.double()
    per_position = (hidden @ rm.score.weight.double().T)[..., 0]
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    mask = batch["response_mask"].bool()
    # fp32 engine vs float64 HF over 2 layers of width 64: errors ~1e-6; a fresh head would differ by O(1).
    err = (got["values"].double() - per_position[:, p - 1:p + r - 1])[mask].abs().max().item()
    assert err < 1e-5, f"critic values differ from the reward model's head by {err}"
    assert got["offloaded_after_init"] and got["offloaded_again"]
