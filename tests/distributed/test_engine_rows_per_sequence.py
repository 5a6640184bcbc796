"""`rows_per_sequence` (the trainer's actor/rows_per_sequence): the rows per sequence the update ran,
above 1 only where rows shared their prompt. A packed micro-batch is one (1, S) row holding several
sequences, each computed on its own: it counts 1 like a padded one."""

from __future__ import annotations

from typing import Any

import pytest

from _launch import run_distributed
from engine_helpers import make_hf_model, pg_loss_fn, save_hf_model
from test_engine_shared_prompts import grouped_batch

pytestmark = pytest.mark.distributed

CASES = {"padded": dict(), "packed": dict(use_sequence_packing=True),
         "packed_dynamic": dict(use_sequence_packing=True, use_dynamic_bsz=True, max_token_len_per_micro_batch=40),
         "shared": dict(prompt_sharing="always")}


def _rows_per_sequence(rank: int, world: int, port: int, hf_dir: str, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import init_distributed
    from megarl.models.spec import ModelSpec

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    out: dict[str, Any] = {}
    for name, cfg in CASES.items():
        engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), ParallelLayout(),
                                EngineConfig(**{"micro_batch_size": 4, **cfg}))
        engine.load_hf_weights(hf_dir)
        layouts = [("shared" in m, int(m["tokens"].shape[0]), len(m["index"])) for m in engine._micro_batches(batch)]
        metrics = engine.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]), calculate_entropy=True)
        out[name] = (metrics["rows_per_sequence"], layouts)
    return out


def test_rows_per_sequence_counts_shared_prompts_only() -> None:
    hf_dir = save_hf_model(make_hf_model("qwen3", num_layers=1))
    res = run_distributed(_rows_per_sequence, 1, hf_dir, grouped_batch(seed=4))[0]
    for name in ("padded", "packed", "packed_dynamic"):
        value, layouts = res[name]
        assert not any(shared for shared, _, _ in layouts), layouts
        assert value == [1.0], (name, value, layouts)
    assert any(rows > 1 and seqs == 1 for _, seqs, rows in res["packed"][1])  # several rows in one (1, S)
    # Micro-batches of 4 rows: prompts 0,0,0,1 (2 sequences), 1,2,3,3 (3) and 3 alone (not shared).
    value, layouts = res["shared"]
    assert layouts == [(True, 2, 4), (True, 3, 4), (False, 1, 1)], layouts
    assert value[0] == pytest.approx((4 / 2 + 4 / 3 + 1) / 3), value
