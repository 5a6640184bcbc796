"""An expert-parallel Megatron actor synced into a real tensor-parallel vLLM engine, before and after
an optimizer step (two gloo processes: Megatron at EP=2, DP=2; vLLM at rollout TP=2, one rank each).

For a tiny Qwen3-MoE and a tiny Qwen2-MoE (shared expert; 24 expert rows per vLLM rank, which the
CPU grouped-GEMM kernel pads to 32): the vLLM engine starts from a different random model; after
`WeightSync` its greedy tokens' log-probs equal the trainer's log-probs of the same sequences (the
engine's own `compute_log_prob`) and a float64 HF forward of the trainer's weights, and its greedy
tokens are the float64 model's; one optimizer step later a second sync makes them equal again (and
the step must have moved them); every rank receives exactly the plan's minimum on every sync.

Bounds. vLLM and the trainer are two float32 computations of the same function with different
kernels (vLLM: CPU attention, grouped-GEMM experts, tensor-parallel all-reduce; Megatron: its own
attention, per-expert GEMMs, the EP=2 all-to-all); no bf16 anywhere (both engines run float32).
Measured max |delta log-prob| over all response tokens (identical on both ranks), sync 1 / sync 2:

    qwen3_moe  vLLM-trainer 3.8e-6 / 3.7e-6   vLLM-fp64 1.2e-5 / 7.0e-6   trainer-fp64 9.7e-6 / 6.2e-6
    qwen2_moe  vLLM-trainer 1.1e-5 / 1.3e-5   vLLM-fp64 4.4e-5 / 1.5e-5   trainer-fp64 3.2e-5 / 1.1e-5

and on an AVX2-only x86-64 machine (other kernels, another summation order) qwen2_moe's sync 1 gave
vLLM-trainer 2.6e-5, vLLM-fp64 5.5e-5, trainer-fp64 2.9e-5. HF's own float32 forward (eager
experts) differs from float64 by 5.9e-5 on the qwen2_moe case, so FLOAT64_ATOL = 1e-4 bounds each
float32 side against float64, as in the other vLLM MoE sync tests. The two float32 sides are then
within 2 * FLOAT64_ATOL of each other by the triangle inequality; part of their rounding is common
(the same float32 weights, a float32 log-softmax), so LOGPROB_ATOL = FLOAT64_ATOL is asserted. A
tighter figure taken from one CPU does not carry to another (2e-5 held on the first machine, not
on the second). Both bounds are far below what a missed or misplaced weight does: the rollout
engine starts 0.1 or more away (asserted), and the optimizer step moves the log-probs by more than
1e-3 (asserted).
Run with `.venv-vllm/bin/python -m pytest -m vllm`.
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

PROMPTS = [[5, 17, 42, 8], [33, 2, 9], [71, 70, 69, 68, 67, 3], [120, 7, 199, 64, 13]]
R = 6
TRAIN_CFG = dict(lr=1e-2, eps=1e-2, weight_decay=0.0, clip_grad=1.0, micro_batch_size=2)
BUCKET = 16 * 1024
FLOAT64_ATOL = 1e-4  # either float32 computation vs float64 (see the module doc)
LOGPROB_ATOL = FLOAT64_ATOL  # vLLM vs the trainer (see the module doc)


def _model(family: str, seed: int) -> torch.nn.Module:
    """head_dim 64 (the vLLM CPU build refuses smaller heads), 4 experts, top-2."""
    import transformers

    common = dict(vocab_size=200, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=256, initializer_range=0.2,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=64, norm_topk_prob=True)
    else:  # 24 intermediate rows per vLLM rank: the CPU kernel pads them to 32
        config = transformers.Qwen2MoeConfig(**common, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                                             norm_topk_prob=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # non-trivial norms and biases, a router that prefers different experts per token
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
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


def _train_batch(seed: int) -> dict[str, torch.Tensor]:
    """Random sequences with advantages for the optimizer step (prompt 6, response 5, varied padding)."""
    g = torch.Generator().manual_seed(seed)
    b, p, r = 4, 6, 5
    mask = torch.ones(b, p + r, dtype=torch.long)
    for i in range(b):
        mask[i, :int(torch.randint(0, p - 1, (1,), generator=g))] = 0
        mask[i, p + int(torch.randint(1, r + 1, (1,), generator=g)):] = 0
    ids = torch.randint(2, 200, (b, p + r), generator=g) * mask
    return {"prompts": ids[:, :p], "responses": ids[:, p:], "input_ids": ids, "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0), "response_mask": mask[:, p:].float(),
            "advantages": torch.randn(b, r, generator=g)}


def _own_shm_names(token: str) -> None:
    """vLLM's CPU communicator names its shared-memory segments after the init method, the same
    ("env://") for every external-launcher engine: two tensor-parallel engines on one host collide
    (EEXIST). Prefix this run's names with `token` (every rank passes the same)."""
    from vllm.distributed.device_communicators import cpu_communicator as cc

    original = cc._CPUSHMDistributed.make_group_name

    def make_group_name(communicator: Any) -> str:  # no '/' inside a shared-memory name
        return "/" + token + original(communicator).lstrip("/")

    cc._CPUSHMDistributed.make_group_name = staticmethod(make_group_name)


