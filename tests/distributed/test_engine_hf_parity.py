"""Engine log-probs, entropy, values and reward scores equal HF transformers with the same weights
(tiny random Llama (GQA, tied and untied, Llama 3.x RoPE scaling), Qwen2 (QKV bias), Qwen3
(QK-norm), Mistral), with rows padded per micro-batch and packed into one row; the policy's output
layer computes only the positions that predict a response token."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _launch import run_distributed
from engine_helpers import hf_logprobs, hf_weight_names, make_batch, make_hf_model, save_hf_model

pytestmark = pytest.mark.distributed

KINDS = ["llama", "llama_tied", "llama_rope", "qwen2", "qwen3", "mistral"]


def _engine(hf_dir: str, cfg: dict) -> Any:
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.layout import ParallelLayout
    from megarl.models.spec import ModelSpec

    return MegatronEngine(ModelSpec.from_hf_config(hf_dir), ParallelLayout(), EngineConfig(**cfg))


def _log_probs_per_family(rank: int, world: int, port: int, dirs: dict, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    out = {}
    for kind, hf_dir in dirs.items():
        for packed in (False, True):
            # Padded on a trained engine (the actor), packed on a frozen one (the reference: no DDP
            # or optimizer, parameters without gradients).
            engine = _engine(hf_dir, {"micro_batch_size": 2, "use_sequence_packing": packed, "trained": not packed})
            engine.load_hf_weights(hf_dir)
            head_rows: list[int] = []  # positions (rows x columns) the output layer computes
            engine.model.output_layer.register_forward_hook(
                lambda m, args, output: head_rows.append(args[0].shape[0] * args[0].shape[1]))
            out[(kind, packed)] = engine.compute_log_prob(batch, temperature=1.3, calculate_entropy=True)
            out[(kind, packed)]["head_rows"] = sum(head_rows)
    bf16 = _engine(dirs["llama"], {"micro_batch_size": 4, "dtype": "bf16"})
    bf16.load_hf_weights(dirs["llama"])
    out["llama_bf16"] = bf16.compute_log_prob(batch, temperature=1.3)
    return out


def check_every_family(got: dict, models: dict, batch: dict, tolerance: float) -> None:
    """`_log_probs_per_family`'s results against HF's float64, padded and packed."""
    mask = batch["response_mask"].bool()
    for kind, model in models.items():
        ref_lp, ref_ent = hf_logprobs(model, batch, temperature=1.3)
        for packed in (False, True):
            res = got[(kind, packed)]
            lp_err = (res["log_probs"].double() - ref_lp)[mask].abs().max().item()
            ent_err = (res["entropys"].double() - ref_ent)[mask].abs().max().item()
            assert lp_err < tolerance and ent_err < tolerance, f"{kind} packed={packed}: errors {lp_err}, {ent_err}"
            # The output layer computed only the positions predicting a response token: batch x R.
            assert res["head_rows"] == mask.numel() < int(batch["attention_mask"].numel()), (kind, packed)


def test_log_probs_and_entropy_equal_hf_for_every_family() -> None:
    models = {kind: make_hf_model(kind, seed=i) for i, kind in enumerate(KINDS)}
    dirs = {kind: save_hf_model(m) for kind, m in models.items()}
    batch = make_batch(seed=3, batch=5)
    mask = batch["response_mask"].bool()
    got = run_distributed(_log_probs_per_family, 1, dirs, batch)[0]
    check_every_family(got, models, batch, tolerance=1e-5)
    # The RoPE scaling matters here: the same weights with plain RoPE give log-probs that differ by
    # far more than the tolerance above (7e-4 measured; the tiny model's attention is nearly uniform).
    plain = make_hf_model("llama", seed=KINDS.index("llama_rope"))
    plain.load_state_dict(models["llama_rope"].state_dict())
    scaled_lp, _ = hf_logprobs(models["llama_rope"], batch, temperature=1.3)
    assert (hf_logprobs(plain, batch, temperature=1.3)[0] - scaled_lp)[mask].abs().max() > 1e-4
    ref_lp, _ = hf_logprobs(models["llama"], batch, temperature=1.3)
    bf16_err = (got["llama_bf16"]["log_probs"].double() - ref_lp)[mask].abs().max().item()
    assert 0 < bf16_err < 0.5, f"bf16 log-probs off by {bf16_err}"


def _values_and_scores(rank: int, world: int, port: int, hf_dir: str, head: torch.Tensor, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed
    from megarl.models.weight_map import read_hf_tensors

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    out = {}
    for role in ("value", "reward"):  # the reward model frozen, as the trainer builds it
        engine = _engine(hf_dir, {"micro_batch_size": 3, "role": role, "trained": role == "value"})
        hf_sd = read_hf_tensors(hf_dir, [n for n in hf_weight_names(hf_dir) if n != "lm_head.weight"])
        engine.load_hf_state_dict({**hf_sd, "score.weight": head})
        out[role] = engine.compute_values(batch) if role == "value" else engine.compute_rm_score(batch)
    critic = _engine(hf_dir, {"micro_batch_size": 2, "role": "value", "lr": 3e-3})
    critic.load_hf_weights(hf_dir)  # a policy checkpoint: the head keeps its seeded init

    def value_loss(outputs: dict, mb: dict, n: Any) -> tuple[torch.Tensor, dict]:
        err = (outputs["values"] - mb["returns"]) ** 2 * mb["response_mask"]
        return 0.5 * err.sum() / n.global_num_tokens * n.dp_size, {}

    losses = [critic.train_step(batch, value_loss, mini_batch_size=5)["loss"][0] for _ in range(5)]
    out["critic_losses"] = losses
    return out



def test_values_and_reward_scores_equal_hf_hidden_states_times_head() -> None:
    model = make_hf_model("qwen2", seed=5)
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=4, batch=5)
    batch["returns"] = torch.ones(5, batch["responses"].shape[1])  # a constant target the head can reach
    head = torch.randn(1, 64) * 0.1
    got = run_distributed(_values_and_scores, 1, hf_dir, head, batch)[0]

    with torch.no_grad():
        hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                             position_ids=batch["position_ids"]).last_hidden_state.double()
    per_position = (hidden @ head.double().T)[..., 0]
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    mask = batch["response_mask"].bool()
    want_values = per_position[:, p - 1:p + r - 1]
    assert (got["value"].double() - want_values)[mask].abs().max() < 1e-5
    last = torch.tensor([max(i for i in range(p + r) if batch["attention_mask"][b, i]) for b in range(5)])
    want_scores = per_position[torch.arange(5), last]
    assert torch.allclose(got["reward"].double(), want_scores, atol=1e-5)
    losses = got["critic_losses"]
    assert losses[-1] < 0.5 * losses[0], f"critic did not fit the returns: {losses}"
