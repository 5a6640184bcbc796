"""The actor's update skipping the rows of zero advantage (actor.skip_zero_advantage_rows) on a real
Megatron engine at DP=2 over gloo, against the float64 HF policy gradient of every row: the rows it
leaves out change nothing, also when a rank's whole shard is left out (it still runs one row, so
that the gradient reduction across the ranks happens), with padded or packed micro-batches and the
gradient reduction through shared memory."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

# The engine tests' launcher and float64 references live beside them (tests/distributed has no
# package to import them from).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "distributed"))
from _launch import run_distributed  # noqa: E402
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

ROWS = 8  # 4 per DP rank
ZERO_ROWS = [0, 1, 2, 3, 5, 6]  # all of rank 0's shard, two of rank 1's
ENGINES = {
    "padded": dict(micro_batch_size=1),
    "packed_shared_memory": dict(micro_batch_size=4, use_sequence_packing=True, host_grad_reduce=True),
}


def _updates(rank: int, world: int, port: int, hf_dir: str, batch: dict) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import init_distributed
    from megarl.protocol import Batch
    from megarl.workers.roles import ActorRole
    from megarl.workers.specs import EngineRoleSpec, UpdateSpec

    layout = ParallelLayout()  # DP = 2
    init_distributed(rank, world, "127.0.0.1", port, layout)
    shard = {k: v[rank * 4:(rank + 1) * 4] for k, v in batch.items()}
    out = {}
    for engine_name, options in ENGINES.items():
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
            out[engine_name, skip] = {"grads": gather_hf_grads(role.engine), "metrics": update.metrics,
                                      "kept": update.log_probs}
    return out


def test_skipping_zero_advantage_rows_keeps_the_float64_policy_gradient() -> None:
    model = make_hf_model("qwen2")
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=21, batch=ROWS)
    batch["advantages"][ZERO_ROWS] = 0.0
    mask = batch["response_mask"]

    res = run_distributed(_updates, 2, hf_dir, batch, timeout=600)

    ref = copy.deepcopy(model).double().train()  # float64: sum over every row of -A * log p / N
    lp, _ = hf_logprobs_with_grad(ref, batch)
    (-(batch["advantages"].double() * lp * mask.double()).sum() / mask.sum()).backward()
    exact = {name: p.grad.detach().clone() for name, p in ref.named_parameters() if p.grad is not None}
    trainer64 = hf_logprobs(model, batch)[0]
    runs = torch.ones(ROWS, dtype=torch.bool)
    runs[ZERO_ROWS] = False
    lengths = batch["attention_mask"].sum(dim=-1)
    ran_rows = runs.clone()
    ran_rows[int(lengths[:4].argmin())] = True  # rank 0's row of fewest tokens
    for engine_name in ENGINES:
        for rank, rank_result in enumerate(res):
            full, skipped = rank_result[engine_name, False], rank_result[engine_name, True]
            assert relative_error(full["grads"], exact) < GRAD_RTOL, engine_name
            assert relative_error(skipped["grads"], exact) < GRAD_RTOL, engine_name
            # Rank 0 runs one row of its four (the one with the fewest tokens), rank 1 the two with an
            # advantage: 5 of 8 rows left out, and their tokens, counted over both ranks.
            assert skipped["metrics"]["actor/zero_advantage_rows_skipped"] == 5 / 8
            assert skipped["metrics"]["actor/zero_advantage_tokens_skipped"] == pytest.approx(
                1 - float(lengths[ran_rows].sum()) / float(lengths.sum()), abs=1e-12)
            assert not {"actor/zero_advantage_rows_skipped", "actor/zero_advantage_tokens_skipped"} & set(full["metrics"])
            # The loss counts every row: the same value either way.
            assert skipped["metrics"]["actor/loss"] == pytest.approx(full["metrics"]["actor/loss"], rel=1e-5, abs=1e-7)
            # The log-probs of the rows it ran come back; the rows it left out are NaN.
            rows = slice(rank * 4, (rank + 1) * 4)
            kept, ran = skipped["kept"], runs[rows].clone()
            if rank == 0:  # the row of fewest tokens ran
                ran[int(batch["attention_mask"][rows].sum(dim=-1).argmin())] = True
            assert int(ran.sum()) == (1 if rank == 0 else 2)
            valid = mask[rows].bool()
            assert torch.isnan(kept[~ran]).all()
            torch.testing.assert_close(kept[ran][valid[ran]].double(), trainer64[rows][ran][valid[ran]],
                                       atol=2e-5, rtol=0)
