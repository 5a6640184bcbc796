"""Tool-output tokens (response_mask 0) of a multi-turn batch count in no loss, KL or advantage term.

The batch interleaves model turns (mask 1) with tool outputs (mask 0) and ends in padding (mask 0),
as the agent loop builds it. Every term is computed twice: once on the batch, once with the
log-probs, reference log-probs, advantages, entropies, values and rewards of the mask-0 positions
replaced by huge values. The results and the gradients on model tokens must be bitwise equal, the
gradient on mask-0 positions exactly 0, and one case of each is checked against a float64 loop
that only ever reads the model tokens.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megarl.algorithms import (
    LOSS_AGG_MODES,
    AdvantageInputs,
    AdvantageSettings,
    apply_kl_penalty,
    get_advantage_estimator,
    mini_batch_normalisers,
)
from megarl.rewards.manager import last_valid_positions
from megarl.workers.losses import ActorLossSpec, CriticLossSpec, make_actor_loss, make_critic_loss

pytestmark = pytest.mark.unit

# (B=4, R=10): 1 = a model token, 0 = a tool-output token or padding.
#   row 0: call (3) | tool output (3) | answer (2) | padding (2)
#   row 1: call (2) | tool output (2) | call (2) | tool output (1) | answer (3)
#   row 2: direct answer (4) | padding (6)
#   row 3: call (1) | tool output (4) | answer (1) | padding (4)
MASK = torch.tensor([
    [1, 1, 1, 0, 0, 0, 1, 1, 0, 0],
    [1, 1, 0, 0, 1, 1, 0, 1, 1, 1],
    [1, 1, 1, 1, 0, 0, 0, 0, 0, 0],
    [1, 0, 0, 0, 0, 1, 0, 0, 0, 0],
], dtype=torch.float64)
GROUPS = torch.tensor([0, 0, 1, 1])  # two prompts, two episodes each
HUGE = 5.0e3  # far outside any clamp of the losses, still finite in every term they compute


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Float64 (B, R) tensors of one mini-batch; log-probs within +-0.4 of the old ones so that both
    clipped and unclipped PPO terms occur."""
    gen = torch.Generator().manual_seed(seed)
    shape = MASK.shape
    old = -torch.rand(shape, generator=gen, dtype=torch.float64) * 3
    return {
        "old_log_probs": old,
        "log_probs": old + (torch.rand(shape, generator=gen, dtype=torch.float64) * 0.8 - 0.4),
        "ref_log_prob": old + (torch.rand(shape, generator=gen, dtype=torch.float64) * 0.8 - 0.4),
        "advantages": torch.randn(shape, generator=gen, dtype=torch.float64),
        "entropys": torch.rand(shape, generator=gen, dtype=torch.float64) * 2,
        "values": torch.randn(shape, generator=gen, dtype=torch.float64),
        "vpreds": torch.randn(shape, generator=gen, dtype=torch.float64),
        "returns": torch.randn(shape, generator=gen, dtype=torch.float64),
        "token_level_rewards": torch.randn(shape, generator=gen, dtype=torch.float64) * 0.1 * MASK,
        "response_mask": MASK.clone(),
    }


def poisoned(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same batch with every mask-0 entry but the mask set to a huge value (alternating sign by
    column, so both tails of every clamp are hit)."""
    sign = torch.where(torch.arange(MASK.shape[1]) % 2 == 0, 1.0, -1.0).to(torch.float64)
    off = MASK == 0
    out = {}
    for key, value in data.items():
        out[key] = value.clone() if key == "response_mask" else torch.where(off, HUGE * sign * (1 + value.abs()), value)
    return out


def actor_loss_and_grad(spec: ActorLossSpec, data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The actor's loss (megarl.workers.losses, as the Megatron actor calls it) and its gradient
    w.r.t. the log-probs, (B, R)."""
    log_probs = data["log_probs"].clone().requires_grad_(True)
    loss_fn = make_actor_loss(spec)
    outputs = {"log_probs": log_probs, "entropys": data["entropys"]}
    loss, _ = loss_fn(outputs, data, mini_batch_normalisers(data["response_mask"]))
    (grad,) = torch.autograd.grad(loss, log_probs)
    return loss.detach(), grad


def assert_same_on_model_tokens(base: torch.Tensor, other: torch.Tensor) -> None:
    torch.testing.assert_close(other, base, rtol=0, atol=0)


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "cispo", "reinforce"])
@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("kl_type", ["low_var_kl", "k1", "k2", "abs", "k3+"])
def test_actor_loss_ignores_tool_tokens(loss_mode: str, agg_mode: str, kl_type: str) -> None:
    spec = ActorLossSpec(loss_mode=loss_mode, loss_agg_mode=agg_mode, entropy_coeff=0.01, use_kl_loss=True,
                         kl_loss_coef=0.1, kl_loss_type=kl_type)
    data = batch()
    loss, grad = actor_loss_and_grad(spec, data)
    loss_p, grad_p = actor_loss_and_grad(spec, poisoned(data))
    assert torch.isfinite(loss) and torch.isfinite(loss_p)
    assert_same_on_model_tokens(loss, loss_p)
    assert_same_on_model_tokens(grad, grad_p)
    off = MASK == 0
    assert torch.count_nonzero(grad[off]) == 0 and torch.count_nonzero(grad_p[off]) == 0
    assert torch.count_nonzero(grad[~off]) > 0  # the model tokens do train


