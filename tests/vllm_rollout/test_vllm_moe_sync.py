"""Mixture-of-experts weights resharded into a real tensor-parallel vLLM engine (rollout TP2 over
two gloo processes): the experts land in vLLM's fused routed-expert parameters of each rank
(`w13_weight` / `w2_weight`, through the kernel's own post-processing: on CPU the padded,
prepacked grouped-GEMM layout, with the intermediate size padded for the Qwen2-MoE case).

Each process holds the training shards of a target HF model made by the weight map (standing in
for the Megatron engine), first at EP=2 (each rank holds half of the experts), then at TP=2 with a
second target, then at TP=2 with expert tensor parallelism 1 (each rank holds half of the experts,
whole) with the first target again, and one vLLM TP rank started from a different random model. After each sync vLLM's
greedy tokens and their log-probs equal a float64 HF forward of the target, and every rank
received exactly the plan's minimum (nothing at TP2 -> TP2: every shard is already in place).
At rollout TP 1 the engine takes full HF-named tensors (experts one by one) through vLLM's own
loader; on CPU they are loaded into loading-layout copies and packed the same way: two updates to
two different targets each make vLLM compute its target. Run with `.venv-vllm/bin/python -m pytest
-m vllm`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from _launch import run_distributed  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.distributed]

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("vllm.entrypoints") is None:
    pytest.skip("needs vLLM: run in the vLLM environment (make test-vllm)", allow_module_level=True)

PROMPTS = [[5, 17, 42, 8], [33, 2, 9], [71, 70, 69, 68, 67, 3]]
R = 6
# tp2_etp1: TP=2 with expert tensor parallelism 1, experts whole and split over EP=2.
LAYOUTS = {"ep2": dict(dp=2, ep=2), "tp2": dict(tp=2, dp=1), "tp2_etp1": dict(tp=2, dp=1, ep=2, etp=1)}
TARGETS = {"ep2": "target_a", "tp2": "target_b", "tp2_etp1": "target_a"}  # alternate: each sync must land


def _model(family: str, seed: int) -> torch.nn.Module:
    import transformers

    common = dict(vocab_size=200, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=256, initializer_range=0.2,
                  tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=64, norm_topk_prob=True)
    else:  # 24 intermediate rows per rank: the CPU kernel pads them to 32 (its alignment)
        config = transformers.Qwen2MoeConfig(**common, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                                             norm_topk_prob=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # a router that prefers different experts per token
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
    return model


def _prompts() -> Any:
    from megarl.protocol import Batch

    width = max(map(len, PROMPTS))
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return Batch.from_dict({"input_ids": ids, "attention_mask": mask})


def _vllm_worker(rank: int, world: int, port: int, dirs: dict[str, str]) -> dict[str, Any]:
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from megarl.hybrid.plan import build_reshard_plan
    from megarl.hybrid.sync import sync_shards
    from megarl.layout import ParallelLayout
    from megarl.models.spec import ModelSpec
    from megarl.models.weight_map import hf_to_megatron_state_dict, read_hf_tensors, split_fused_experts
    from megarl.rollout.base import EngineOptions, SamplingParams
    from megarl.rollout.vllm_engine import VLLMRolloutEngine, hf_parameter_shapes

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")  # ours, before vLLM takes the default group
    shm = Path("/dev/shm")
    segments_before = set(shm.glob(f"*cpushm_{rank}"))
    engine = VLLMRolloutEngine(dirs["start"], EngineOptions(pad_token_id=0, eos_token_ids=(1,), tensor_parallel_size=2,
                                                             kv_cache_memory_gb=0.25))
    out = {}
    try:
        for name, train_kw in LAYOUTS.items():
            target_dir = dirs[TARGETS[name]]
            spec = ModelSpec.from_hf_config(target_dir)
            train = ParallelLayout(**train_kw)
            c = train.coord(rank)
            shapes = split_fused_experts(hf_parameter_shapes(target_dir))  # checkpoint names: one per expert
            hf = read_hf_tensors(target_dir, list(shapes))
            shards = hf_to_megatron_state_dict(hf, spec, c.tp_rank, train.tp, c.pp_rank, train.pp,
                                               ep_rank=c.ep_rank, ep_size=train.ep, etp_rank=c.etp_rank,
                                               etp_size=train.etp)
            plan = build_reshard_plan(spec, train, ParallelLayout.rollout(2, world), "vllm", torch.float32, 8 * 1024,
                                      hf_shapes=shapes)
            stats = sync_shards(plan, shards, engine, group)
            res = engine.generate(_prompts(), SamplingParams.make_greedy(max_new_tokens=R, ignore_eos=True))
            out[name] = dict(stats=stats.as_dict(), input_ids=res["input_ids"], attention_mask=res["attention_mask"],
                             responses=res["responses"], log_probs=res["rollout_log_probs"])
            if name == "ep2":
                out["damaged"] = _corrupted_sync_damages_the_engine(rank, group, plan, shards, engine)
    finally:
        from vllm.distributed.parallel_state import destroy_model_parallel

        engine.release()
        destroy_model_parallel()
        # A leftover shared-memory segment of vLLM's CPU communicator makes the next TP engine fail.
        dist.barrier(group)
        for seg in set(shm.glob(f"*cpushm_{rank}")) - segments_before:
            seg.unlink(missing_ok=True)
    return out


def _corrupted_sync_damages_the_engine(rank: int, group: Any, plan: Any, shards: dict, engine: Any) -> dict[str, Any]:
    """The same sync again with one byte flipped in the first bucket rank 1 receives: the check fails on
    both ranks after the pieces were written into vLLM's parameters, so the engine refuses to generate
    until a whole sync; a clean one restores it."""
    from _corrupt import corrupting_transport
    from megarl.hybrid.sync import sync_shards
    from megarl.hybrid.verify import WeightSyncError
    from megarl.rollout.base import RolloutStateError, SamplingParams

    result: dict[str, Any] = {}
    try:
        sync_shards(plan, shards, engine, group, transport=corrupting_transport(group, nth=0) if rank == 1 else None)
        result["sync"] = "passed"
    except WeightSyncError as error:
        result["sync"] = f"WeightSyncError: {error}"
    greedy = SamplingParams.make_greedy(max_new_tokens=R, ignore_eos=True)
    try:
        engine.generate(_prompts(), greedy)
        result["generate"] = "generated"
    except RolloutStateError as error:
        result["generate"] = f"RolloutStateError: {error}"
    sync_shards(plan, shards, engine, group)
    result["log_probs_after_clean_sync"] = engine.generate(_prompts(), greedy)["rollout_log_probs"]
    return result


def _want_log_probs(model: torch.nn.Module, r: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 HF log-probs of the generated tokens and HF's greedy choices."""
    ref = model.double()
    ref.set_experts_implementation("eager")
    with torch.no_grad():
        positions = (r["attention_mask"].cumsum(1) - 1).clamp(min=0)
        logits = ref(input_ids=r["input_ids"], attention_mask=r["attention_mask"], position_ids=positions).logits
    p = r["input_ids"].shape[1] - R
    want = torch.log_softmax(logits[:, p - 1:-1], -1).gather(-1, r["responses"].unsqueeze(-1)).squeeze(-1)
    return want, logits[:, p - 1:-1].argmax(-1)


