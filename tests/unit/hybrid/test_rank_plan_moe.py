"""Reshard plans with expert-parallel training (EP > 1) of a tiny Qwen3-MoE model (4 experts, 4
layers), also with an expert tensor-parallel size other than TP, into the HF engine: every rank's own plan must equal its slice of the whole-world plan with
the same sender rule, and both planners (least-loaded and by-rank senders) must deliver exactly the
HF tensors, each rank receiving exactly the elements its shard (its experts only) lacks."""

from __future__ import annotations

import pytest
import torch
from hybrid_reference import id_state_dict

from megarl.hybrid.executor import execute_plan_locally
from megarl.hybrid.plan import build_reshard_plan
from megarl.hybrid.rank_plan import RankPlanner
from megarl.hybrid.slices import hf_tensor_shapes, megatron_shards
from megarl.layout import ParallelLayout
from megarl.models.spec import ModelSpec
from megarl.models.weight_map import hf_to_megatron_state_dict

pytestmark = pytest.mark.unit

EXPERTS = 4
CONFIG = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=150, hidden_size=32,
              intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
              tie_word_embeddings=False, max_position_embeddings=64, rms_norm_eps=1e-6)
BUCKET = 4096
LAYOUTS = {
    "dp2ep2": dict(dp=2, ep=2),
    "dp4ep4": dict(dp=4, ep=4),
    "dp4ep2": dict(dp=4, ep=2),  # two replicas of each expert shard
    "tp2pp2dp2ep2": dict(tp=2, pp=2, dp=2, ep=2),
    "tp2dp2cp2ep4": dict(tp=2, dp=2, cp=2, ep=4),  # CP folded into the expert-parallel groups
    "pp2dp4ep2": dict(pp=2, dp=4, ep=2),
    # Expert TP != TP (Megatron's expert_tensor_parallel_size): experts whole on TP ranks, or split
    # over ranks that are data-parallel for the dense layers.
    "tp2dp2ep2etp1": dict(tp=2, dp=2, ep=2, etp=1),
    "tp2pp2dp2ep4etp1": dict(tp=2, pp=2, dp=2, ep=4, etp=1),
    "dp4ep2etp2": dict(dp=4, ep=2, etp=2),
    "tp2dp2etp1": dict(tp=2, dp=2, etp=1),  # ep 1: every rank holds every expert, unsplit
}


@pytest.fixture(scope="module")
def model() -> tuple[ModelSpec, dict[str, tuple[int, ...]], dict[str, torch.Tensor]]:
    spec = ModelSpec.from_hf_config(CONFIG)
    shapes = hf_tensor_shapes(spec)
    return spec, shapes, id_state_dict(shapes)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_rank_plans_equal_the_full_plan_and_deliver_the_weights(model, name: str) -> None:
    spec, shapes, hf = model
    train = ParallelLayout(**LAYOUTS[name])
    rollout = ParallelLayout.rollout(1, train.world_size)
    shards = {}
    for rank in range(train.world_size):
        c = train.coord(rank)
        shards[rank] = hf_to_megatron_state_dict(hf, spec, c.tp_rank, train.tp, c.pp_rank, train.pp,
                                                 ep_rank=c.ep_rank, ep_size=train.ep, etp_rank=c.etp_rank,
                                                 etp_size=train.etp)
    for senders in ("least_loaded", "by_rank"):
        plan = build_reshard_plan(spec, train, rollout, "hf", torch.float64, BUCKET, hf_shapes=shapes, senders=senders)
        for rank, (tensors, stats) in execute_plan_locally(plan, shards).items():
            assert sorted(tensors) == sorted(hf)
            for key, value in hf.items():
                assert torch.equal(tensors[key], value), f"{senders}, rank {rank}: {key}"
            held = torch.cat([t.reshape(-1) for t in shards[rank].values()])
            wanted = torch.cat([t.reshape(-1) for t in hf.values()])
            assert stats.bytes_received == int((~torch.isin(wanted, held)).sum()) * 8 == plan.bytes[rank].minimum
    planner = RankPlanner(spec, train, rollout, "hf", torch.float64, BUCKET, hf_shapes=shapes)
    for rank in range(train.world_size):
        assert planner.plan(rank) == plan.restrict(rank), f"rank {rank}"


def test_expert_shards_hold_only_their_experts(model) -> None:
    spec, shapes, _ = model
    names = {t.name for t in megatron_shards(spec, 0, 1, 0, 1, shapes, ep_rank=1, ep_size=2, experts=True)}
    dense = {t.name for t in megatron_shards(spec, 0, 1, 0, 1, shapes, experts=False)}
    every = {t.name for t in megatron_shards(spec, 0, 1, 0, 1, shapes, ep_rank=1, ep_size=2)}
    assert names and dense and names | dense == every and not names & dense
    experts = {b.hf_name.split(".experts.")[1].split(".")[0]
               for t in megatron_shards(spec, 0, 1, 0, 1, shapes, ep_rank=1, ep_size=2, experts=True) for b in t.blocks}
    assert experts == {"2", "3"}  # ep rank 1 of 2 holds the second half