def reference_vanilla_kl_loss(data: dict[str, torch.Tensor], clip: float = 0.2, clip_c: float = 3.0,
                              kl_coef: float = 0.1,
                              ent_coef: float = 0.01) -> tuple[float, dict[tuple[int, int], float]]:
    """Token-mean PPO (dual-clip) + kl_coef * k3 - ent_coef * entropy over the model tokens only,
    and the gradient of that loss w.r.t. each model token's log-prob, from scalar float64 formulas."""
    model_tokens = [(b, t) for b in range(MASK.shape[0]) for t in range(MASK.shape[1]) if MASK[b, t] == 1]
    n = len(model_tokens)
    total, grad = 0.0, {}
    for b, t in model_tokens:
        lp, old = float(data["log_probs"][b, t]), float(data["old_log_probs"][b, t])
        ref, adv = float(data["ref_log_prob"][b, t]), float(data["advantages"][b, t])
        ent = float(data["entropys"][b, t])
        ratio = math.exp(lp - old)
        unclipped, clipped = -adv * ratio, -adv * min(max(ratio, 1 - clip), 1 + clip)
        term, d_term = (unclipped, -adv * ratio) if unclipped >= clipped else (clipped, 0.0)
        if adv < 0 and term > -adv * clip_c:
            term, d_term = -adv * clip_c, 0.0
        x = ref - lp
        k3, d_k3 = math.exp(x) - x - 1, 1 - math.exp(x)
        total += term + kl_coef * k3 - ent_coef * ent
        grad[(b, t)] = (d_term + kl_coef * d_k3) / n
    return total / n, grad


def test_actor_loss_matches_a_loop_over_model_tokens() -> None:
    spec = ActorLossSpec(loss_mode="vanilla", loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True,
                         kl_loss_coef=0.1, kl_loss_type="low_var_kl")
    data = batch(seed=3)
    expected_loss, expected_grad = reference_vanilla_kl_loss(data)
    for case in (data, poisoned(data)):
        loss, grad = actor_loss_and_grad(spec, case)
        assert float(loss) == pytest.approx(expected_loss, rel=1e-12, abs=1e-12)
        for (b, t), value in expected_grad.items():
            assert float(grad[b, t]) == pytest.approx(value, rel=1e-10, abs=1e-12), (b, t)
    # the batch has clipped and unclipped terms of both signs of the advantage, so the test can fail
    ratio = (data["log_probs"] - data["old_log_probs"]).exp()[MASK == 1]
    assert bool(((ratio - 1).abs() > 0.2).any()) and bool(((ratio - 1).abs() < 0.2).any())


