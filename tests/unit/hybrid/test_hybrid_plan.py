"""Reshard plans for many training -> rollout layouts, executed in one process with an in-memory
transport: every rollout rank's engine tensors must equal shards cut by hand from the HF weights,
every rank must receive exactly the bytes of its shard it does not already hold, and no rank may
assemble a whole tensor unless the rollout TP size is 1."""

from __future__ import annotations

import pytest
import torch
from hybrid_reference import KV_HEADS, expected_vllm_shard, hf_shapes, id_state_dict, tiny_config

from megarl.errors import ConfigError
from megarl.hybrid.executor import execute_plan_locally
from megarl.hybrid.plan import build_reshard_plan
from megarl.layout import ParallelLayout
from megarl.models.spec import ModelSpec
from megarl.models.weight_map import hf_to_megatron_state_dict

LAYERS = 2
BUCKET = 2048  # small, so that the larger tensors move in several buckets

# (train layout, rollout tp, engine layout)
LAYOUTS = {
    "tp2->tp1": (dict(tp=2), 1, "hf"),
    "pp2->tp1": (dict(pp=2), 1, "hf"),
    "tp1dp2->tp2": (dict(dp=2), 2, "vllm"),
    "tp2->tp2": (dict(tp=2), 2, "vllm"),
    "tp2dp2->tp2": (dict(tp=2, dp=2), 2, "vllm"),
    "tp2pp2->tp2": (dict(tp=2, pp=2), 2, "vllm"),
    "tp2pp2->tp1": (dict(tp=2, pp=2), 1, "hf"),
    "cp2->tp1": (dict(cp=2), 1, "hf"),
    "tp2dp2->tp4": (dict(tp=2, dp=2), 4, "vllm"),  # fewer kv heads (2) than rollout TP: replicated
    "pp2dp2->tp2": (dict(pp=2, dp=2), 2, "vllm"),
    "tp2->tp1-vllm": (dict(tp=2), 1, "vllm"),
}


def _setup(tied: bool, train_kw: dict, rollout_tp: int, engine: str):
    spec = ModelSpec.from_hf_config(tiny_config(tied, LAYERS))
    shapes = hf_shapes(tied, LAYERS)
    hf = id_state_dict(shapes)
    train = ParallelLayout(**{"dp": 1, **train_kw})
    plan = build_reshard_plan(spec, train, ParallelLayout.rollout(rollout_tp, train.world_size), engine,
                              torch.float64, BUCKET, hf_shapes=shapes)
    shards = {}
    for rank in range(train.world_size):
        c = train.coord(rank)
        shards[rank] = hf_to_megatron_state_dict(hf, spec, c.tp_rank, train.tp, c.pp_rank, train.pp)
    return spec, hf, train, plan, shards


def _expected(hf: dict, engine: str, rank: int, rollout_tp: int, tied: bool) -> dict[str, torch.Tensor]:
    if engine == "hf":
        return hf
    return expected_vllm_shard(hf, rank % rollout_tp, rollout_tp, LAYERS, tied)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_engine_tensors_equal_hand_cut_shards_and_bytes_are_minimal(name: str, tied: bool) -> None:
    train_kw, rollout_tp, engine = LAYOUTS[name]
    _, hf, train, plan, shards = _setup(tied, train_kw, rollout_tp, engine)
    results = execute_plan_locally(plan, shards)
    for rank, (tensors, stats) in results.items():
        expected = _expected(hf, engine, rank, rollout_tp, tied)
        assert sorted(tensors) == sorted(expected)
        for key, value in expected.items():
            assert torch.equal(tensors[key], value), f"rank {rank}: {key}"
        # Independent minimum: ids of this rank's rollout shard that its training shard lacks.
        held = torch.cat([t.reshape(-1) for t in shards[rank].values()])
        wanted = torch.cat([t.reshape(-1) for t in expected.values()])
        wanted = wanted[wanted != 0]  # vocabulary padding is zero-filled, not moved
        missing = int((~torch.isin(wanted, held)).sum()) * 8
        assert stats.bytes_received == missing == plan.bytes[rank].minimum
        assert stats.largest_buffer_numel * 8 <= BUCKET
    assert sum(s.bytes_sent for _, s in results.values()) == sum(s.bytes_received for _, s in results.values())


