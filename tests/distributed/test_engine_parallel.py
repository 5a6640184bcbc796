"""Engine across TP=2, PP=2 and DP=2 on two gloo processes: log-probs and one optimizer step must
equal the HF transformers model (float64 forward, hand-written AdamW step) at any layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _launch import free_ports, run_distributed
from engine_helpers import (
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

LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "dp2": dict()}
TRAIN_CFG = dict(lr=1e-2, eps=1e-2, weight_decay=0.0, clip_grad=1.0, micro_batch_size=2)


def _engine(rank: int, world: int, port: int, hf_dir: str, layout_kw: dict, cfg: dict) -> Any:
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.layout import ParallelLayout
    from megarl.megatron.parallel import init_distributed
    from megarl.models.spec import ModelSpec

    layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(**layout_kw))
    engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), layout, EngineConfig(**cfg))
    engine.load_hf_weights(hf_dir)
    return engine


def _dp_shard(batch: dict[str, torch.Tensor], engine: Any) -> dict[str, torch.Tensor]:
    r = engine.ranks
    return {k: v.chunk(r.dp_size)[r.dp_rank] for k, v in batch.items()}


def _logprobs_all_layouts(rank: int, world: int, port: int, hf_dir: str, batch: dict, ports: list[int]) -> dict:
    out = {}
    for name, kw in {**LAYOUTS, "pp2_packed": dict(pp=2)}.items():
        cfg = {"micro_batch_size": 3, "use_sequence_packing": name.endswith("packed")}
        engine = _engine(rank, world, ports[len(out)], hf_dir, kw, cfg)
        shard = _dp_shard(batch, engine)
        res = engine.compute_log_prob(shard, temperature=0.7, calculate_entropy=True)
        out[name] = (engine.ranks.dp_rank, engine.ranks.dp_size, res)
    return out


@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_log_probs_equal_hf_at_tp2_pp2_dp2(kind: str) -> None:
    model = make_hf_model(kind)
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=1, batch=6)
    ref_lp, ref_ent = hf_logprobs(model, batch, temperature=0.7)
    mask = batch["response_mask"].bool()
    results = run_distributed(_logprobs_all_layouts, 2, hf_dir, batch, free_ports(len(LAYOUTS) + 1))
    for name in [*LAYOUTS, "pp2_packed"]:
        for rank_result in results:
            dp_rank, dp_size, res = rank_result[name]
            rows = torch.arange(len(mask)).chunk(dp_size)[dp_rank]
            for key, ref in (("log_probs", ref_lp), ("entropys", ref_ent)):
                got, want = res[key].double(), ref[rows]
                assert got.shape == want.shape, (name, key)
                err = (got - want)[mask[rows]].abs().max().item()
                assert err < 2e-5, f"{kind} {name} {key}: max error {err}"
                assert torch.all(got[~mask[rows]] == 0), f"{name} {key}: padding not zeroed"


def _one_step_all_layouts(rank: int, world: int, port: int, hf_dir: str, batch: dict, ports: list[int]) -> dict:
    out = {}
    for name, kw in LAYOUTS.items():
        engine = _engine(rank, world, ports[len(out)], hf_dir, kw, TRAIN_CFG)
        metrics = engine.train_step(_dp_shard(batch, engine), pg_loss_fn, mini_batch_size=len(batch["responses"]),
                                    calculate_entropy=True)
        out[name] = (gather_hf_state(engine), metrics)
    return out


def test_one_optimizer_step_same_weights_at_every_layout() -> None:
    model = make_hf_model("qwen2")
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=2, batch=6)
    want, want_norm = reference_train_step(model, batch, lr=TRAIN_CFG["lr"], eps=TRAIN_CFG["eps"],
                                           clip_grad=TRAIN_CFG["clip_grad"])
    before = model.state_dict()
    results = run_distributed(_one_step_all_layouts, 2, hf_dir, batch, free_ports(len(LAYOUTS)))
    for name in LAYOUTS:
        got, metrics = results[0][name]
        assert set(got) == set(want) - {"lm_head.weight"} | ({"lm_head.weight"} & set(got))
        atol = adam_weight_atol(TRAIN_CFG["lr"], TRAIN_CFG["eps"], want_norm, TRAIN_CFG["clip_grad"])
        for key, value in got.items():
            moved = (want[key] - before[key]).abs().max().item()
            err = (value - want[key]).abs().max().item()
            assert err < atol, f"{name} {key}: max error {err} (the step moved it by {moved})"
        assert metrics["grad_norm"][0] == pytest.approx(want_norm, rel=1e-4), name
        assert results[1][name][1]["loss"] == metrics["loss"], f"{name}: ranks report different losses"
