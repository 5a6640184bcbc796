"""The actor's update (ActorRole on a real Megatron engine, TP=2 over gloo) with each source of old
log-probs, against float64 HF references: the on-policy shortcut (the update's own log-probs,
detached) gives the gradient of the recompute pass, which is the vanilla policy gradient; the
log-probs it keeps are the recompute pass's; a truncated-IS correction scales each token's gradient
by its weight."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# The engine tests' launcher and float64 references live beside them (tests/distributed has no
# package to import them from).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "distributed"))
from _launch import run_distributed  # noqa: E402
from engine_helpers import (  # noqa: E402
    ENTROPY_COEF,
    GRAD_RTOL,
    gather_hf_grads,
    hf_logprobs,
    hf_logprobs_with_grad,
    make_batch,
    make_hf_model,
    reference_gradients,
    relative_error,
    save_hf_model,
)

from megarl.algorithms import RolloutCorrectionSettings, correction_weights  # noqa: E402
from megarl.workers.losses import ActorLossSpec  # noqa: E402

pytestmark = pytest.mark.integration

TIS = RolloutCorrectionSettings(mode="tis", threshold=1.05)
# entropy_coeff as engine_helpers.pg_loss_fn, whose float64 gradient is the reference
CASES = {
    "recompute": ActorLossSpec(entropy_coeff=ENTROPY_COEF, old_log_prob_source="recompute"),
    "update": ActorLossSpec(entropy_coeff=ENTROPY_COEF, old_log_prob_source="update"),
    "update_tis": ActorLossSpec(entropy_coeff=ENTROPY_COEF, old_log_prob_source="update", rollout_correction=TIS),
    "rollout_tis_pg": ActorLossSpec(loss_mode="reinforce", entropy_coeff=ENTROPY_COEF, old_log_prob_source="rollout",
                                    rollout_correction=TIS),
}


def _updates(rank: int, world: int, port: int, hf_dir: str, batch: dict, rollout_log_probs: torch.Tensor) -> dict:
    from megarl.layout import ParallelLayout
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import init_distributed
    from megarl.protocol import Batch
    from megarl.workers.roles import ActorRole
    from megarl.workers.specs import EngineRoleSpec, UpdateSpec

    layout = ParallelLayout(tp=2)
    init_distributed(rank, world, "127.0.0.1", port, layout)
    # No clipping: the gradient is read from Megatron's buffers after the step, which clipping scales.
    engine = EngineConfig(lr=1e-3, eps=1e-6, weight_decay=0.0, clip_grad=1e9, micro_batch_size=3,
                          log_prob_micro_batch_size=8)
    out = {}
    for name, loss in CASES.items():
        spec = EngineRoleSpec(name="actor", model_dir=hf_dir, layout=layout, engine=engine,
                              max_response_length=batch["responses"].shape[1],
                              update=UpdateSpec(mini_batch_sequences=len(batch["responses"])), loss=loss)
        role = ActorRole(None, spec)
        role.init_model()
        data = Batch.from_dict({**batch, "rollout_log_probs": rollout_log_probs})
        old = None
        if loss.old_log_prob_source == "recompute":
            data = data.union(role.compute_log_prob(data))
            old = data["old_log_probs"].clone()
        elif loss.old_log_prob_source == "rollout":
            data["old_log_probs"] = data["rollout_log_probs"]
        update = role.update_actor(data)
        metrics, kept = update.metrics, update.log_probs
        assert (kept is None) == (loss.old_log_prob_source == "recompute")
        out[name] = {"grads": gather_hf_grads(role.engine), "metrics": metrics, "old": old, "kept": kept}
    return out


def weighted_reference(model: torch.nn.Module, batch: dict, weights_of: Any, reinforce: bool = False) -> dict:
    """Float64 gradient of sum(-A * w * log p) / N - ENTROPY_COEF * sum(entropy) / N, w from the
    float64 log-probs (the ratio is 1 on-policy, so PPO and REINFORCE have this same gradient)."""
    ref = copy.deepcopy(model).double().train()
    lp, ent = hf_logprobs_with_grad(ref, batch)
    mask = batch["response_mask"].double()
    n = mask.sum()
    w = weights_of(lp.detach())
    loss = (-(batch["advantages"].double() * w * lp) * mask).sum() / n - ENTROPY_COEF * (ent * mask).sum() / n
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in ref.named_parameters() if p.grad is not None}


def test_shortcut_update_equals_recompute_and_the_float64_policy_gradient() -> None:
    model = make_hf_model("qwen2")
    hf_dir = save_hf_model(model)
    batch = make_batch(seed=11, batch=8)
    mask = batch["response_mask"]
    trainer64 = hf_logprobs(model, batch)[0]  # float64 log-probs of the sampled tokens
    gen = torch.Generator().manual_seed(3)
    rollout = (trainer64 + 0.08 * torch.randn(trainer64.shape, generator=gen, dtype=torch.float64)) * mask
    log_w = (trainer64 - rollout)[mask.bool()]
    # No token sits where float32 rounding could move it across the TIS cut.
    assert float((log_w - torch.log(torch.tensor(TIS.threshold, dtype=torch.float64))).abs().min()) > 1e-4
    assert bool((log_w.exp() > TIS.threshold).any()) and bool((log_w.exp() < TIS.threshold).any())

    res = run_distributed(_updates, 2, hf_dir, batch, rollout.float(), timeout=600)
    assert all(r.keys() == CASES.keys() for r in res)
    got = res[0]
    exact = reference_gradients(model, batch)  # float64 vanilla policy gradient (+ entropy bonus)
    assert relative_error(got["update"]["grads"], exact) < GRAD_RTOL
    assert relative_error(got["recompute"]["grads"], exact) < GRAD_RTOL
    assert relative_error(got["update"]["grads"], got["recompute"]["grads"]) < GRAD_RTOL
    # ratio exactly 1 on the shortcut: nothing clipped, no KL between old and new
    assert got["update"]["metrics"]["actor/ppo_kl"] == 0.0 and got["update"]["metrics"]["actor/pg_clipfrac"] == 0.0
    assert got["update"]["metrics"]["actor/pg_loss"] == pytest.approx(got["recompute"]["metrics"]["actor/pg_loss"],
                                                                      rel=GRAD_RTOL)
    # The log-probs the update keeps are those of the recompute pass (same weights), on every TP rank.
    valid = mask.bool()
    for rank_result in res:
        kept = rank_result["update"]["kept"]
        assert torch.isfinite(kept[valid]).all()
        torch.testing.assert_close(kept[valid].double(), got["recompute"]["old"][valid].double(), atol=2e-6, rtol=0)
        torch.testing.assert_close(kept[valid].double(), trainer64[valid], atol=2e-5, rtol=0)
    # Truncated IS: every token's gradient term scaled by min(exp(trainer - rollout), 1.05).
    tis_exact = weighted_reference(model, batch, lambda lp: correction_weights(lp, rollout, mask, TIS))
    assert relative_error(got["update_tis"]["grads"], tis_exact) < GRAD_RTOL
    assert relative_error(got["update_tis"]["grads"], exact) > 100 * GRAD_RTOL  # the weights change it
    # The rollout's log-probs as old log-probs with REINFORCE + TIS (verl's bypass pg_is): the same gradient.
    assert relative_error(got["rollout_tis_pg"]["grads"], tis_exact) < GRAD_RTOL
