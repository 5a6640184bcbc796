"""The reward-model role scores like transformers' sequence-classification model.

`RewardModelRole` loads a HF `*ForSequenceClassification` checkpoint (one label, `score` head) into a
frozen engine (no optimizer, as the trainer builds it) and reads its head at each sequence's last
valid token. Reference: the same checkpoint in transformers,
float64, whose logits are the head at the last non-padding token. Checked at 1 rank, TP=2 and PP=2,
with padded and packed micro-batches, for Qwen2 (QKV bias) and Llama, at TP=2 for Qwen3 and
Mistral; and for inputs without a response part (the layout the driver sends when the reward model
re-tokenises the text).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _launch import run_distributed
from engine_helpers import make_batch, make_hf_model

pytestmark = pytest.mark.distributed

PAD = 0
LAYOUTS_2 = [dict(tp=2), dict(pp=2)]


def _scores(rank: int, world: int, port: int, rm_dir: str, layouts: list, batches: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import init_distributed
    from megarl.workers.roles import RewardModelRole
    from megarl.workers.specs import EngineRoleSpec

    out = {}
    for layout_kw in layouts:
        for packed in (False, True):
            layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(**layout_kw))
            spec = EngineRoleSpec(name="reward_model", model_dir=rm_dir, layout=layout,
                                  engine=EngineConfig(role="reward", micro_batch_size=3, log_prob_micro_batch_size=3,
                                                      use_sequence_packing=packed, trained=False))
            role = RewardModelRole(SimpleNamespace(rank=rank), spec)
            role.init_model()
            for name, batch in batches.items():
                out[(str(layout_kw), packed, name)] = role.compute_rm_score(batch)["rm_scores"]
    return out


def _reward_model(kind: str, tmp_path) -> tuple[torch.nn.Module, str]:
    from transformers import AutoModelForSequenceClassification

    config = make_hf_model(kind, seed=3).config
    config.num_labels = 1
    config.pad_token_id = PAD
    torch.manual_seed(11)
    rm = AutoModelForSequenceClassification.from_config(config).float().eval()
    with torch.no_grad():  # non-trivial norms and biases, so that a wrong mapping shows
        for name, p in rm.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
        rm.score.weight.normal_(0.0, 0.5)
    path = tmp_path / f"rm_{kind}"
    rm.save_pretrained(path, safe_serialization=True)
    return rm, str(path)


def _batches() -> dict:
    batch = make_batch(seed=4, batch=6, prompt_len=7, response_len=6)
    valid = batch["attention_mask"].bool()
    ids = torch.where(valid & (batch["input_ids"] == PAD), torch.ones_like(batch["input_ids"]), batch["input_ids"])
    ids = torch.where(valid, ids, torch.full_like(ids, PAD))
    p = batch["prompts"].shape[1]
    rollout = {"input_ids": ids, "attention_mask": batch["attention_mask"], "responses": ids[:, p:],
               "position_ids": batch["position_ids"]}
    # The same rows as whole right-padded sequences with no response part (re-tokenised input).
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    whole_ids = torch.where(valid.gather(1, order), ids.gather(1, order), torch.full_like(ids, PAD))
    whole_mask = valid.gather(1, order).long()
    whole = {"input_ids": whole_ids, "attention_mask": whole_mask,
             "responses": torch.zeros(len(ids), 0, dtype=torch.long)}
    return {"rollout": rollout, "whole": whole}


def _reference(rm: torch.nn.Module, batch: dict) -> torch.Tensor:
    import copy

    ref = copy.deepcopy(rm).double()
    with torch.no_grad():
        return ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, 0]


@pytest.mark.parametrize("kind", ["qwen3", "mistral"])
def test_other_families_score_like_transformers_at_tp2(kind: str, tmp_path) -> None:
    """Qwen3 (QK-norm) and Mistral sequence-classification checkpoints at TP=2, padded and packed."""
    rm, rm_dir = _reward_model(kind, tmp_path)
    batches = _batches()
    want = _reference(rm, batches["rollout"])
    del batches["rollout"]["position_ids"]
    results = run_distributed(_scores, 2, rm_dir, [dict(tp=2)], batches)
    for key, value in results[0].items():
        err = (value.double() - want).abs().max().item()
        assert err < 1e-5, f"{kind} {key}: reward-model scores differ from transformers by {err}"


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_reward_model_scores_equal_transformers(kind: str, tmp_path) -> None:
    rm, rm_dir = _reward_model(kind, tmp_path)
    batches = _batches()
    want = _reference(rm, batches["rollout"])
    # transformers reads the last non-padding token; the engine reads the last valid one: same rows.
    del batches["rollout"]["position_ids"]

    got = run_distributed(_scores, 1, rm_dir, [dict()], batches)[0]
    for rank_results in run_distributed(_scores, 2, rm_dir, LAYOUTS_2, batches):
        got.update({k: v for k, v in rank_results.items() if k not in got})
        # Every rank (also the first pipeline stage) returns the scores.
        for key, value in rank_results.items():
            assert torch.equal(value, got[key]), f"{kind} {key}: ranks disagree"
    assert len(got) == 3 * 2 * 2
    worst = 0.0
    for key, value in got.items():
        err = (value.double() - want).abs().max().item()
        worst = max(worst, err)
        # fp32 engine vs float64 transformers over 2 layers of width 64: ~1e-6; a wrong token or
        # head gives O(0.1).
        assert err < 1e-5, f"{kind} {key}: reward-model scores differ from transformers by {err}"
    print(f"{kind}: max |score - transformers(float64)| over 1 rank/TP=2/PP=2 x padded/packed = {worst:.2e}")
