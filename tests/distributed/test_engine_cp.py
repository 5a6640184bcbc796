"""Context parallelism (cp=2) on two gloo processes: log-probs, entropy, values and reward scores
equal HF transformers (float64) with padded, packed and token-budget micro-batches whose widths are
not multiples of 2*cp; one optimizer step equals the hand-written float64 AdamW step (policy) and the
same step at cp=1 (critic), so the gradient scale over DP x CP is right."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _launch import run_distributed
from engine_helpers import (
    GRAD_RTOL,
    adam_weight_atol,
    gather_hf_state,
    hf_logprobs,
    make_batch,
    make_hf_model,
    pg_loss_fn,
    reference_train_step,
    save_hf_model,
)

pytestmark = pytest.mark.distributed

TRAIN_CFG = dict(lr=1e-2, eps=1e-2, weight_decay=0.0, clip_grad=1.0, micro_batch_size=2)
CRITIC_CLIP = 1e9  # no clipping
FORWARD_CFGS = {
    "padded": dict(micro_batch_size=4),
    "packed": dict(micro_batch_size=3, use_sequence_packing=True),
    # A token budget per CP rank: 8 positions per rank hold up to 16 tokens of one micro-batch.
    "dynamic": dict(use_dynamic_bsz=True, max_token_len_per_micro_batch=8),
    "dynamic_packed": dict(use_dynamic_bsz=True, max_token_len_per_micro_batch=8, use_sequence_packing=True),
}


def _engine(hf_dir: str, layout: Any, cfg: dict, hf_sd: dict | None = None) -> Any:
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.models.spec import ModelSpec

    engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), layout, EngineConfig(**cfg))
    if hf_sd is None:
        engine.load_hf_weights(hf_dir)
    else:
        engine.load_hf_state_dict(hf_sd)
    return engine


def _hf_state(hf_dir: str, head: torch.Tensor) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd = load_file(f"{hf_dir}/model.safetensors")
    sd.pop("lm_head.weight", None)
    return {**sd, "score.weight": head}


def _forward_cp2(rank: int, world: int, port: int, hf_dir: str, head: torch.Tensor, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(cp=2))
    assert (layout.cp, layout.dp) == (2, 1)
    out: dict[str, Any] = {}
    for name, cfg in FORWARD_CFGS.items():
        engine = _engine(hf_dir, layout, cfg)
        micro = engine._micro_batches(batch)
        out[name] = engine.compute_log_prob(batch, temperature=0.7, calculate_entropy=True)
        out[name + "_plan"] = [(len(m["index"]), int(m["rows"].tokens.shape[1]), int(m["tokens"].shape[1]))
                               for m in micro]
    hf_sd = _hf_state(hf_dir, head)
    out["values"] = _engine(hf_dir, layout, {"micro_batch_size": 4, "role": "value"}, hf_sd).compute_values(batch)
    reward = _engine(hf_dir, layout, {"micro_batch_size": 3, "role": "reward", "use_sequence_packing": True}, hf_sd)
    out["scores"] = reward.compute_rm_score(batch)
    return out


def test_cp2_log_probs_entropy_values_and_scores_equal_hf() -> None:
    model = make_hf_model("llama")  # GQA: 4 query heads, 2 key/value groups
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=11, batch=6, prompt_len=7, response_len=6)
    head = torch.randn(1, 64, generator=torch.Generator().manual_seed(3)) * 0.1
    ref_lp, ref_ent = hf_logprobs(model, batch, temperature=0.7)
    mask = batch["response_mask"].bool()
    results = run_distributed(_forward_cp2, 2, hf_dir, head, batch)
    for name in FORWARD_CFGS:
        plan = results[0][name + "_plan"]
        assert sum(rows for rows, _, _ in plan) == 6
        if name == "padded":  # trimmed widths, padded to a multiple of 4, each rank keeps half
            assert any(width % 4 for _, width, _ in plan), plan
            assert all(local == -(-width // 4) * 2 for _, width, local in plan), plan
        if name.startswith("dynamic"):  # the budget is per rank: more than 8 tokens per micro-batch
            assert len(plan) > 1 and all(local <= 8 for _, _, local in plan), plan
        for rank_result in results:
            for key, ref in (("log_probs", ref_lp), ("entropys", ref_ent)):
                got = rank_result[name][key].double()
                err = (got - ref)[mask].abs().max().item()
                assert err < 2e-5, f"cp=2 {name} {key}: max error {err}"
                assert torch.all(got[~mask] == 0), f"cp=2 {name} {key}: padding not zeroed"

    with torch.no_grad():
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=batch["position_ids"]).last_hidden_state.double()
    per_position = (hidden @ head.double().T)[..., 0]
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    last = batch["attention_mask"].shape[1] - 1 - batch["attention_mask"].flip(1).argmax(1)
    for rank_result in results:
        values_err = (rank_result["values"].double() - per_position[:, p - 1:p + r - 1])[mask].abs().max()
        assert values_err < 1e-5, f"cp=2 values off by {values_err}"
        scores = rank_result["scores"].double()
        assert torch.allclose(scores, per_position[torch.arange(6), last], atol=1e-5), scores


def _value_loss(outputs: dict, mb: dict, n: Any) -> tuple[torch.Tensor, dict]:
    err = (outputs["values"] - mb["returns"]) ** 2 * mb["response_mask"]
    return 0.5 * err.sum() / n.global_num_tokens * n.dp_size, {}


def _train(rank: int, world: int, port: int, hf_dir: str, head: torch.Tensor, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    out: dict[str, Any] = {}
    hf_sd = _hf_state(hf_dir, head)
    critic_cfg = dict(TRAIN_CFG, role="value", clip_grad=CRITIC_CLIP)
    for name, kw in (("cp2", dict(cp=2)), ("dp2", dict())):
        layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(**kw))
        if name == "cp2":
            policy = _engine(hf_dir, layout, dict(TRAIN_CFG, use_dynamic_bsz=True, max_token_len_per_micro_batch=12,
                                          use_sequence_packing=True))
            metrics = policy.train_step(batch, pg_loss_fn, mini_batch_size=6, calculate_entropy=True)
            out["policy"] = (gather_hf_state(policy), metrics)
        critic = _engine(hf_dir, layout, critic_cfg, hf_sd)
        r = critic.ranks
        shard = {k: v.chunk(r.dp_size)[r.dp_rank] for k, v in batch.items()}
        metrics = critic.train_step(shard, _value_loss, mini_batch_size=len(shard["responses"]))
        out[name] = (gather_hf_state(critic), metrics)
    return out


def test_cp2_optimizer_step_equals_reference_and_cp1() -> None:
    model = make_hf_model("qwen2")  # q/k/v biases
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=12, batch=6, prompt_len=7, response_len=6)
    batch["returns"] = torch.randn(6, 6, generator=torch.Generator().manual_seed(4))
    head = torch.randn(1, 64, generator=torch.Generator().manual_seed(5)) * 0.1
    want, want_norm = reference_train_step(model, batch, lr=TRAIN_CFG["lr"], eps=TRAIN_CFG["eps"],
                                           clip_grad=TRAIN_CFG["clip_grad"])
    before = model.state_dict()
    results = run_distributed(_train, 2, hf_dir, head, batch)

    got, metrics = results[0]["policy"]
    assert metrics["grad_norm"][0] == pytest.approx(want_norm, rel=1e-4)
    assert results[1]["policy"][1]["loss"] == metrics["loss"], "CP ranks report different losses"
    atol = adam_weight_atol(TRAIN_CFG["lr"], TRAIN_CFG["eps"], want_norm, TRAIN_CFG["clip_grad"])
    for key, value in got.items():
        err = (value - want[key]).abs().max().item()
        moved = (want[key] - before[key]).abs().max().item()
        assert err < atol, f"policy cp=2 {key}: max error {err} (the step moved it by {moved})"

    cp2, dp2 = results[0]["cp2"], results[0]["dp2"]
    start = _hf_state(hf_dir, head)
    assert cp2[1]["loss"][0] == pytest.approx(dp2[1]["loss"][0], rel=GRAD_RTOL)
    grad_norm = dp2[1]["grad_norm"][0]
    assert cp2[1]["grad_norm"][0] == pytest.approx(grad_norm, rel=GRAD_RTOL)
    # Not clipped (clip_grad 1e9): the bound scales with the gradient's norm.
    atol = adam_weight_atol(TRAIN_CFG["lr"], TRAIN_CFG["eps"], grad_norm, CRITIC_CLIP)
    for key, value in cp2[0].items():
        moved = (value - start[key]).abs().max().item()
        err = (value - dp2[0][key]).abs().max().item()
        assert err < atol, f"critic cp=2 vs cp=1 {key}: max error {err} (the step moved it by {moved})"
    assert (cp2[0]["score.weight"] - head).abs().max() > 1e-4  # the head did train