@pytest.mark.parametrize("name", ["tp2->tp2", "tp1dp2->tp2", "tp2dp2->tp2"])
def test_matching_tensor_parallel_moves_only_vocab_boundary_rows(name: str) -> None:
    train_kw, rollout_tp, engine = LAYOUTS[name]
    _, _, _, plan, _ = _setup(False, train_kw, rollout_tp, engine)
    moved = {p.dst_name for step in plan.steps for pieces in step.values() for p in pieces}
    # Megatron pads the vocabulary to 128*tp rows, vLLM to 64: only those split points differ.
    assert moved <= {"model.embed_tokens.weight", "lm_head.weight"}
    if train_kw.get("tp", 1) == 1:
        assert plan.total_received() == 0


@pytest.mark.parametrize("name", ["tp2->tp2", "tp2dp2->tp4", "tp2pp2->tp2", "tp1dp2->tp2"])
def test_rollout_tp_above_one_never_assembles_a_full_tensor(name: str) -> None:
    train_kw, rollout_tp, engine = LAYOUTS[name]
    _, hf, _, plan, shards = _setup(False, train_kw, rollout_tp, engine)
    whole = expected_vllm_shard(hf, 0, 1, LAYERS, False)  # the unsharded vLLM tensors
    results = execute_plan_locally(plan, shards)
    for tensors, stats in results.values():
        assert stats.largest_engine_tensor_numel < max(t.numel() for t in whole.values())
        assert stats.largest_buffer_numel * 8 <= BUCKET
        for key, t in tensors.items():
            if not key.endswith("norm.weight"):  # norms are replicated in vLLM too
                assert t.numel() < whole[key].numel(), key


def test_sources_spread_over_data_parallel_replicas() -> None:
    # TP2 x DP2 -> TP1: ranks 0/2 hold TP shard 0, ranks 1/3 shard 1. Receivers must not all pull
    # from one replica: replicas of a shard send within one piece of each other.
    _, _, _, plan, _ = _setup(False, dict(tp=2, dp=2), 1, "hf")
    sent = [plan.bytes[r].sent for r in range(4)]
    largest = max(p.nbytes for step in plan.steps for ps in step.values() for p in ps)
    assert min(sent) > 0
    assert abs(sent[0] - sent[2]) <= largest and abs(sent[1] - sent[3]) <= largest
    assert sum(sent) == plan.total_received()


def test_buckets_are_bounded_and_pieces_keep_every_row() -> None:
    _, _, _, plan, _ = _setup(False, dict(tp=2, pp=2), 1, "hf")
    assert len(plan.steps) > 1
    for step in plan.steps:
        for (src, dst), pieces in step.items():
            assert src != dst and sum(p.nbytes for p in pieces) <= BUCKET
    # Rows per (destination, parameter) add up to the parameter's real rows.
    for rank, params in plan.engine_tensors.items():
        got: dict[str, int] = {}
        pieces = list(plan.local_pieces[rank]) + [p for s in plan.steps for (_, d), ps in s.items() if d == rank for p in ps]
        for p in pieces:
            got[p.dst_name] = got.get(p.dst_name, 0) + p.length
        for t in params:
            assert got[t.name] == t.covered_rows, t.name


def test_qkv_fusion_orders_differ_between_megatron_and_vllm() -> None:
    # A guard that the tests would notice a wrong fusion order: with two query groups on one rank,
    # Megatron's per-group [q, k, v] rows are a permutation of vLLM's [q | k | v], not equal to it.
    spec = ModelSpec.from_hf_config(tiny_config(False, LAYERS))
    hf = id_state_dict(hf_shapes(False, LAYERS))
    megatron_qkv = hf_to_megatron_state_dict(hf, spec, 0, 1, 0, 1)["decoder.layers.0.self_attention.linear_qkv.weight"]
    vllm_qkv = expected_vllm_shard(hf, 0, 1, LAYERS, False)["model.layers.0.self_attn.qkv_proj.weight"]
    assert megatron_qkv.shape == vllm_qkv.shape and KV_HEADS == 2
    assert not torch.equal(megatron_qkv, vllm_qkv)
    assert torch.equal(megatron_qkv.flatten().sort().values, vllm_qkv.flatten().sort().values)


