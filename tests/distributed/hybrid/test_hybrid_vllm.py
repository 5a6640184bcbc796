"""Reshard into a real tensor-parallel vLLM engine (rollout TP2 over two gloo processes).

Each process holds one training shard (made from the target HF weights by the weight map, standing
in for the Megatron engine) and one vLLM TP rank started from a *different* random model. After
the sync, the pieces written into vLLM's fused per-rank parameters must make vLLM compute the
target model: its greedy tokens' log-probs equal a float64 HF forward of the target model.
Runs in the vLLM environment (`-m vllm`); skipped without vLLM.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _launch import run_distributed  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.distributed]

# `import vllm` alone is fooled by the tests/vllm folder (a namespace package when tests/ is on
# sys.path): look for a module only the real vLLM has.
def _has_vllm() -> bool:
    try:
        return importlib.util.find_spec("vllm.platforms") is not None
    except ImportError:
        return False


if not _has_vllm():
    pytest.skip("needs vLLM: run in the vLLM environment (make test-vllm)", allow_module_level=True)

PROMPTS = [[5, 17, 42, 8], [33, 2, 9], [71, 70, 69, 68, 67, 3]]
R = 6


def _model(seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(  # head_dim 64: the vLLM CPU build refuses smaller heads
        vocab_size=200, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256, initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") or name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    return model


LAYOUTS = {"tp2": dict(tp=2), "tp1dp2": dict(dp=2), "pp2": dict(pp=2)}
TARGETS = {"tp2": "target_a", "tp1dp2": "target_b", "pp2": "target_a"}  # alternate: each sync must land


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
    from megarl.models.weight_map import hf_to_megatron_state_dict, read_hf_tensors
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
            train = ParallelLayout(**{"dp": 1, **train_kw})
            c = train.coord(rank)
            shapes = hf_parameter_shapes(target_dir)
            hf = read_hf_tensors(target_dir, list(shapes))
            shards = hf_to_megatron_state_dict(hf, spec, c.tp_rank, train.tp, c.pp_rank, train.pp)
            plan = build_reshard_plan(spec, train, ParallelLayout.rollout(2, world), "vllm", torch.float32, 8 * 1024,
                                      hf_shapes=shapes)
            stats = sync_shards(plan, shards, engine, group)
            res = engine.generate(_prompts(), SamplingParams.make_greedy(max_new_tokens=R, ignore_eos=True))
            out[name] = dict(stats=stats.as_dict(), input_ids=res["input_ids"], attention_mask=res["attention_mask"],
                             responses=res["responses"], log_probs=res["rollout_log_probs"])
    finally:
        from vllm.distributed.parallel_state import destroy_model_parallel

        engine.release()
        destroy_model_parallel()
        # The launcher may kill this process before vLLM's CPU communicator unlinks its shared
        # memory; a leftover segment makes the next TP engine fail (EEXIST). Remove the ones we made.
        dist.barrier(group)
        for seg in set(shm.glob(f"*cpushm_{rank}")) - segments_before:
            seg.unlink(missing_ok=True)
    return out


def test_vllm_tp2_computes_the_synced_model(tmp_path: Path) -> None:
    models = {"target_a": _model(0), "target_b": _model(2), "start": _model(1)}
    dirs = {}
    for key, model in models.items():
        model.save_pretrained(tmp_path / key)
        dirs[key] = str(tmp_path / key)
    results = run_distributed(_vllm_worker, 2, dirs, timeout=400)
    for name in LAYOUTS:
        r = results[0][name]
        assert torch.equal(r["responses"], results[1][name]["responses"])
        with torch.no_grad():
            ref = models[TARGETS[name]].double()
            positions = (r["attention_mask"].cumsum(1) - 1).clamp(min=0)
            logits = ref(input_ids=r["input_ids"], attention_mask=r["attention_mask"], position_ids=positions).logits
        p = r["input_ids"].shape[1] - R
        want = torch.log_softmax(logits[:, p - 1:-1], -1).gather(-1, r["responses"].unsqueeze(-1)).squeeze(-1)
        err = (r["log_probs"].double() - want).abs().max().item()
        assert err < 1e-4, f"{name}: vLLM after sync differs from the target model by {err}"
        assert torch.equal(r["responses"], logits[:, p - 1:-1].argmax(-1)), f"{name}: greedy tokens differ"
        for rank_result in results:
            s = rank_result[name]["stats"]
            assert s["bytes_received"] == s["minimum_bytes"]