def _gather_checkpoint(engine: Any, group: Any) -> dict[str, torch.Tensor]:
    """The trainer's weights under HF checkpoint names (experts one by one), from every rank's shards
    (TP = PP = 1: each rank holds full dense tensors and its EP rank's experts)."""
    import torch.distributed as dist

    from megarl.models.weight_map import stage_entries, unfuse

    spec, r = engine.spec, engine.ranks
    local = dict(engine.get_named_weights())
    mine = {}
    for entry, name, hf_names in stage_entries(spec, 0, 1, engine.use_te, r.ep_rank, r.ep_size):
        full = local[name].float().clone()
        if entry.vocab_padded:
            full = full[: spec.vocab_size]
        mine.update(zip(hf_names, (t.contiguous() for t in unfuse(entry, full, spec))))
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return {k: v for part in everyone for k, v in part.items()}


def _worker(rank: int, world: int, port: int, dirs: dict[str, str]) -> dict[str, Any]:
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from engine_helpers import pg_loss_fn

    from megarl.hybrid.sync import WeightSync
    from megarl.layout import ParallelLayout
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import init_distributed
    from megarl.models.spec import ModelSpec
    from megarl.rollout.base import EngineOptions, SamplingParams
    from megarl.rollout.vllm_engine import VLLMRolloutEngine

    # Megatron's groups and ours first: the in-process vLLM engine then takes the default group.
    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(ep=2))
    group = dist.new_group(list(range(world)), backend="gloo")
    engine = MegatronEngine(ModelSpec.from_hf_config(dirs["target"]), ParallelLayout(ep=2, dp=2),
                            EngineConfig(**TRAIN_CFG))
    engine.load_hf_weights(dirs["target"])
    assert (engine.ranks.ep_size, engine.ranks.dp_size) == (2, 2)
    token = f"megarl{port}"
    _own_shm_names(token)
    shm = Path("/dev/shm")
    rollout = VLLMRolloutEngine(dirs["start"], EngineOptions(pad_token_id=0, eos_token_ids=(1,), tensor_parallel_size=2,
                                                              kv_cache_memory_gb=0.25))
    greedy = SamplingParams.make_greedy(max_new_tokens=R, ignore_eos=True)
    keys = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")

    def rollout_and_train() -> dict[str, Any]:
        res = rollout.generate(_prompts(), greedy)
        seqs = {k: res[k] for k in keys}
        # Every rank scores every sequence (DP splits data, not the function).
        train = engine.compute_log_prob(seqs)["log_probs"]
        return dict(seqs=seqs, vllm=res["rollout_log_probs"], train=train)

    out: dict[str, Any] = {}
    try:
        sync = WeightSync(engine, rollout, rollout_tp=2, bucket_bytes=BUCKET, group=group)
        res = rollout.generate(_prompts(), greedy)
        out["before"], out["before_seqs"] = res["rollout_log_probs"], {k: res[k] for k in keys}
        stats1 = sync.sync()
        out["sync1"] = rollout_and_train()
        batch = _train_batch(seed=21)
        rows = torch.arange(4).chunk(engine.ranks.dp_size)[engine.ranks.dp_rank]
        engine.train_step({k: v[rows] for k, v in batch.items()}, pg_loss_fn, mini_batch_size=len(rows),
                          calculate_entropy=True)
        state = _gather_checkpoint(engine, group)  # a collective: every rank calls it
        out["state2"] = state if rank == 0 else None
        stats2 = sync.sync()
        out["sync2"] = rollout_and_train()
        out["stats"] = [stats1.as_dict(), stats2.as_dict()]
    finally:
        from vllm.distributed.parallel_state import destroy_model_parallel

        rollout.release()
        destroy_model_parallel()
        # A leftover shared-memory segment of vLLM's CPU communicator makes the next TP engine fail.
        dist.barrier(group)
        for seg in shm.glob(f"{token}*cpushm_{rank}"):
            seg.unlink(missing_ok=True)
    return out