def test_bad_inputs_give_clear_errors() -> None:
    spec = ModelSpec.from_hf_config(tiny_config(False, LAYERS))
    shapes = hf_shapes(False, LAYERS)
    tp2 = ParallelLayout(tp=2, dp=1)
    with pytest.raises(ConfigError, match="world size"):
        build_reshard_plan(spec, tp2, ParallelLayout.rollout(1, 4), hf_shapes=shapes)
    with pytest.raises(ConfigError, match="needs rollout tp=1"):
        build_reshard_plan(spec, tp2, ParallelLayout.rollout(2, 2), "hf", hf_shapes=shapes)
    with pytest.raises(ConfigError, match="bucket_bytes"):
        build_reshard_plan(spec, tp2, ParallelLayout.rollout(1, 2), "hf", bucket_bytes=16, hf_shapes=shapes)
    with pytest.raises(ConfigError, match="valid"):
        build_reshard_plan(spec, tp2, ParallelLayout.rollout(1, 2), "sglang", hf_shapes=shapes)
    hf = id_state_dict(shapes)
    shards = {r: hf_to_megatron_state_dict(hf, spec, r, 2, 0, 1) for r in range(2)}
    plan32 = build_reshard_plan(spec, tp2, ParallelLayout.rollout(1, 2), "hf", hf_shapes=shapes)
    with pytest.raises(ConfigError, match="is torch.float64, the plan was built for torch.float32"):
        execute_plan_locally(plan32, shards)
    plan = build_reshard_plan(spec, tp2, ParallelLayout.rollout(1, 2), "hf", torch.float64, hf_shapes=shapes)
    del shards[1]["decoder.final_layernorm.weight"]
    with pytest.raises(ConfigError, match="rank 1 lacks training shard 'decoder.final_layernorm.weight'"):
        execute_plan_locally(plan, shards)


def test_hf_shapes_from_the_spec_match_the_hand_written_ones() -> None:
    from megarl.hybrid.slices import hf_tensor_shapes

    for tied in (False, True):
        spec = ModelSpec.from_hf_config(tiny_config(tied, LAYERS))
        got = hf_tensor_shapes(spec)
        if tied:  # HF lists the tied lm_head in its state dict; the plan never uses it
            assert got.pop("lm_head.weight") == got["model.embed_tokens.weight"]
        assert got == hf_shapes(tied, LAYERS)


def test_layout_coordinates_follow_megatron_order() -> None:
    layout = ParallelLayout(tp=2, pp=2, dp=2, cp=2)
    coords = [layout.coord(r) for r in range(layout.world_size)]
    assert [c.tp_rank for c in coords[:4]] == [0, 1, 0, 1] and [c.cp_rank for c in coords[:4]] == [0, 0, 1, 1]
    assert coords[4].dp_rank == 1 and coords[8].pp_rank == 1 and coords[8].dp_rank == 0
    assert all(layout.rank(c) == r for r, c in enumerate(coords))
    rollout = ParallelLayout.rollout(2, 8).coord(5)
    assert (rollout.dp_rank, rollout.tp_rank) == (2, 1)
    # Megatron's own rank generator (default order) must put the same ranks in each TP/PP group.
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order="tp-cp-ep-dp-pp")
    for token, field in (("tp", "tp_rank"), ("pp", "pp_rank"), ("dp", "dp_rank"), ("cp", "cp_rank")):
        for group in gen.get_ranks(token):
            others = {tuple(getattr(coords[r], f) for f in ("tp_rank", "cp_rank", "dp_rank", "pp_rank") if f != field)
                      for r in group}
            assert len(others) == 1, (token, group)
            assert sorted(getattr(coords[r], field) for r in group) == list(range(len(group)))


def test_writes_into_given_tensors_casting_and_zeroing_padding() -> None:
    # Outputs prefilled with NaN in another dtype: every row must be written (padding with zeros).
    _, hf, train, plan, shards = _setup(True, dict(tp=2), 2, "vllm")
    out = {r: {t.name: torch.full(t.shape, float("nan"), dtype=torch.float32) for t in plan.engine_tensors[r]}
           for r in range(train.world_size)}
    results = execute_plan_locally(plan, shards, out)
    for rank, (tensors, _) in results.items():
        for key, value in expected_vllm_shard(hf, rank, 2, LAYERS, True).items():
            assert tensors[key] is out[rank][key]
            assert torch.equal(out[rank][key], value.float()), key


def test_te_spec_names_map_to_local_spec_names() -> None:
    from megarl.hybrid.sync import training_shards

    spec = ModelSpec.from_hf_config(tiny_config(False, 4))
    te = [("decoder.layers.1.self_attention.linear_qkv.layer_norm_weight", torch.ones(1)),
          ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", torch.ones(2)),
          ("decoder.layers.0.mlp.linear_fc2.weight", torch.ones(3))]
    got = training_shards(te, spec, pp_rank=1, pp_size=2)
    assert sorted(got) == ["decoder.layers.0.mlp.linear_fc2.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
                           "decoder.layers.1.input_layernorm.weight"]
