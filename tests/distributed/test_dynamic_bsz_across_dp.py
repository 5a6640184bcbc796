"""Dynamic micro-batches (`use_dynamic_bsz`) across data-parallel ranks: every DP rank of a MoE model
runs the same number of micro-batches, each within the token budget.

Each DP rank plans from its own rows, and a rank with shorter rows needs fewer micro-batches; at
expert parallelism the token dispatch is a collective over ranks of different DP ranks in every
micro-batch, so unequal counts leave ranks waiting. `plan_micro_batches_across` agrees on the most
any rank needs; a rank with fewer rows than that cannot run as many, and every rank says so."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from _launch import run_distributed
from engine_helpers import hf_logprobs, make_batch, make_moe_model, pg_loss_fn, save_hf_model

pytestmark = pytest.mark.distributed

BUDGET = 12


def _plans(rank: int, world: int, port: int, cases: dict) -> dict:
    from megatron.core import parallel_state as ps

    from megarl.errors import DataError
    from megarl.layout import ParallelLayout
    from megarl.megatron.packing import plan_micro_batches, plan_micro_batches_across
    from megarl.megatron.parallel import init_distributed

    init_distributed(rank, world, "127.0.0.1", port, ParallelLayout())
    out = {}
    for name, (per_rank, packed) in cases.items():
        lengths = torch.tensor(per_rank[rank])
        alone = plan_micro_batches(lengths, max_tokens=BUDGET, packed=packed)
        try:
            plans = plan_micro_batches_across(lengths, ps.get_data_parallel_group(), torch.device("cpu"),
                                              f"policy engine, data-parallel rank {rank}",
                                              max_tokens=BUDGET, packed=packed)
            out[name] = (len(alone), [p.tolist() for p in plans])
        except DataError as err:
            out[name] = (len(alone), str(err))
    return out


def _cost(lengths: list[int], part: list[int], packed: bool) -> int:
    return sum(lengths[i] for i in part) if packed else len(part) * max(lengths[i] for i in part)


def test_every_dp_rank_plans_as_many_micro_batches_within_the_budget() -> None:
    cases = {"padded": ([[4, 8, 10, 3], [3, 2, 2, 1]], False),
             "packed": ([[4, 8, 10, 3], [3, 2, 2, 1]], True),
             # Rank 1 has one row, rank 0 needs three micro-batches: no equal count fits the budget.
             "too_few_rows": ([[4, 8, 10, 3], [10]], False)}
    res = run_distributed(_plans, 2, cases)
    for name in ("padded", "packed"):
        per_rank, packed = cases[name]
        alone = [res[r][name][0] for r in range(2)]
        assert alone[0] != alone[1], alone  # on its own each rank would plan a different count
        counts = {len(res[r][name][1]) for r in range(2)}
        assert counts == {max(alone)}, (name, res[0][name], res[1][name])
        for r in range(2):
            plans = res[r][name][1]
            assert sorted(i for p in plans for i in p) == list(range(len(per_rank[r]))), plans
            assert all(p and _cost(per_rank[r], p, packed) <= BUDGET for p in plans), (name, r, plans)
    for r in range(2):  # the same error on both ranks: neither is left waiting
        err = res[r]["too_few_rows"][1]
        assert isinstance(err, str), err
        assert f"data-parallel rank {r}" in err and "needs 3" in err and "only 1 rows" in err, err
        assert "max_token_len_per_micro_batch=12" in err, err


def _moe_ep2(rank: int, world: int, port: int, hf_dir: str, batch: dict, shards: list) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.packing import compact_rows, plan_micro_batches
    from megarl.megatron.parallel import init_distributed
    from megarl.models.spec import ModelSpec

    layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(ep=2))
    assert (layout.ep, layout.dp) == (2, 2)
    mine = {k: v[shards[rank]] for k, v in batch.items()}
    out: dict[str, Any] = {}
    for packed in (False, True):
        cfg = EngineConfig(use_dynamic_bsz=True, max_token_len_per_micro_batch=BUDGET if packed else 24,
                           use_sequence_packing=packed, lr=1e-2, eps=1e-2, weight_decay=0.0)
        engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), layout, cfg)
        engine.load_hf_weights(hf_dir)
        rows = compact_rows(mine["input_ids"], mine["attention_mask"], mine["responses"].shape[1])
        alone = len(plan_micro_batches(rows.total_lens, max_tokens=cfg.max_token_len_per_micro_batch,
                                       packed=packed))
        planned = len(engine._micro_batches(mine))
        lp = engine.compute_log_prob(mine, calculate_entropy=True)
        metrics = engine.train_step(mine, pg_loss_fn, mini_batch_size=len(shards[rank]), calculate_entropy=True)
        out[packed] = {"alone": alone, "planned": planned, "lp": lp["log_probs"],
                       "loss": metrics["loss"][0], "grad_norm": metrics["grad_norm"][0]}
    return out


def test_moe_at_ep2_runs_unequal_dp_shards_with_dynamic_batches() -> None:
    """The longest rows on one DP rank and the shortest on the other: on their own the ranks plan
    different counts; together they run as many micro-batches each, and the log-probs equal HF's."""
    model = make_moe_model("qwen3_moe", seed=5)
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=21, batch=8)
    order = torch.argsort(batch["attention_mask"].sum(1), descending=True, stable=True)
    shards = [order[:4], order[4:]]
    res = run_distributed(_moe_ep2, 2, hf_dir, batch, shards, timeout=200)
    ref_lp, _ = hf_logprobs(model, batch)
    for packed in (False, True):
        alone = [res[r][packed]["alone"] for r in range(2)]
        assert alone[0] != alone[1], (packed, alone)
        assert [res[r][packed]["planned"] for r in range(2)] == [max(alone)] * 2, packed
        for r in range(2):
            rows = shards[r]
            mask = batch["response_mask"][rows].bool()
            err = (res[r][packed]["lp"].double() - ref_lp[rows])[mask].abs().max().item()
            assert err < 1e-5, (packed, r, err)
        assert res[0][packed]["loss"] == res[1][packed]["loss"], packed  # reduced over DP
        assert res[0][packed]["grad_norm"] > 0
