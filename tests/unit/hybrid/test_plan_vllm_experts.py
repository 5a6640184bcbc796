"""Reshard plans of mixture-of-experts models into vLLM's fused expert parameters at rollout TP 2:
for tiny Qwen3-MoE and Qwen2-MoE (shared expert) models trained at EP=2 (with and without TP and
PP, and with an expert tensor-parallel size other than TP), the executor writes every rollout rank's `mlp.experts.routed_experts.w13_weight` (E, 2 I/TP,
H) and `w2_weight` (E, H, I/TP) through per-expert views, and they equal the tensors written out by hand
from the HF checkpoint tensors in vLLM's layout (expert e: [gate rows of rank r | up rows of rank
r]; down_proj columns of rank r); the shared expert lands in `gate_up_proj` / `down_proj` shards;
every rank receives exactly the plan's minimum."""

from __future__ import annotations

import pytest
import torch
from hybrid_reference import id_state_dict

from megarl.hybrid.executor import execute_plan_locally
from megarl.hybrid.plan import build_reshard_plan
from megarl.hybrid.slices import hf_tensor_shapes, vllm_expert_view
from megarl.layout import ParallelLayout
from megarl.models.spec import ModelSpec
from megarl.models.weight_map import hf_to_megatron_state_dict

pytestmark = pytest.mark.unit

E, I, H, LAYERS, SHARED = 4, 16, 32, 2, 24
COMMON = dict(vocab_size=150, hidden_size=H, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, num_experts=E, num_experts_per_tok=2, moe_intermediate_size=I,
              tie_word_embeddings=False, max_position_embeddings=64, rms_norm_eps=1e-6)
CONFIGS = {
    "qwen3_moe": dict(COMMON, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=8,
                      norm_topk_prob=True),
    "qwen2_moe": dict(COMMON, model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
                      shared_expert_intermediate_size=SHARED, norm_topk_prob=False),
}
LAYOUTS = {"dp2ep2": dict(dp=2, ep=2), "tp2dp2ep2": dict(tp=2, dp=2, ep=2), "pp2dp2ep2": dict(pp=2, dp=2, ep=2),
           "tp2dp2ep2etp1": dict(tp=2, dp=2, ep=2, etp=1), "dp4ep2etp2": dict(dp=4, ep=2, etp=2)}
ROLLOUT_TP = 2


def _expected(hf: dict[str, torch.Tensor], layer: int, r: int) -> dict[str, torch.Tensor]:
    """vLLM's per-rank fused tensors of one MoE layer, by hand from the HF tensors."""
    p, pre = I // ROLLOUT_TP, f"model.layers.{layer}.mlp."
    rows = slice(r * p, (r + 1) * p)
    gate, up, down = ([hf[f"{pre}experts.{e}.{leaf}.weight"] for e in range(E)]
                      for leaf in ("gate_proj", "up_proj", "down_proj"))
    out = {
        pre + "experts.routed_experts.w13_weight": torch.stack([torch.cat([g[rows], u[rows]])
                                                                 for g, u in zip(gate, up)]),
        pre + "experts.routed_experts.w2_weight": torch.stack([d[:, rows] for d in down]),
        pre + "gate.weight": hf[pre + "gate.weight"],
    }
    if pre + "shared_expert.gate_proj.weight" in hf:
        s = slice(r * SHARED // ROLLOUT_TP, (r + 1) * SHARED // ROLLOUT_TP)
        out[pre + "shared_expert.gate_up_proj.weight"] = torch.cat([hf[pre + "shared_expert.gate_proj.weight"][s],
                                                                    hf[pre + "shared_expert.up_proj.weight"][s]])
        out[pre + "shared_expert.down_proj.weight"] = hf[pre + "shared_expert.down_proj.weight"][:, s]
        out[pre + "shared_expert_gate.weight"] = hf[pre + "shared_expert_gate.weight"]
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", list(CONFIGS))
def test_experts_land_in_vllm_fused_parameters(family: str, layout: str) -> None:
    spec = ModelSpec.from_hf_config(CONFIGS[family])
    shapes = hf_tensor_shapes(spec)
    hf = id_state_dict(shapes)
    train = ParallelLayout(**LAYOUTS[layout])
    shards = {}
    for rank in range(train.world_size):
        c = train.coord(rank)
        shards[rank] = hf_to_megatron_state_dict(hf, spec, c.tp_rank, train.tp, c.pp_rank, train.pp,
                                                 ep_rank=c.ep_rank, ep_size=train.ep, etp_rank=c.etp_rank,
                                                 etp_size=train.etp)
    plan = build_reshard_plan(spec, train, ParallelLayout.rollout(ROLLOUT_TP, train.world_size), "vllm",
                              torch.float64, 4096, hf_shapes=shapes)
    # vLLM's parameters of each rank, written through per-expert views as the live sync does.
    params: dict[int, dict[str, torch.Tensor]] = {}
    out: dict[int, dict[str, torch.Tensor]] = {}
    for rank in range(train.world_size):
        params[rank], out[rank] = {}, {}
        for t in plan.engine_tensors[rank]:
            view = vllm_expert_view(t.name)
            if view is None:
                out[rank][t.name] = params[rank][t.name] = torch.zeros(t.shape, dtype=torch.float64)
                continue
            base, e = view
            fused = params[rank].setdefault(base, torch.zeros((E, *t.shape), dtype=torch.float64))
            out[rank][t.name] = fused[e]
    done = execute_plan_locally(plan, shards, out=out)
    for rank, (_, stats) in done.items():
        r = train.coord(rank).rank % ROLLOUT_TP
        got = params[rank]
        assert got["model.layers.0.mlp.experts.routed_experts.w13_weight"].shape == (E, 2 * I // ROLLOUT_TP, H)
        for layer in range(LAYERS):
            for name, want in _expected(hf, layer, r).items():
                assert torch.equal(got[name], want), f"{family} {layout} rank {rank}: {name}"
        assert stats.bytes_received == plan.bytes[rank].minimum > 0


def test_expert_engine_tensor_names() -> None:
    spec = ModelSpec.from_hf_config(CONFIGS["qwen3_moe"])
    plan = build_reshard_plan(spec, ParallelLayout(dp=2, ep=2), ParallelLayout.rollout(2, 2), "vllm", torch.float32)
    names = {t.name for t in plan.engine_tensors[1]}
    pre = "model.layers.1.mlp.experts.routed_experts."
    assert pre + "w13_weight[3]" in names and pre + "w2_weight[0]" in names
    assert not any(".experts.0." in n for n in names)
    assert vllm_expert_view(pre + "w2_weight[3]") == (pre + "w2_weight", 3)
    assert vllm_expert_view("model.layers.1.mlp.gate.weight") is None