def _hf32(model: torch.nn.Module, seqs: dict[str, torch.Tensor]) -> torch.Tensor:
    """float32 HF log-probs (eager experts) of the responses."""
    import copy

    ref = copy.deepcopy(model).float()
    ref.set_experts_implementation("eager")
    with torch.no_grad():
        logits = ref(input_ids=seqs["input_ids"], attention_mask=seqs["attention_mask"],
                     position_ids=seqs["position_ids"]).logits
    p = seqs["prompts"].shape[1]
    return torch.log_softmax(logits[:, p - 1:-1], -1).gather(-1, seqs["responses"].unsqueeze(-1)).squeeze(-1)


def _float64(model: torch.nn.Module, seqs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 HF log-probs of the responses and HF's greedy choices at each response position."""
    import copy

    ref = copy.deepcopy(model).double()
    ref.set_experts_implementation("eager")  # the grouped-GEMM kernel has no float64
    with torch.no_grad():
        logits = ref(input_ids=seqs["input_ids"], attention_mask=seqs["attention_mask"],
                     position_ids=seqs["position_ids"]).logits
    p = seqs["prompts"].shape[1]
    logits = logits[:, p - 1:-1]
    want = torch.log_softmax(logits, -1).gather(-1, seqs["responses"].unsqueeze(-1)).squeeze(-1)
    return want, logits.argmax(-1)


def _from_checkpoint(like: Path, state: dict[str, torch.Tensor], out: Path) -> torch.nn.Module:
    """The HF model of `like`'s config holding checkpoint-named `state`, through HF's own loader."""
    import shutil

    import transformers
    from safetensors.torch import save_file

    out.mkdir()
    shutil.copy(like / "config.json", out / "config.json")
    save_file(state, str(out / "model.safetensors"))
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_ep2_actor_syncs_into_vllm_tp2(tmp_path: Path, family: str) -> None:
    models = {"target": _model(family, 0), "start": _model(family, 1)}
    dirs = {}
    for key, model in models.items():
        model.save_pretrained(tmp_path / key)
        dirs[key] = str(tmp_path / key)
    results = run_distributed(_worker, 2, dirs, timeout=300)
    refs = {"sync1": models["target"], "sync2": _from_checkpoint(tmp_path / "target", results[0]["state2"],
                                                                  tmp_path / "stepped")}
    for rank, r in enumerate(results):
        before_want, _ = _float64(models["target"], r["before_seqs"])
        assert (r["before"].double() - before_want).abs().max() > 0.1, "vLLM must start from another model"
        for step in ("sync1", "sync2"):
            s = r[step]
            assert torch.equal(s["seqs"]["responses"], results[0][step]["seqs"]["responses"])
            assert bool(s["seqs"]["response_mask"].all())
            want, greedy = _float64(refs[step], s["seqs"])
            vllm_train = (s["vllm"] - s["train"]).abs().max().item()
            vllm_ref = (s["vllm"].double() - want).abs().max().item()
            train_ref = (s["train"].double() - want).abs().max().item()
            vllm_hf32 = (s["vllm"] - _hf32(refs[step], s["seqs"])).abs().max().item()
            hf32_ref = (_hf32(refs[step], s["seqs"]).double() - want).abs().max().item()
            print(f"{family} rank {rank} {step}: |vllm-trainer| {vllm_train:.2e}, |vllm-fp64| {vllm_ref:.2e}, "
                  f"|trainer-fp64| {train_ref:.2e}, |vllm-hf32| {vllm_hf32:.2e}, |hf32-fp64| {hf32_ref:.2e}",
                  flush=True)
            assert torch.equal(s["seqs"]["responses"], greedy), f"{family} {step}: greedy tokens differ from float64"
            assert vllm_train < LOGPROB_ATOL, f"{family} rank {rank} {step}: vLLM vs trainer differs by {vllm_train}"
            assert vllm_ref < FLOAT64_ATOL, f"{family} rank {rank} {step}: vLLM vs float64 differs by {vllm_ref}"
            assert train_ref < FLOAT64_ATOL, f"{family} rank {rank} {step}: trainer vs float64 differs by {train_ref}"
        # The step moved the weights: the same sequences score differently after the second sync.
        want1, _ = _float64(refs["sync1"], r["sync2"]["seqs"])
        assert (r["sync2"]["vllm"].double() - want1).abs().max() > 1e-3, f"{family}: the step must move the weights"
        for stats in r["stats"]:
            assert stats["bytes_received"] == stats["minimum_bytes"] > 0, (family, rank, stats)
