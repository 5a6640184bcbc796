"""Mixture-of-experts models in the engine (Megatron-Core local spec on CPU: alltoall token
dispatcher, sequential experts): log-probs equal HF transformers with the same weights (Qwen3-MoE
with renormalised top-k, Qwen2-MoE with unnormalised top-k and a gated shared expert), at TP=2
and with the experts split over two expert-parallel ranks; one optimizer step at EP=2 gives the
weights of a float64 hand-written AdamW step on the HF model. At TP=2 with expert tensor
parallelism 1 (each expert whole on one rank, EP=2 over four ranks) the log-probs still equal
HF's, and a checkpoint saved there resumes at expert TP 2. (TP=2 training, which Megatron
allows only with sequence parallelism: test_engine_sp.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from _launch import run_distributed
from engine_helpers import (
    adam_weight_atol,
    hf_logprobs,
    make_batch,
    make_moe_model,
    pg_loss_fn,
    reference_train_step,
    save_hf_model,
    scratch_dir,
    with_state,
)

pytestmark = pytest.mark.distributed

# A large eps keeps the Adam update proportional to the gradient, so gradient errors show.
LR, EPS, CLIP = 1e-2, 1e-2, 1.0


def _engine(hf_dir: str, cfg: dict) -> Any:
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.layout import ParallelLayout
    from megarl.models.spec import ModelSpec

    return MegatronEngine(ModelSpec.from_hf_config(hf_dir), ParallelLayout(), EngineConfig(**cfg))


def _hf_state(engine: Any) -> dict[str, torch.Tensor]:
    """Every rank's weights -> one HF state dict (TP=1 here; experts gathered over EP ranks)."""
    from megatron.core import parallel_state as ps

    from megarl.models.weight_map import stage_entries, unfuse

    assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_pipeline_model_parallel_world_size() == 1
    local = dict(engine.get_named_weights())
    mine = {}
    for entry, name, hf_names in stage_entries(engine.spec, 0, 1, False, engine.ranks.ep_rank, engine.ranks.ep_size):
        full = local[name].float().cpu()
        if entry.vocab_padded:
            full = full[: engine.spec.vocab_size]
        mine.update(zip(hf_names, (t.clone() for t in unfuse(entry, full, engine.spec))))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict[str, torch.Tensor] = {}
    for sd in everyone:
        out.update(sd)
    return out


def _log_probs(rank: int, world: int, port: int, dirs: dict, layout: dict, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(**layout))
    dp = world // layout.get("tp", 1)
    rows = torch.arange(len(batch["responses"])).chunk(dp)
    from megatron.core import parallel_state as ps

    mine = rows[ps.get_data_parallel_rank()]
    out = {}
    for kind, hf_dir in dirs.items():
        for packed in (False, True):
            # Padded on a trained engine (the actor), packed on a frozen one (the reference: no DDP
            # or optimizer, parameters without gradients).
            engine = _engine(hf_dir, {"micro_batch_size": 2, "use_sequence_packing": packed, "trained": not packed})
            engine.load_hf_weights(hf_dir)
            res = engine.compute_log_prob({k: v[mine] for k, v in batch.items()}, temperature=1.3,
                                          calculate_entropy=True)
            out[(kind, packed)] = (mine, res)
    return out


@pytest.mark.parametrize("layout,world", [({}, 1), ({"tp": 2}, 2), ({"ep": 2}, 2),
                                          ({"tp": 2, "ep": 2, "etp": 1}, 4)],
                         ids=["single", "tp2", "ep2_dp2", "tp2_ep2_etp1"])
