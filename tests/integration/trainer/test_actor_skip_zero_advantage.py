"""The actor's update skipping the rows of zero advantage (actor.skip_zero_advantage_rows) on a real
Megatron engine over gloo, against the float64 HF policy gradient of every row: the rows it leaves
out change nothing, at DP=2 also when a rank's whole shard is left out (it still runs one row, so
that the gradient reduction across the ranks happens), with padded or packed micro-batches and the
gradient reduction through shared memory, and through a two-stage pipeline."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

# The engine tests' launcher and float64 references live beside them (tests/distributed has no
# package to import them from).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "distributed"))
from _launch import free_ports, run_distributed  # noqa: E402
from engine_helpers import (  # noqa: E402
    GRAD_RTOL,
    gather_hf_grads,
    hf_logprobs,
    hf_logprobs_with_grad,
    make_batch,
    make_hf_model,
    relative_error,
    save_hf_model,
)

from megarl.workers.losses import ActorLossSpec  # noqa: E402

pytestmark = pytest.mark.integration

ROWS = 8  # 4 per DP rank at DP=2
ZERO_ROWS = [0, 1, 2, 3, 5, 6]  # at DP=2 all of rank 0's shard and two of rank 1's
# (layout, engine options): at DP=2 padded and packed micro-batches (gradients summed through shared
# memory), and one row per micro-batch through a two-stage pipeline (DP=1)
CASES = {
    "dp2_padded": (dict(), dict(micro_batch_size=1)),
    "dp2_packed_shared_memory": (dict(), dict(micro_batch_size=4, use_sequence_packing=True, host_grad_reduce=True)),
    "pp2_padded": (dict(pp=2), dict(micro_batch_size=1)),
}


def _updates(rank: int, world: int, port: int, hf_dir: str, batch: dict, ports: list[int]) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import init_distributed
    from megarl.protocol import Batch
    from megarl.workers.roles import ActorRole
    from megarl.workers.specs import EngineRoleSpec, UpdateSpec

    out = {}
    for case_port, (name, (layout_kw, options)) in zip(ports, CASES.items()):
        layout = init_distributed(rank, world, "127.0.0.1", case_port, ParallelLayout(**layout_kw))
        dp = world // layout.pp
        shard = {k: v.chunk(dp)[rank % dp] for k, v in batch.items()}
        # No clipping: the gradient is read from Megatron's buffers after the step, which clipping scales.
        engine = EngineConfig(lr=1e-3, eps=1e-6, weight_decay=0.0, clip_grad=1e9, use_distributed_optimizer=False,
                              **options)
        for skip in (False, True):
            loss = ActorLossSpec(old_log_prob_source="update", skip_zero_advantage_rows=skip)
            spec = EngineRoleSpec(name="actor", model_dir=hf_dir, layout=layout, engine=engine,
                                  max_response_length=batch["responses"].shape[1],
                                  update=UpdateSpec(mini_batch_sequences=ROWS), loss=loss)
            role = ActorRole(None, spec)
            role.init_model()
            update = role.update_actor(Batch.from_dict(dict(shard)))
            out[name, skip] = {"grads": gather_hf_grads(role.engine), "metrics": update.metrics,
                               "kept": update.log_probs, "dp": (role.engine.ranks.dp_rank, role.engine.ranks.dp_size),
                               "last_stage": role.engine.is_last_stage}
    return out


def test_skipping_zero_advantage_rows_keeps_the_float64_policy_gradient() -> None:
    model = make_hf_model("qwen2")
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=21, batch=ROWS)
    batch["advantages"][ZERO_ROWS] = 0.0
    mask = batch["response_mask"]

    res = run_distributed(_updates, 2, hf_dir, batch, free_ports(len(CASES)), timeout=600)

    ref = copy.deepcopy(model).double().train()  # float64: sum over every row of -A * log p / N
    lp, _ = hf_logprobs_with_grad(ref, batch)
    (-(batch["advantages"].double() * lp * mask.double()).sum() / mask.sum()).backward()
    exact = {name: p.grad.detach().clone() for name, p in ref.named_parameters() if p.grad is not None}
    trainer64 = hf_logprobs(model, batch)[0]
    lengths = batch["attention_mask"].sum(dim=-1)
    runs = torch.ones(ROWS, dtype=torch.bool)
    runs[ZERO_ROWS] = False
    for name in CASES:
        for rank_result in res:
            full, skipped = rank_result[name, False], rank_result[name, True]
            dp_rank, dp = skipped["dp"]
            assert relative_error(full["grads"], exact) < GRAD_RTOL, name
            assert relative_error(skipped["grads"], exact) < GRAD_RTOL, name
            # The rows that ran: at DP=2 rank 0's shard has no advantage, so its row of fewest tokens runs.
            ran_rows = runs.clone()
            if dp == 2:
                ran_rows[int(lengths[:4].argmin())] = True
            # The shares left out count the rows and tokens of every DP rank.
            assert skipped["metrics"]["actor/zero_advantage_rows_skipped"] == 1 - float(ran_rows.sum()) / ROWS, name
            assert skipped["metrics"]["actor/zero_advantage_tokens_skipped"] == pytest.approx(
                1 - float(lengths[ran_rows].sum()) / float(lengths.sum()), abs=1e-12)
            skip_metrics = {"actor/zero_advantage_rows_skipped", "actor/zero_advantage_tokens_skipped"}
            assert not skip_metrics & set(full["metrics"])
            # The loss counts every row: the same value either way.
            assert skipped["metrics"]["actor/loss"] == pytest.approx(full["metrics"]["actor/loss"], rel=1e-5, abs=1e-7)
            if not skipped["last_stage"]:
                continue  # only the last pipeline stage sees log-probs
            # The log-probs of the rows it ran come back; the rows it left out are NaN.
            rows = torch.arange(ROWS).chunk(dp)[dp_rank]
            kept, ran, valid = skipped["kept"], ran_rows[rows], mask[rows].bool()
            assert torch.isnan(kept[~ran]).all(), name
            torch.testing.assert_close(kept[ran][valid[ran]].double(), trainer64[rows][ran][valid[ran]],
                                       atol=2e-5, rtol=0)