@pytest.mark.parametrize("agg_mode", LOSS_AGG_MODES)
def test_critic_loss_ignores_tool_tokens(agg_mode: str) -> None:
    loss_fn = make_critic_loss(CriticLossSpec(cliprange_value=0.5, loss_agg_mode=agg_mode))

    def loss_and_grad(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        vpreds = data["vpreds"].clone().requires_grad_(True)
        loss, _ = loss_fn({"values": vpreds}, data, mini_batch_normalisers(data["response_mask"]))
        (grad,) = torch.autograd.grad(loss, vpreds)
        return loss.detach(), grad

    data = batch(seed=1)
    loss, grad = loss_and_grad(data)
    loss_p, grad_p = loss_and_grad(poisoned(data))
    assert_same_on_model_tokens(loss, loss_p)
    assert_same_on_model_tokens(grad, grad_p)
    assert torch.count_nonzero(grad_p[MASK == 0]) == 0


def test_kl_in_reward_ignores_tool_tokens() -> None:
    data = batch(seed=2)
    scores = torch.zeros_like(MASK)
    last = last_valid_positions(MASK)
    scores[torch.arange(4), last] = torch.tensor([1.0, 0.0, 2.0, 1.0], dtype=torch.float64)
    out = {}
    for name, case in (("base", data), ("poisoned", poisoned(data))):
        out[name] = apply_kl_penalty(scores, case["old_log_probs"], case["ref_log_prob"], MASK, kl_coef=0.05,
                                     kl_type="k1")
    (rewards, kl), (rewards_p, kl_p) = out["base"], out["poisoned"]
    assert_same_on_model_tokens(rewards, rewards_p)
    assert kl == kl_p
    assert torch.count_nonzero(rewards[MASK == 0]) == 0
    # float64 loop: k1 = old - ref on model tokens, mean per response, then over responses
    per_row = [statistics.fmean(float(data["old_log_probs"][b, t] - data["ref_log_prob"][b, t])
                                for t in range(MASK.shape[1]) if MASK[b, t] == 1) for b in range(4)]
    assert kl == pytest.approx(statistics.fmean(per_row), rel=1e-12)
    b, t = 1, int(last[1])
    assert float(rewards[b, t]) == pytest.approx(
        -0.05 * float(data["old_log_probs"][b, t] - data["ref_log_prob"][b, t]), rel=1e-12)


def test_rewards_sit_on_the_last_model_token() -> None:
    """Outcome scores (and tool rewards) go on each response's last mask-1 token, never on a tool
    output or padding that ends the response, so estimators that sum all token rewards (GRPO, RLOO)
    see only model-token rewards."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert last_valid_positions(mask).tolist() == [1, 2, -1, 3]
    assert last_valid_positions(MASK).tolist() == [7, 9, 3, 5]


def reference_gae(data: dict[str, torch.Tensor], gamma: float,
                  lam: float) -> tuple[list[list[float]], list[list[float]]]:
    """GAE of each response run on its model tokens only (tool outputs and padding dropped, so the
    last model token before a tool output bootstraps from the first one after it), then whitened
    over all model tokens of the batch (unbiased variance, rsqrt(var + 1e-8)). Returns the whitened
    advantages and the returns, per row, model tokens only."""
    raw, returns = [], []
    for b in range(MASK.shape[0]):
        cols = [t for t in range(MASK.shape[1]) if MASK[b, t] == 1]
        r = [float(data["token_level_rewards"][b, t]) for t in cols]
        v = [float(data["values"][b, t]) for t in cols]
        adv, running = [0.0] * len(cols), 0.0
        for i in reversed(range(len(cols))):
            next_value = v[i + 1] if i + 1 < len(cols) else 0.0
            running = r[i] + gamma * next_value - v[i] + gamma * lam * running
            adv[i] = running
        raw.append(adv)
        returns.append([a + value for a, value in zip(adv, v)])
    flat = [a for row in raw for a in row]
    mean, var = statistics.fmean(flat), statistics.variance(flat)
    return [[(a - mean) / math.sqrt(var + 1e-8) for a in row] for row in raw], returns


def test_gae_skips_tool_tokens() -> None:
    settings = AdvantageSettings(gamma=0.9, lam=0.8)
    gae = get_advantage_estimator("gae")
    data = batch(seed=4)
    results = []
    for case in (data, poisoned(data)):
        inputs = AdvantageInputs(case["token_level_rewards"], MASK, group_index=GROUPS, values=case["values"])
        results.append(gae(inputs, settings))
    (adv, ret), (adv_p, ret_p) = results
    assert_same_on_model_tokens(adv, adv_p)
    assert_same_on_model_tokens(ret, ret_p)
    off = MASK == 0
    assert torch.count_nonzero(adv[off]) == 0 and torch.count_nonzero(ret[off]) == 0
    expected_adv, expected_ret = reference_gae(data, gamma=0.9, lam=0.8)
    for b in range(MASK.shape[0]):
        cols = [t for t in range(MASK.shape[1]) if MASK[b, t] == 1]
        assert [float(adv[b, t]) for t in cols] == pytest.approx(expected_adv[b], rel=1e-10, abs=1e-12)
        assert [float(ret[b, t]) for t in cols] == pytest.approx(expected_ret[b], rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("norm_adv_by_std", [True, False])
def test_grpo_advantage_is_zero_on_tool_tokens(norm_adv_by_std: bool) -> None:
    outcome = [2.0, 0.0, 1.0, 0.0]  # e.g. right answer + tool reward, wrong, right without the tool, wrong
    rewards = torch.zeros_like(MASK)
    rewards[torch.arange(4), last_valid_positions(MASK)] = torch.tensor(outcome, dtype=torch.float64)
    settings = AdvantageSettings(norm_adv_by_std=norm_adv_by_std)
    adv, _ = get_advantage_estimator("grpo")(AdvantageInputs(rewards, MASK, group_index=GROUPS), settings)
    assert torch.count_nonzero(adv[MASK == 0]) == 0
    for b in range(4):
        group = [outcome[i] for i in range(4) if GROUPS[i] == GROUPS[b]]
        expected = outcome[b] - statistics.fmean(group)
        if norm_adv_by_std:
            expected /= statistics.stdev(group) + settings.epsilon
        assert adv[b][MASK[b] == 1].tolist() == pytest.approx([expected] * int(MASK[b].sum()), rel=1e-6)
