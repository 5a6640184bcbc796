"""The actor and critic loss functions built from typed specs (megarl.workers.losses), against float64
loops: what each adds up, the metrics they report, and the gradient of a mini-batch split into
micro-batches as the engine does."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megarl.algorithms import (
    ADVANTAGE_PROPORTIONAL_LOSSES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    RolloutCorrectionSettings,
    mini_batch_normalisers,
    rows_with_advantage,
)
from megarl.errors import ConfigError
from megarl.workers.losses import (
    ActorLossSpec,
    CriticLossSpec,
    make_actor_loss,
    make_critic_loss,
    own_where_left_out,
    zero_advantage_rows_add_nothing,
)

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
        "kl_loss_type": "low_var_kl", "old_log_prob_source": "recompute", "skip_zero_advantage_rows": False,
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


def test_rows_with_advantage_by_hand() -> None:
    adv = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.5, 0.0], [0.0, 0.0, 2.0], [float("nan"), 0.0, 0.0], [-0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    # row 2's advantage sits on a padding token; a NaN advantage is kept (its NaN must reach the loss)
    assert rows_with_advantage(adv, mask).tolist() == [False, True, False, True, False]


def _zero_advantage_case(seed: int) -> dict[str, torch.Tensor]:
    mb = micro_batch(seed, batch=8)
    mb["advantages"][[0, 3, 4]] = 0.0  # three rows of zero advantage, one of them partly masked
    mb["advantages"][5, mb["response_mask"][5] == 0] = 0.0
    mb["advantages"][6] = 0.0
    mb["advantages"][6, -1] = 1.5  # nonzero on a padding token only: a zero-advantage row
    mb["response_mask"][6, -1] = 0.0
    return mb


@pytest.mark.parametrize("loss_mode", sorted(ADVANTAGE_PROPORTIONAL_LOSSES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_rows_of_zero_advantage_add_nothing_to_the_builtin_losses(loss_mode: str, mode: str) -> None:
    """The rows left out (with the mini-batch's normalisers) give the loss and the gradient of all rows."""
    mb = _zero_advantage_case(4)
    spec = ActorLossSpec(loss_mode=loss_mode, loss_agg_mode=mode, clip_ratio_high=0.28)
    assert zero_advantage_rows_add_nothing(spec)
    runs = rows_with_advantage(mb["advantages"], mb["response_mask"])
    assert runs.tolist() == [False, True, False, False, False, True, False, True]
    normalisers = mini_batch_normalisers(mb["response_mask"])

    def loss_and_grad(rows: torch.Tensor) -> tuple[float, torch.Tensor]:
        log_prob = mb["log_probs"].clone().requires_grad_()
        part = {k: v[rows] for k, v in mb.items()}
        loss, _ = make_actor_loss(spec)({"log_probs": log_prob[rows]}, part, normalisers)
        loss.backward()
        return loss.item(), log_prob.grad

    full_loss, full_grad = loss_and_grad(torch.arange(8))
    run_loss, run_grad = loss_and_grad(runs.nonzero().squeeze(-1))
    assert run_loss == pytest.approx(full_loss, abs=1e-12)
    torch.testing.assert_close(run_grad, full_grad, atol=1e-12, rtol=0)
    assert bool((full_grad[~runs] == 0).all()) and bool((full_grad[runs] != 0).any())


@pytest.mark.parametrize("extra", [{"entropy_coeff": 0.01}, {"use_kl_loss": True}])
def test_an_entropy_bonus_or_kl_loss_gives_zero_advantage_rows_a_gradient(extra: dict) -> None:
    """Why those losses keep every row: the terms that do not depend on the advantage."""
    mb = _zero_advantage_case(5)
    spec = ActorLossSpec(**extra)
    assert not zero_advantage_rows_add_nothing(spec)
    log_prob = mb["log_probs"].clone().requires_grad_()
    entropys = mb["entropys"].clone().requires_grad_()
    loss, _ = make_actor_loss(spec)({"log_probs": log_prob, "entropys": entropys}, mb,
                                     mini_batch_normalisers(mb["response_mask"]))
    loss.backward()
    grad = log_prob.grad if spec.use_kl_loss else entropys.grad
    assert bool((grad[0] != 0).any())  # row 0: zero advantage
    with pytest.raises(ConfigError, match="cannot skip them"):
        make_actor_loss(dataclasses.replace(spec, skip_zero_advantage_rows=True))


def test_a_user_loss_is_not_assumed_proportional_to_the_advantage() -> None:
    assert set(ADVANTAGE_PROPORTIONAL_LOSSES) <= set(POLICY_LOSSES.names())
    assert not zero_advantage_rows_add_nothing(ActorLossSpec(loss_mode="my_loss"))


@pytest.mark.parametrize("loss_mode", sorted(ADVANTAGE_PROPORTIONAL_LOSSES))
@pytest.mark.parametrize("correction", ["none", "tis"])
def test_a_row_the_pass_left_out_runs_on_its_own_log_probs(loss_mode: str, correction: str) -> None:
    """A zero-advantage row whose old log-probs are NaN (the pass left it out) and that the update
    runs anyway adds nothing: the loss and gradient are those of the rows of nonzero advantage with the
    row's old log-probs given (any finite value gives the same), rollout correction or not."""
    mb = _zero_advantage_case(6)
    mb["rollout_log_probs"] = mb["old_log_probs"] - 0.05
    spec = ActorLossSpec(loss_mode=loss_mode, old_log_prob_source="recompute", skip_zero_advantage_rows=True,
                         rollout_correction=RolloutCorrectionSettings(mode=correction, threshold=2.0))
    normalisers = mini_batch_normalisers(mb["response_mask"])
    left_out = torch.tensor([True, False, False, True, False, False, True, False])  # rows 0, 3, 6: zero advantage

    def loss_and_grad(old: torch.Tensor) -> tuple[float, torch.Tensor]:
        log_prob = mb["log_probs"].clone().requires_grad_()
        loss, _ = make_actor_loss(spec)({"log_probs": log_prob}, {**mb, "old_log_probs": old}, normalisers)
        loss.backward()
        return loss.item(), log_prob.grad

    given_loss, given_grad = loss_and_grad(mb["old_log_probs"])
    missing = mb["old_log_probs"].masked_fill(left_out.unsqueeze(-1), float("nan"))
    loss, grad = loss_and_grad(missing)
    assert math.isfinite(loss) and loss == pytest.approx(given_loss, abs=1e-12)
    torch.testing.assert_close(grad, given_grad, atol=1e-12, rtol=0)
    assert bool((grad[left_out] == 0).all())


def test_own_where_left_out_by_hand() -> None:
    nan = float("nan")
    old = torch.tensor([[nan, nan], [-1.0, -2.0], [nan, nan], [-0.5, nan]], dtype=torch.float64)
    own = torch.tensor([[-3.0, -4.0], [-5.0, -6.0], [-7.0, -8.0], [-9.0, -9.5]], dtype=torch.float64)
    adv = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])
    out = own_where_left_out(old, own, adv, mask)
    # rows 0 and 3 (zero advantage, NaN somewhere) take their own log-probs whole; row 1 keeps its
    # own old log-probs; row 2 has an advantage: its NaN stays, for the loss to show.
    assert out[0].tolist() == [-3.0, -4.0] and out[3].tolist() == [-9.0, -9.5]
    assert out[1].tolist() == [-1.0, -2.0]
    assert bool(torch.isnan(out[2]).all())


def test_without_the_skip_a_missing_old_log_prob_reaches_the_loss() -> None:
    mb = _zero_advantage_case(7)
    mb["old_log_probs"][0] = float("nan")  # row 0: zero advantage
    spec = ActorLossSpec(old_log_prob_source="recompute")
    loss, _ = make_actor_loss(spec)({"log_probs": mb["log_probs"]}, mb, mini_batch_normalisers(mb["response_mask"]))
    assert math.isnan(loss.item())