def test_moe_log_probs_equal_hf(layout: dict, world: int) -> None:
    models = {kind: make_moe_model(kind, seed=i) for i, kind in enumerate(("qwen3_moe", "qwen2_moe"))}
    dirs = {kind: save_hf_model(m) for kind, m in models.items()}
    batch = make_batch(seed=11, batch=6)
    got = run_distributed(_log_probs, world, dirs, layout, batch)
    for kind, model in models.items():
        ref_lp, ref_ent = hf_logprobs(model, batch, temperature=1.3)
        for packed in (False, True):
            seen = torch.zeros(len(ref_lp), dtype=torch.bool)
            for per_rank in got:
                rows, res = per_rank[(kind, packed)]
                mask = batch["response_mask"][rows].bool()
                lp_err = (res["log_probs"].double() - ref_lp[rows])[mask].abs().max().item()
                ent_err = (res["entropys"].double() - ref_ent[rows])[mask].abs().max().item()
                assert lp_err < 1e-5 and ent_err < 1e-5, f"{kind} {layout} packed={packed}: {lp_err}, {ent_err}"
                seen[rows] = True
            assert bool(seen.all())


def _one_step(rank: int, world: int, port: int, hf_dir: str, layout: dict, batch: dict) -> dict:
    from megatron.core import parallel_state as ps

    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(**layout))
    engine = _engine(hf_dir, {"micro_batch_size": 2, "lr": LR, "eps": EPS, "clip_grad": CLIP,
                              "weight_decay": 0.0})
    engine.load_hf_weights(hf_dir)
    rows = torch.arange(len(batch["responses"])).chunk(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
    metrics = engine.train_step({k: v[rows] for k, v in batch.items()}, pg_loss_fn,
                                mini_batch_size=len(rows), calculate_entropy=True)
    return {"state": _hf_state(engine), "grad_norm": metrics["grad_norm"][0]}


def test_one_step_with_experts_split_over_two_ranks_equals_float64_adamw() -> None:
    model = make_moe_model("qwen3_moe", seed=7)
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=12, batch=6)
    want, want_norm = reference_train_step(model, batch, LR, EPS, CLIP)
    # HF keeps experts fused in memory; its checkpoint (what the engine reads) has them one by one.
    from safetensors.torch import load_file

    ref_dir = save_hf_model(with_state(model, want))
    want_files = load_file(f"{ref_dir}/model.safetensors")
    start = load_file(f"{hf_dir}/model.safetensors")
    got = run_distributed(_one_step, 2, hf_dir, {"ep": 2}, batch)
    for per_rank in got:
        assert abs(per_rank["grad_norm"] - want_norm) < 1e-4 * want_norm
        state = per_rank["state"]
        assert set(state) == set(want_files)
        moved = 0
        atol = adam_weight_atol(LR, EPS, want_norm, CLIP)  # 2e-5: see engine_helpers
        for name, w in want_files.items():
            err = (state[name] - w).abs().max().item()
            assert err < atol, f"{name}: {err}"
            moved += int((w - start[name]).abs().max() > 1e-4)
        assert moved > len(want_files) // 2, "the step should change most tensors"


def _save_ep2_resume_dp2(rank: int, world: int, port: int, hf_dir: str, batches: list, ckpt_dir: str,
                         distributed_optimizer: bool = True) -> dict:
    """Two steps with experts split over two ranks, save; a fresh engine with all experts on each
    rank (ep=1, dp=2) loads it; both take the third step."""
    from megarl.megatron.checkpoint import adam_step
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    def engine_at(layout: dict) -> Any:
        init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(**layout))
        engine = _engine(hf_dir, {"micro_batch_size": 2, "lr": LR, "eps": EPS, "clip_grad": CLIP,
                                  "weight_decay": 0.0, "use_distributed_optimizer": distributed_optimizer})
        engine.load_hf_weights(hf_dir)
        return engine

    def step(engine: Any, batch: dict) -> None:
        r = engine.ranks
        shard = {k: v.chunk(r.dp_size)[r.dp_rank] for k, v in batch.items()}
        engine.train_step(shard, pg_loss_fn, mini_batch_size=len(shard["responses"]), calculate_entropy=True)

    engine = engine_at({"ep": 2})
    step(engine, batches[0])
    step(engine, batches[1])
    engine.save_checkpoint(ckpt_dir)
    saved = _hf_state(engine)
    step(engine, batches[2])
    want, want_step = _hf_state(engine), adam_step(engine.optimizer)

    resumed = engine_at({})
    resumed.load_checkpoint(ckpt_dir)
    loaded = _hf_state(resumed)
    step(resumed, batches[2])
    return {"saved": saved, "loaded": loaded, "want": want, "got": _hf_state(resumed),
            "steps": (want_step, adam_step(resumed.optimizer)),
            "optimizers": [len(getattr(e.optimizer, "chained_optimizers", [e.optimizer])) for e in (engine, resumed)]}


