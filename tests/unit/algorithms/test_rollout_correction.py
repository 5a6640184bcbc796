"""Rollout-training mismatch correction (megarl.algorithms.rollout_correction) against a hand-worked
example and float64 loops, its place in the policy losses, and the actor loss's old-log-prob sources."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import (
    PolicyLossInputs,
    PolicyLossSettings,
    RolloutCorrectionSettings,
    RolloutMismatchError,
    check_logprob_gap,
    correction_weights,
    get_policy_loss,
    importance_weights,
    logprob_gap,
    logprob_gap_uncheckable,
    mini_batch_normalisers,
    mismatch_metrics,
    rollout_mismatch_metrics,
)
from megarl.errors import ConfigError
from megarl.workers.losses import ActorLossSpec, make_actor_loss

pytestmark = pytest.mark.unit

LN2, LN3, LN4 = math.log(2.0), math.log(3.0), math.log(4.0)


def hand_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two responses: log w = [ln 2, 0, -ln 4] (w = 2, 1, 1/4) and [ln 3, -ln 2, padding] (w = 3, 1/2)."""
    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -0.1, -9.0]], dtype=torch.float64)
    log_w = torch.tensor([[LN2, 0.0, -LN4], [LN3, -LN2, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    return rollout + log_w, rollout, mask


def close(got: torch.Tensor, want: list[list[float]]) -> None:
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=0)


def test_importance_weights_by_level_by_hand() -> None:
    trainer, rollout, mask = hand_example()
    close(importance_weights(trainer, rollout, mask, "token"), [[2, 1, 0.25], [3, 0.5, 0]])
    close(importance_weights(trainer, rollout, mask, "sequence"), [[0.5] * 3, [1.5, 1.5, 0]])  # products
    g0, g1 = 0.5 ** (1 / 3), 1.5 ** 0.5  # geometric means
    close(importance_weights(trainer, rollout, mask, "geometric"), [[g0] * 3, [g1, g1, 0]])


def test_correction_modes_by_hand() -> None:
    trainer, rollout, mask = hand_example()

    def weights(**kw: object) -> torch.Tensor:
        return correction_weights(trainer, rollout, mask, RolloutCorrectionSettings(**kw))

    close(weights(mode="none"), [[1, 1, 1], [1, 1, 0]])
    close(weights(mode="tis", threshold=2.0), [[2, 1, 0.25], [2, 0.5, 0]])  # 3 cut to 2
    close(weights(mode="tis", level="sequence", threshold=1.2), [[0.5] * 3, [1.2, 1.2, 0]])
    # MIS keeps w inside [lower, upper], drops the rest: 1/4 and 3 are outside [0.5, 2].
    close(weights(mode="mis", lower=0.5, upper=2.0), [[2, 1, 0], [0, 0.5, 0]])
    close(weights(mode="mis", level="sequence", lower=0.5, upper=1.2), [[0.5] * 3, [0, 0, 0]])
    close(weights(mode="mis", level="geometric", lower=0.8, upper=2.0), [[0] * 3, [1.5 ** 0.5] * 2 + [0]])
    # IcePop's M(w) = w inside the band, 0 outside, per token: token-level MIS whatever the level.
    close(weights(mode="icepop", lower=0.5, upper=2.0), [[2, 1, 0], [0, 0.5, 0]])
    # reject drops what MIS drops and keeps the others unweighted, at any level.
    close(weights(mode="reject", lower=0.5, upper=2.0), [[1, 1, 0], [0, 1, 0]])
    close(weights(mode="reject", level="sequence", lower=0.5, upper=1.2), [[1] * 3, [0, 0, 0]])


def test_weights_carry_no_gradient_and_log_ratios_are_bounded() -> None:
    trainer, rollout, mask = hand_example()
    trainer = trainer.clone().requires_grad_()
    w = correction_weights(trainer, rollout, mask, RolloutCorrectionSettings(mode="tis"))
    assert not w.requires_grad
    huge = importance_weights(torch.tensor([[0.0]]), torch.tensor([[-100.0]]), torch.ones(1, 1))
    assert float(huge) == pytest.approx(math.exp(20.0))


def test_mismatch_metrics_by_hand() -> None:
    trainer, rollout, mask = hand_example()
    m = mismatch_metrics(trainer, rollout, mask, RolloutCorrectionSettings(mode="mis", lower=0.5, upper=2.0))
    log_w = [LN2, 0.0, -LN4, LN3, -LN2]
    assert m["rollout_corr/kl_k1"] == pytest.approx(-sum(log_w) / 5)  # = ln(4/3) / 5
    assert m["rollout_corr/kl_k3"] == pytest.approx(sum(math.exp(x) - x - 1 for x in log_w) / 5)
    # per response: trainer ppl / rollout ppl = exp(-mean log w)
    assert m["rollout_corr/ppl_ratio"] == pytest.approx((2 ** (1 / 3) + (2 / 3) ** 0.5) / 2)
    rollout_ppl = (math.exp((1.0 + 2.0 + 0.5) / 3) + math.exp((0.7 + 0.1) / 2)) / 2
    assert m["rollout_corr/rollout_ppl"] == pytest.approx(rollout_ppl)
    assert m["rollout_corr/weight_mean"] == pytest.approx((2 + 1 + 0.25 + 3 + 0.5) / 5)
    assert m["rollout_corr/weight_max"] == pytest.approx(3.0)
    assert m["rollout_corr/applied_weight_mean"] == pytest.approx((2 + 1 + 0 + 0 + 0.5) / 5)
    assert m["rollout_corr/masked_token_frac"] == pytest.approx(2 / 5)
    assert m["rollout_corr/masked_seq_frac"] == pytest.approx(1.0)  # each response lost a token
    seq = mismatch_metrics(trainer, rollout, mask, RolloutCorrectionSettings(level="sequence"))
    assert seq["rollout_corr/weight_mean"] == pytest.approx((0.5 + 1.5) / 2)  # over responses
    assert seq["rollout_corr/masked_token_frac"] == 0.0 and seq["rollout_corr/applied_weight_mean"] == 1.0


def random_inputs(seed: int, rows: int = 7, length: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(rows, length, generator=gen, dtype=torch.float64) * 3
    trainer = rollout + (torch.rand(rows, length, generator=gen, dtype=torch.float64) - 0.5) * 1.5
    mask = (torch.arange(length) < torch.randint(1, length + 1, (rows, 1), generator=gen)).double()
    mask[3] = 0  # a padding row
    return trainer, rollout, mask


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["tis", "mis", "icepop", "reject"])
def test_weights_match_float64_loops(mode: str, level: str) -> None:
    trainer, rollout, mask = random_inputs(seed=3)
    s = RolloutCorrectionSettings(mode=mode, level=level, threshold=1.3, lower=0.7, upper=1.4)
    got = correction_weights(trainer, rollout, mask, s)
    for i in range(trainer.shape[0]):
        valid = [t for t in range(trainer.shape[1]) if mask[i, t] > 0]
        diffs = [float(trainer[i, t] - rollout[i, t]) for t in valid]
        for t in range(trainer.shape[1]):
            if t not in valid:
                assert got[i, t] == 0
                continue
            if mode == "icepop" or level == "token":
                w = math.exp(diffs[valid.index(t)])
            elif level == "sequence":
                w = math.exp(sum(diffs))
            else:
                w = math.exp(sum(diffs) / len(diffs))
            if mode == "tis":
                want = min(w, 1.3)
            else:
                keep = 0.7 <= w <= 1.4
                want = (1.0 if mode == "reject" else w) if keep else 0.0
            assert float(got[i, t]) == pytest.approx(want, abs=1e-12), (i, t)


def test_logprob_gap_metrics_and_the_loud_threshold() -> None:
    trainer, rollout, mask = hand_example()
    gap = logprob_gap(trainer, rollout, mask)
    diffs = [LN2, 0.0, LN4, LN3, LN2]
    assert gap["training/rollout_logprob_abs_diff_mean"] == pytest.approx(sum(diffs) / 5)
    assert gap["training/rollout_logprob_abs_diff_max"] == pytest.approx(LN4)
    probs = [abs(math.exp(float(trainer[i, t])) - math.exp(float(rollout[i, t])))
             for i, t in ((0, 0), (0, 1), (0, 2), (1, 0), (1, 1))]
    assert gap["training/rollout_probs_diff_mean"] == pytest.approx(sum(probs) / 5)
    assert gap["training/rollout_probs_diff_max"] == pytest.approx(max(probs))
    assert logprob_gap(trainer, rollout, torch.zeros_like(mask)) == {}
    check_logprob_gap(3, 0.05, 0.1)
    check_logprob_gap(3, 5.0, None)
    with pytest.raises(RolloutMismatchError, match=r"step 7: .* 0\.25 nats, above rollout\.max_logprob_gap = 0\.1\b"):
        check_logprob_gap(7, 0.25, 0.1)
    with pytest.raises(RolloutMismatchError, match="weight sync"):
        check_logprob_gap(7, 1e6, 0.1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gap_stops_the_run(bad: float) -> None:
    """A NaN gap fails every comparison: it must stop the run, not pass as a small gap (a NaN rollout
    log-prob makes the correction weights, then the loss, NaN)."""
    with pytest.raises(RolloutMismatchError, match=r"step 7: .* rollout log-probs contained non-finite values"):
        check_logprob_gap(7, bad, 0.1)
    with pytest.raises(RolloutMismatchError, match=r"non-finite values \(NaN or inf\) on 3 response tokens"):
        check_logprob_gap(7, bad, 0.1, nonfinite_tokens=3)
    check_logprob_gap(7, bad, None)  # rollout.max_logprob_gap = null: no check


def test_non_finite_rollout_log_probs_are_counted_and_stop_the_run() -> None:
    trainer, rollout, mask = hand_example()
    broken = rollout.clone()
    broken[0, 1] = float("nan")
    broken[1, 0] = -float("inf")
    broken[1, 2] = float("nan")  # padding: not a response token, not counted
    got = rollout_mismatch_metrics(trainer, broken, mask, RolloutCorrectionSettings(mode="tis"))
    assert got["training/rollout_logprob_num_nonfinite"] == 2
    assert math.isnan(got["training/rollout_logprob_abs_diff_mean"])
    with pytest.raises(RolloutMismatchError, match="non-finite values"):
        check_logprob_gap(4, got["training/rollout_logprob_abs_diff_mean"], 0.1)
    clean = rollout_mismatch_metrics(trainer, rollout, mask, RolloutCorrectionSettings(mode="tis"))
    assert clean["training/rollout_logprob_num_nonfinite"] == 0


def test_kl_k1_is_not_clamped() -> None:
    """The +-20 clamp guards exp() (weights, k3); k1 takes no exp: it is the plain mean of rollout - trainer."""
    rollout = torch.tensor([[-30.0, -1.0]], dtype=torch.float64)
    trainer = torch.tensor([[-0.5, -1.0]], dtype=torch.float64)  # trainer - rollout = 29.5, then 0
    m = mismatch_metrics(trainer, rollout, torch.ones(1, 2), RolloutCorrectionSettings())
    assert m["rollout_corr/kl_k1"] == pytest.approx((-29.5 + 0.0) / 2)  # = -14.75
    assert m["rollout_corr/kl_k3"] == pytest.approx((math.exp(20.0) - 20.0 - 1.0) / 2)  # clamped: 29.5 -> 20


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"rollout_correction\.mode = 'is'.*tis"):
        RolloutCorrectionSettings(mode="is")
    with pytest.raises(ConfigError, match=r"rollout_correction\.level = 'seq'.*geometric"):
        RolloutCorrectionSettings(level="seq")
    with pytest.raises(ConfigError, match="old_log_prob_source = 'auto'"):
        make_actor_loss(ActorLossSpec(old_log_prob_source="auto"))


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "reinforce"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
def test_policy_losses_apply_weights_to_each_token_before_aggregating(name: str, agg: str) -> None:
    """loss(weights) = aggregate(w * per-token terms) with the unchanged normaliser: checked through
    the gradient of each token's log-prob, which the weight scales exactly."""
    trainer, rollout, mask = random_inputs(seed=5)
    gen = torch.Generator().manual_seed(1)
    adv = torch.randn(trainer.shape, generator=gen, dtype=torch.float64)
    weights = torch.rand(trainer.shape, generator=gen, dtype=torch.float64) * mask
    weights[0, 0] = 0.0  # a dropped token
    norms = mini_batch_normalisers(mask)
    settings = PolicyLossSettings(loss_agg_mode=agg)

    def grad(w: torch.Tensor | None) -> torch.Tensor:
        lp = trainer.clone().requires_grad_()
        inputs = PolicyLossInputs(rollout, lp, adv, mask, normalisers=norms, weights=w)
        loss, _ = get_policy_loss(name)(inputs, settings)
        loss.backward()
        return lp.grad

    plain, weighted = grad(None), grad(weights)
    # Each term's gradient flows through its own token's log-prob only (GSPO's shared sequence ratio
    # enters as a detached value), so the weight scales it exactly.
    torch.testing.assert_close(weighted, plain * weights, atol=1e-12, rtol=0)
    assert weighted[0, 0] == 0.0


def loss_inputs(seed: int = 2) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    trainer, rollout, mask = random_inputs(seed)
    gen = torch.Generator().manual_seed(seed)
    mb = {"advantages": torch.randn(trainer.shape, generator=gen, dtype=torch.float64), "response_mask": mask,
          "rollout_log_probs": rollout, "old_log_probs": trainer.clone()}
    return mb, trainer


def actor_grad(spec: ActorLossSpec, mb: dict[str, torch.Tensor], log_prob: torch.Tensor) -> torch.Tensor:
    lp = log_prob.clone().requires_grad_()
    loss, _ = make_actor_loss(spec)({"log_probs": lp}, mb, mini_batch_normalisers(mb["response_mask"]))
    loss.backward()
    return lp.grad


def test_update_source_is_the_vanilla_policy_gradient_and_equals_recompute_on_policy() -> None:
    """With the update's own log-probs as old log-probs the ratio is exactly 1, so the PPO loss's
    gradient is -A/N per token (token-mean): the same as with recomputed old log-probs that equal
    the current ones (the policy has not moved), and the same as REINFORCE."""
    mb, current = loss_inputs()
    n = float(mb["response_mask"].sum())
    want = -mb["advantages"] * mb["response_mask"] / n
    by_update = actor_grad(ActorLossSpec(old_log_prob_source="update"), {k: v for k, v in mb.items()
                                                                          if k != "old_log_probs"}, current)
    recomputed = actor_grad(ActorLossSpec(old_log_prob_source="recompute"), mb, current)
    torch.testing.assert_close(by_update, want, atol=1e-15, rtol=0)
    torch.testing.assert_close(recomputed, want, atol=1e-15, rtol=0)


def test_correction_in_the_actor_loss_for_each_source() -> None:
    """TIS weights multiply the per-token gradient; they compare the recomputed old log-probs (recompute)
    or the update's own (update, rollout) with the rollout engine's."""
    mb, current = loss_inputs()
    tis = RolloutCorrectionSettings(mode="tis", threshold=1.2)
    mask, adv, n = mb["response_mask"], mb["advantages"], float(mb["response_mask"].sum())
    w = correction_weights(current, mb["rollout_log_probs"], mask, tis)
    assert bool(((w > 0) & (w < 1.2)).any()) and bool((w == 1.2).any())  # both sides of the cut occur
    for source in ("recompute", "update"):
        got = actor_grad(ActorLossSpec(old_log_prob_source=source, rollout_correction=tis), mb, current)
        torch.testing.assert_close(got, -adv * w / n, atol=1e-15, rtol=0)
    # recompute: the weights come from old_log_probs, not from the current log-probs
    moved = dict(mb, old_log_probs=mb["old_log_probs"] + 0.3 * mask)
    w_old = correction_weights(moved["old_log_probs"], mb["rollout_log_probs"], mask, tis)
    got = actor_grad(ActorLossSpec(loss_mode="reinforce", rollout_correction=tis), moved, current)
    torch.testing.assert_close(got, -adv * w_old / n, atol=1e-15, rtol=0)
    # rollout: old log-probs are the rollout's (the driver puts them there); pg_is with REINFORCE
    as_rollout = dict(mb, old_log_probs=mb["rollout_log_probs"])
    got = actor_grad(ActorLossSpec(loss_mode="reinforce", old_log_prob_source="rollout", rollout_correction=tis),
                     as_rollout, current)
    torch.testing.assert_close(got, -adv * w / n, atol=1e-15, rtol=0)


def test_log_prob_sink_receives_each_micro_batch_detached() -> None:
    mb, current = loss_inputs()
    seen: list[torch.Tensor] = []
    loss_fn = make_actor_loss(ActorLossSpec(old_log_prob_source="update"), lambda data, lp: seen.append(lp))
    lp = current.clone().requires_grad_()
    loss_fn({"log_probs": lp}, mb, mini_batch_normalisers(mb["response_mask"]))
    assert len(seen) == 1 and not seen[0].requires_grad and torch.equal(seen[0], current)


def test_rows_the_trainer_did_not_score_are_left_out() -> None:
    """NaN trainer log-probs (rows outside the update's first optimizer step) count nowhere."""
    trainer, rollout, mask = hand_example()
    partial = trainer.clone()
    partial[1] = float("nan")
    got = rollout_mismatch_metrics(partial, rollout, mask, RolloutCorrectionSettings())
    first_row = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    want = {**logprob_gap(trainer, rollout, first_row), "training/rollout_logprob_num_nonfinite": 0.0,
            **mismatch_metrics(trainer, rollout, first_row, RolloutCorrectionSettings())}
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k]) for k in want)
    assert got["training/rollout_logprob_abs_diff_mean"] == pytest.approx((LN2 + LN4) / 3)


def test_logprob_gap_is_uncheckable_where_the_sampling_changes_the_log_probs() -> None:
    assert logprob_gap_uncheckable(0.7, 1.0, -1, "processed") is None
    assert logprob_gap_uncheckable(1.0, 0.9, 0, "raw") is None  # raw: the filters do not enter
    assert "rollout.top_p = 0.9 and rollout.top_k = 20" in logprob_gap_uncheckable(1.0, 0.9, 20, "processed")
    assert "rollout.temperature" in logprob_gap_uncheckable(0.7, 1.0, -1, "raw")
