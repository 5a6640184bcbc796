"""The actor and critic loss functions built from typed specs (megarl.workers.losses), against float64
loops: what each adds up, the metrics they report, and the gradient of a mini-batch split into
micro-batches as the engine does."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megarl.algorithms import RolloutCorrectionSettings, mini_batch_normalisers
from megarl.errors import ConfigError
from megarl.workers.losses import ActorLossSpec, CriticLossSpec, make_actor_loss, make_critic_loss

from . import loop_reference as ref

pytestmark = pytest.mark.unit


def micro_batch(seed: int = 0, batch: int = 6, length: int = 5) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    mask = (torch.arange(length) < torch.randint(1, length + 1, (batch, 1), generator=gen)).double()
    mask[2] = 0  # a padding row
    return {
        "old_log_probs": old,
        "log_probs": old + (torch.rand(batch, length, generator=gen, dtype=torch.float64) * 1.6 - 0.8),
        "ref_log_prob": old + (torch.rand(batch, length, generator=gen, dtype=torch.float64) * 1.6 - 0.8),
        "entropys": torch.rand(batch, length, generator=gen, dtype=torch.float64) * 2,
        "advantages": torch.randn(batch, length, generator=gen, dtype=torch.float64),
        "values": torch.randn(batch, length, generator=gen, dtype=torch.float64),
        "vpreds": torch.randn(batch, length, generator=gen, dtype=torch.float64),
        "returns": torch.randn(batch, length, generator=gen, dtype=torch.float64),
        "response_mask": mask,
    }


def test_spec_fields_and_defaults() -> None:
    # The driver builds these by name: the names and defaults are the contract with it.
    actor = {f.name: f.default for f in dataclasses.fields(ActorLossSpec)}
    assert actor == {
        "loss_mode": "vanilla", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
        "loss_agg_mode": "token-mean", "entropy_coeff": 0.0, "use_kl_loss": False, "kl_loss_coef": 0.001,
        "kl_loss_type": "low_var_kl", "old_log_prob_source": "recompute",
        "rollout_correction": RolloutCorrectionSettings(), "import_modules": (),
    }
    assert {f.name: f.default for f in dataclasses.fields(CriticLossSpec)} == {
        "cliprange_value": 0.5, "loss_agg_mode": "token-mean",
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        ActorLossSpec().entropy_coeff = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_actor_loss_is_policy_minus_entropy_plus_kl(mode: str) -> None:
    spec = ActorLossSpec(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=mode, entropy_coeff=0.01,
                         use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
    mb = micro_batch()
    log_prob = mb["log_probs"].clone().requires_grad_()
    outputs = {"log_probs": log_prob, "entropys": mb["entropys"]}
    loss, metrics = make_actor_loss(spec)(outputs, mb, mini_batch_normalisers(mb["response_mask"]))
    loss.backward()

    mask = mb["response_mask"].tolist()
    weights = ref.agg_weights(mask, mode)
    pg = entropy = kl = 0.0
    grad = torch.zeros_like(log_prob)
    for i, row in enumerate(mask):
        for t, m in enumerate(row):
            if not m:
                continue
            lp, old, ref_lp = log_prob[i, t].item(), mb["old_log_probs"][i, t].item(), mb["ref_log_prob"][i, t].item()
            v, g, _, _ = ref.ppo_token(lp - old, mb["advantages"][i, t].item(), 0.2, 0.28, 3.0)
            x = ref_lp - lp  # k3: exp(x) - x - 1; d/d log_prob = 1 - exp(x)
            w = weights[i][t]
            pg += w * v
            entropy += w * mb["entropys"][i, t].item()
            kl += w * (math.exp(x) - x - 1)
            grad[i, t] = w * (g + 0.1 * (1 - math.exp(x)))
    assert loss.item() == pytest.approx(pg - 0.01 * entropy + 0.1 * kl, abs=1e-12)
    torch.testing.assert_close(log_prob.grad, grad, atol=1e-12, rtol=0)
    assert metrics["actor/pg_loss"] == pytest.approx(pg, abs=1e-12)
    assert metrics["actor/entropy"] == pytest.approx(entropy, abs=1e-12)
    assert metrics["actor/kl_loss"] == pytest.approx(kl, abs=1e-12)
    assert metrics["actor/kl_coef"] == 0.1
    assert {"actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"} <= set(metrics)


def test_actor_loss_without_entropy_or_kl_is_the_policy_loss() -> None:
    mb = micro_batch(1)
    outputs = {"log_probs": mb["log_probs"].clone().requires_grad_()}
    loss, metrics = make_actor_loss(ActorLossSpec(loss_mode="reinforce"))(
        outputs, mb, mini_batch_normalisers(mb["response_mask"])
    )
    expected = ref.aggregate((-mb["advantages"] * mb["log_probs"]).tolist(), mb["response_mask"].tolist(), "token-mean")
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert metrics["actor/pg_loss"] == pytest.approx(expected, abs=1e-12)
    assert not {"actor/entropy", "actor/kl_loss", "actor/kl_coef"} & set(metrics)


def test_critic_loss_matches_loop() -> None:
    mb = micro_batch(2)
    vpreds = mb["vpreds"].clone().requires_grad_()
    spec = CriticLossSpec(cliprange_value=0.3, loss_agg_mode="seq-mean-token-sum")
    loss, metrics = make_critic_loss(spec)({"values": vpreds}, mb, mini_batch_normalisers(mb["response_mask"]))
    loss.backward()
    mask = mb["response_mask"].tolist()
    weights = ref.agg_weights(mask, "seq-mean-token-sum")
    expected, grad = 0.0, torch.zeros_like(vpreds)
    for i, row in enumerate(mask):
        for t, m in enumerate(row):
            if m:
                term, g, _ = ref.value_loss_token(vpreds[i, t].item(), mb["returns"][i, t].item(),
                                                  mb["values"][i, t].item(), 0.3)
                expected += 0.5 * weights[i][t] * term
                grad[i, t] = 0.5 * weights[i][t] * g
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    torch.testing.assert_close(vpreds.grad, grad, atol=1e-12, rtol=0)
    assert metrics["critic/vf_loss"] == pytest.approx(expected, abs=1e-12)
    assert {"critic/vf_clipfrac", "critic/vpred_mean"} <= set(metrics)


def test_actor_gradient_does_not_depend_on_the_micro_batch_split() -> None:
    spec = ActorLossSpec(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.05, use_kl_loss=True, kl_loss_coef=0.2)
    mb = micro_batch(3, batch=9)
    normalisers = mini_batch_normalisers(mb["response_mask"])
    loss_fn = make_actor_loss(spec)

    def grad_of(pieces: int) -> torch.Tensor:
        log_prob = mb["log_probs"].clone().requires_grad_()
        entropys = mb["entropys"].clone().requires_grad_()
        rows = torch.tensor_split(torch.arange(9), pieces)
        for idx in rows:  # the engine sums the micro-batch losses
            part = {k: v[idx] for k, v in mb.items()}
            loss, _ = loss_fn({"log_probs": log_prob[idx], "entropys": entropys[idx]}, part, normalisers)
            loss.backward()
        return torch.cat([log_prob.grad, entropys.grad])

    torch.testing.assert_close(grad_of(4), grad_of(1), atol=1e-12, rtol=0)


def test_unknown_loss_mode_is_refused_when_building() -> None:
    with pytest.raises(ConfigError, match=r"actor.policy_loss.loss_mode = 'ppo'"):
        make_actor_loss(ActorLossSpec(loss_mode="ppo"))