@pytest.mark.parametrize("distributed_optimizer", [True, False], ids=["distributed", "plain"])
def test_checkpoint_saved_at_ep2_resumes_at_ep1_exactly(distributed_optimizer: bool) -> None:
    import os

    hf_dir = save_hf_model(make_moe_model("qwen2_moe", seed=3))
    batches = [make_batch(seed=20 + i, batch=4) for i in range(3)]
    ckpt_dir = os.path.join(scratch_dir("megarl_moe_ckpt_"), "step_2")
    res = run_distributed(_save_ep2_resume_dp2, 2, hf_dir, batches, ckpt_dir, distributed_optimizer)[0]
    # At ep=2 the expert parameters have their own optimizer (expert DP group of 1); at ep=1 they
    # share the dense one: the checkpoint moves between the two arrangements (either optimizer kind).
    assert res["optimizers"] == [2, 1], res["optimizers"]
    assert res["steps"] == (3, 3)
    for key, value in res["saved"].items():
        assert torch.equal(res["loaded"][key], value), f"loaded {key} differs from saved"
        # The third step's gradient is summed in another order at ep=1 (float32: within
        # GRAD_RTOL), Adam's state before it is the same: bound from engine_helpers.adam_weight_atol.
        err = (res["got"][key] - res["want"][key]).abs().max().item()
        assert err <= adam_weight_atol(LR, EPS, CLIP, CLIP), f"resumed step: {key} differs by {err}"


def _save_etp1_resume_etp2(rank: int, world: int, port: int, hf_dir: str, batch: dict, ckpt_dir: str) -> dict:
    """One step at TP=2, EP=2, expert TP 1 (experts whole, each half on two ranks), save; a fresh engine
    at TP=2 with expert TP = TP (EP 1: every rank holds every expert, split in two) loads it."""
    from megarl.layout import ParallelLayout
    from megarl.megatron.checkpoint import adam_step
    from megarl.megatron.parallel import init_distributed

    out: dict[str, Any] = {}
    for name, layout in (("etp1", {"tp": 2, "ep": 2, "etp": 1}), ("etp2", {"tp": 2})):
        init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(**layout))
        engine = _engine(hf_dir, {"micro_batch_size": 2, "lr": LR, "eps": EPS, "clip_grad": CLIP,
                                  "weight_decay": 0.0, "sequence_parallel": True})
        if name == "etp1":
            assert (engine.ranks.etp_size, engine.ranks.ep_size, engine.ranks.edp_size) == (1, 2, 2)
            engine.load_hf_weights(hf_dir)
            r = engine.ranks
            shard = {k: v.chunk(r.dp_size)[r.dp_rank] for k, v in batch.items()}
            engine.train_step(shard, pg_loss_fn, mini_batch_size=len(shard["responses"]), calculate_entropy=True)
            engine.save_checkpoint(ckpt_dir)
        else:
            assert (engine.ranks.etp_size, engine.ranks.ep_size) == (2, 1)
            engine.load_checkpoint(ckpt_dir)
        out[name] = {"log_probs": engine.compute_log_prob(batch)["log_probs"], "step": adam_step(engine.optimizer)}
    return out


def test_checkpoint_saved_at_expert_tp1_resumes_at_expert_tp2() -> None:
    import os

    model = make_moe_model("qwen2_moe", seed=4)
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=24, batch=4)
    ckpt_dir = os.path.join(scratch_dir("megarl_moe_etp_"), "step_1")
    start, _ = hf_logprobs(model, batch)
    mask = batch["response_mask"].bool()
    for rank, res in enumerate(run_distributed(_save_etp1_resume_etp2, 4, hf_dir, batch, ckpt_dir, timeout=600)):
        saved, loaded = res["etp1"]["log_probs"].double(), res["etp2"]["log_probs"].double()
        assert (saved - start)[mask].abs().max() > 1e-3, "the step must move the weights"
        err = (loaded - saved)[mask].abs().max().item()
        assert err < 2e-5, f"rank {rank}: log-probs after resuming at expert TP 2 differ by {err}"
        assert res["etp1"]["step"] == res["etp2"]["step"] == 1


