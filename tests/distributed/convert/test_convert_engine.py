"""Converted checkpoints in the real engine, and engine checkpoints exported to HF.

- HF -> Megatron (streaming converter) -> engine at TP=2 and at PP=2 over two gloo processes:
  log-probs equal transformers' (float64 reference) for Llama (GQA, tied and untied), Qwen2 (QKV
  bias), Qwen3 (QK-norm) and Mistral.
- A trainer-style checkpoint (the engine's own `save_checkpoint`, with optimizer state, after a
  training step) of the actor and of the critic exports to HF without naming the config (found in
  `<run_dir>/initial_model`); transformers then gives the engine's log-probs / values.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _launch import run_distributed  # noqa: E402
from engine_helpers import hf_logprobs, make_batch, make_hf_model, pg_loss_fn, save_hf_model  # noqa: E402

from megarl.convert.hf_to_mcore import convert_hf_to_mcore  # noqa: E402
from megarl.convert.mcore_to_hf import convert_mcore_to_hf  # noqa: E402

pytestmark = pytest.mark.distributed

LAYOUTS = [dict(tp=2), dict(pp=2)]


def _engine(rank: int, world: int, port: int, hf_dir: str, layout_kw: dict, role: str = "policy",
            lr: float = 1e-6) -> Any:
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed
    from megarl.models.spec import ModelSpec

    layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(**layout_kw))
    return MegatronEngine(ModelSpec.from_hf_config(hf_dir), layout,
                          EngineConfig(role=role, lr=lr, eps=1e-2, weight_decay=0.0, micro_batch_size=2))


def _logprobs_per_layout(rank: int, world: int, port: int, hf_dir: str, ckpt: str, batch: dict) -> list:
    out = []
    for layout_kw in LAYOUTS:
        engine = _engine(rank, world, port, hf_dir, layout_kw)  # random init: the checkpoint must overwrite it
        engine.load_checkpoint(ckpt)  # a converted (model-only) checkpoint through the engine's own loader
        out.append(engine.compute_log_prob(batch)["log_probs"])
    return out


@pytest.mark.parametrize("kind,convert_tp", [("llama", 1), ("llama_tied", 2), ("qwen2", 2), ("qwen3", 1), ("mistral", 2)])
def test_converted_checkpoint_matches_transformers_at_tp2_and_pp2(kind: str, convert_tp: int, tmp_path: Path) -> None:
    model = make_hf_model(kind, seed=3)
    hf_dir = save_hf_model(model)
    ckpt = tmp_path / "mcore"
    convert_hf_to_mcore(hf_dir, ckpt, tp=convert_tp, progress=False)
    batch = make_batch(seed=5, batch=4)
    want, _ = hf_logprobs(model, batch)
    mask = batch["response_mask"].bool()
    results = run_distributed(_logprobs_per_layout, 2, hf_dir, str(ckpt), batch)
    for rank, per_layout in enumerate(results):
        for layout, got in zip(LAYOUTS, per_layout):
            err = (got.double() - want)[mask].abs().max().item()
            assert err < 2e-5, f"{kind} rank {rank} {layout}: log-probs differ from transformers by {err}"
    shutil.rmtree(hf_dir)


def _logprobs_per_checkpoint(rank: int, world: int, port: int, hf_dir: str, cases: list, batch: dict) -> list:
    from megarl.convert.engine_load import load_converted_weights

    out = []
    for ckpt, layout_kw in cases:
        engine = _engine(rank, world, port, hf_dir, layout_kw)
        load_converted_weights(engine, ckpt)
        out.append(engine.compute_log_prob(batch)["log_probs"])
    return out


def test_vocab_padded_for_another_tp_size_loads(tmp_path: Path) -> None:
    """Vocab 300 pads to 384 rows at TP=1 and 512 at TP=2: a checkpoint converted for one TP size
    loads at another (Megatron reads the rows it has and zero-fills the rest)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(config).float().eval()
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    convert_hf_to_mcore(hf_dir, tmp_path / "tp1", tp=1, progress=False)  # 384 rows
    convert_hf_to_mcore(hf_dir, tmp_path / "tp2", tp=2, progress=False)  # 512 rows
    cases = [(str(tmp_path / "tp1"), dict(tp=2)), (str(tmp_path / "tp2"), dict(pp=2))]
    batch = make_batch(seed=8, batch=4)
    want, _ = hf_logprobs(model, batch)
    mask = batch["response_mask"].bool()
    for per_case in run_distributed(_logprobs_per_checkpoint, 2, str(hf_dir), cases, batch):
        for (ckpt, layout), got in zip(cases, per_case):
            err = (got.double() - want)[mask].abs().max().item()
            assert err < 2e-5, f"{Path(ckpt).name} loaded at {layout}: log-probs differ from transformers by {err}"


def _train_and_save(rank: int, world: int, port: int, hf_dir: str, run_dir: str, batch: dict) -> dict:
    actor = _engine(rank, world, port, hf_dir, dict(tp=2), lr=1e-2)
    actor.load_hf_weights(hf_dir)
    before = actor.compute_log_prob(batch)["log_probs"]
    actor.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]), calculate_entropy=True)
    after = actor.compute_log_prob(batch)["log_probs"]
    step_dir = Path(run_dir) / "checkpoints" / "global_step_1"
    actor.save_checkpoint(str(step_dir / "actor"))
    critic = _engine(rank, world, port, hf_dir, dict(pp=2), role="value")
    critic.load_hf_weights(hf_dir)  # trunk from the policy, seeded scalar head
    values = critic.compute_values(batch)
    critic.save_checkpoint(str(step_dir / "critic"))
    return {"before": before, "after": after, "values": values}


def test_trainer_checkpoints_export_to_transformers(tmp_path: Path) -> None:
    import transformers

    model = make_hf_model("llama", seed=4)
    hf_dir = save_hf_model(model)
    run_dir = tmp_path / "run"
    shutil.copytree(hf_dir, run_dir / "initial_model")  # what the trainer keeps next to its checkpoints
    batch = make_batch(seed=6, batch=4)
    res = run_distributed(_train_and_save, 2, hf_dir, str(run_dir), batch)[0]
    mask = batch["response_mask"].bool()
    assert (res["after"] - res["before"])[mask].abs().max() > 1e-3, "the training step did not change the policy"

    step = run_dir / "checkpoints" / "global_step_1"
    convert_mcore_to_hf(step / "actor", tmp_path / "actor_hf", progress=False)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "actor_hf", dtype=torch.float32)
    got, _ = hf_logprobs(exported, batch)
    err = (got - res["after"].double())[mask].abs().max().item()
    assert err < 2e-5, f"exported actor: transformers log-probs differ from the engine's by {err}"

    convert_mcore_to_hf(step / "critic", tmp_path / "critic_hf", progress=False)
    critic = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "critic_hf", dtype=torch.float64)
    assert critic.config.num_labels == 1
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    with torch.no_grad():
        hidden = critic.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              position_ids=batch["position_ids"]).last_hidden_state
        values = critic.score(hidden)[..., 0][:, p - 1:p + r - 1]
    err = (values - res["values"].double())[mask].abs().max().item()
    assert err < 2e-5, f"exported critic: transformers values differ from the engine's by {err}"
    shutil.rmtree(hf_dir)