def _tp1_worker(rank: int, world: int, port: int, dirs: dict[str, str]) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from megarl.models.weight_map import read_hf_tensors
    from megarl.rollout.base import EngineOptions, SamplingParams
    from megarl.rollout.vllm_engine import VLLMRolloutEngine, hf_parameter_shapes

    options = EngineOptions(pad_token_id=0, eos_token_ids=(1,), kv_cache_memory_gb=0.25)
    engine = VLLMRolloutEngine(dirs["start"], options)
    out = {}
    try:
        # An update that names no expert first: the experts keep the weights the engine loaded
        # (the CPU kernel packed its empty staging copies over them before).
        start = read_hf_tensors(dirs["start"], ["model.norm.weight"])
        engine.update_weights(start.items())
        res = engine.generate(_prompts(), SamplingParams.make_greedy(max_new_tokens=R, ignore_eos=True))
        out["start"] = dict(input_ids=res["input_ids"], attention_mask=res["attention_mask"],
                            responses=res["responses"], log_probs=res["rollout_log_probs"])
        for target in ("target_a", "target_b"):
            hf = read_hf_tensors(dirs[target], list(hf_parameter_shapes(dirs[target])))
            count = engine.update_weights(hf.items())
            res = engine.generate(_prompts(), SamplingParams.make_greedy(max_new_tokens=R, ignore_eos=True))
            out[target] = dict(count=count, names=sorted(hf), input_ids=res["input_ids"],
                               attention_mask=res["attention_mask"], responses=res["responses"],
                               log_probs=res["rollout_log_probs"])
        # A MoE backend that reorders its weights after loading (FlashInfer's, AITER's: GPU only, so one
        # layer's backend is relabelled here) is refused before anything is written.
        fused_name, fused = next((name, m) for name, m in engine.engine_model().named_modules()
                                 if name.startswith("model.layers.1.") and hasattr(m, "w13_weight"))
        out["fused_name"] = fused_name
        backend = fused.quant_method.unquantized_backend
        fused.quant_method.unquantized_backend = type("Backend", (), {"name": "FLASHINFER_CUTLASS"})()
        try:
            engine.update_weights(read_hf_tensors(dirs["start"], list(hf_parameter_shapes(dirs["start"]))).items())
            out["refused"] = None
        except Exception as error:  # noqa: BLE001 - the test checks which
            out["refused"] = f"{type(error).__name__}: {error}"
        finally:
            fused.quant_method.unquantized_backend = backend
        res = engine.generate(_prompts(), SamplingParams.make_greedy(max_new_tokens=R, ignore_eos=True))
        out["after_refusal"] = res["rollout_log_probs"]
    finally:
        engine.release()
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_vllm_tp1_takes_hf_expert_tensors(tmp_path: Path, family: str) -> None:
    models = {"target_a": _model(family, 0), "target_b": _model(family, 2), "start": _model(family, 1)}
    dirs = {}
    for key, model in models.items():
        model.save_pretrained(tmp_path / key)
        dirs[key] = str(tmp_path / key)
    results = run_distributed(_tp1_worker, 1, dirs, timeout=300)[0]
    want, _ = _want_log_probs(models["start"], results["start"])
    assert (results["start"]["log_probs"].double() - want).abs().max().item() < 1e-4, "a norm-only update changed experts"
    for target in ("target_a", "target_b"):
        r = results[target]
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in r["names"] and r["count"] == len(r["names"])
        want, greedy = _want_log_probs(models[target], r)
        err = (r["log_probs"].double() - want).abs().max().item()
        assert err < 1e-4, f"{family} {target}: vLLM after the update differs from the target model by {err}"
        assert torch.equal(r["responses"], greedy)
    assert results["refused"] is not None and results["refused"].startswith("WeightUpdateError")
    assert f"'{results['fused_name']}' uses the FLASHINFER_CUTLASS MoE backend" in results["refused"]
    assert torch.equal(results["after_refusal"], results["target_b"]["log_probs"]), "the refused update wrote weights"


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_vllm_tp2_computes_the_synced_moe_model(tmp_path: Path, family: str) -> None:
    models = {"target_a": _model(family, 0), "target_b": _model(family, 2), "start": _model(family, 1)}
    dirs = {}
    for key, model in models.items():
        model.save_pretrained(tmp_path / key)
        dirs[key] = str(tmp_path / key)
    results = run_distributed(_vllm_worker, 2, dirs, timeout=500)
    for name in LAYOUTS:
        r = results[0][name]
        assert torch.equal(r["responses"], results[1][name]["responses"])
        want, greedy = _want_log_probs(models[TARGETS[name]], r)
        err = (r["log_probs"].double() - want).abs().max().item()
        assert err < 1e-4, f"{family} {name}: vLLM after sync differs from the target model by {err}"
        assert torch.equal(r["responses"], greedy), f"{family} {name}: greedy tokens differ"
    for rank, r in enumerate(results):  # the corrupted re-sync of the ep2 layout
        d = r["damaged"]
        assert d["sync"].startswith("WeightSyncError"), (rank, d["sync"])
        assert d["generate"].startswith("RolloutStateError"), (rank, d["generate"])
        assert torch.equal(d["log_probs_after_clean_sync"], r["ep2"]["log_probs"]), rank
        for rank_result in results:
            s = rank_result[name]["stats"]
            assert s["bytes_received"] == s["minimum_bytes"]
            # TP2 training -> TP2 rollout keeps every shard in place; at EP2 half the experts move, and
            # with whole experts (expert TP 1) each rank lacks the other half of every expert's rows.
            assert (s["bytes_received"] > 0) == (name != "tp2"), (name, s)