def _converted_log_probs(rank: int, world: int, port: int, hf_dir: str, ckpt: str, batch: dict) -> list:
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed

    out = []
    for layout in ({"ep": 2}, {"tp": 2}):
        init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(**layout))
        engine = _engine(hf_dir, {"micro_batch_size": 2})  # random init: the checkpoint must overwrite it
        engine.load_checkpoint(ckpt)  # a converted (model-only) checkpoint through the engine's loader
        out.append(engine.compute_log_prob(batch)["log_probs"])
    return out


def test_converted_moe_checkpoint_loads_at_ep2_and_tp2() -> None:
    from pathlib import Path

    from megarl.convert.hf_to_mcore import convert_hf_to_mcore

    model = make_moe_model("qwen2_moe", seed=9)
    hf_dir = save_hf_model(model)
    ckpt = Path(scratch_dir("megarl_moe_conv_")) / "mcore"
    convert_hf_to_mcore(hf_dir, ckpt, tp=1, progress=False)
    batch = make_batch(seed=13, batch=4)
    want, _ = hf_logprobs(model, batch)
    mask = batch["response_mask"].bool()
    for rank, per_layout in enumerate(run_distributed(_converted_log_probs, 2, hf_dir, str(ckpt), batch)):
        for layout, got in zip(("ep2", "tp2"), per_layout):
            err = (got.double() - want)[mask].abs().max().item()
            assert err < 2e-5, f"rank {rank} {layout}: log-probs differ from transformers by {err}"


def _sync_moe(rank: int, world: int, port: int, hf_dir: str, batch: dict) -> dict:
    from transformers import AutoConfig

    from megarl.hybrid.sync import WeightSync
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed
    from megarl.rollout.base import EngineOptions
    from megarl.rollout.hf_engine import HFRolloutEngine

    # PP=2: the training shards are pipeline stages (TP=2 training needs sequence parallelism,
    # tested in test_engine_sp).
    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(pp=2))
    engine = _engine(hf_dir, {"micro_batch_size": 2, "lr": LR, "eps": EPS, "clip_grad": CLIP, "weight_decay": 0.0})
    engine.load_hf_weights(hf_dir)
    torch.manual_seed(1000 + rank)  # a different random model: only the sync can make it right
    rollout = HFRolloutEngine.from_config(AutoConfig.from_pretrained(hf_dir), EngineOptions(pad_token_id=0, eos_token_ids=(1,)))
    rollout.model.set_experts_implementation("eager")
    sync = WeightSync(engine, rollout, rollout_tp=1)
    stats = sync.sync()
    synced = hf_logprobs(rollout.model, batch, dtype=torch.float32)[0]
    engine.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]), calculate_entropy=True)
    sync.sync()
    return {"synced": synced, "stepped": hf_logprobs(rollout.model, batch, dtype=torch.float32)[0],
            "train": engine.compute_log_prob(batch)["log_probs"], "stats": stats.as_dict()}


def test_weight_sync_fills_transformers_fused_experts() -> None:
    """PP=2 training shards of a MoE model -> HF rollout engine (experts fused in memory)."""
    model = make_moe_model("qwen3_moe", seed=4)
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=14, batch=4)
    want, _ = hf_logprobs(model, batch)
    mask = batch["response_mask"].bool()
    for res in run_distributed(_sync_moe, 2, hf_dir, batch):
        assert (res["synced"].double() - want)[mask].abs().max() < 2e-5
        assert (res["stepped"] - res["synced"])[mask].abs().max() > 1e-3, "the step must change the rollout model"
        assert (res["stepped"] - res["train"])[mask].abs().max() < 2e-5
        assert res["stats"]["bytes_received"] == res["stats"]["minimum_bytes"] > 0
