"""`megarl train` with and without the old-log-prob pass: the on-policy shortcut skips the phase and
trains the first step like the recompute pass does; the rollout-vs-trainer gap is logged either way,
and `rollout.max_logprob_gap` stops a run whose rollout engine samples at another precision."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from test_train_e2e import read_metrics, run_train, task_dir, write_config  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

GAP = "training/rollout_logprob_abs_diff_mean"
# Budget for two fp32 computations of one gradient or loss (tests/distributed/engine_helpers.GRAD_RTOL).
RTOL = 2e-5


def test_shortcut_skips_the_pass_and_trains_like_recompute(tmp_path: Path, task_dir: Path) -> None:
    runs = {}
    for source in ("auto", "recompute"):
        out = tmp_path / source
        out.mkdir()
        proc = run_train(write_config(out, task_dir), f"actor.old_log_prob_source={source}")
        assert proc.returncode == 0
        runs[source] = read_metrics(out / "run")
    shortcut, recompute = runs["auto"], runs["recompute"]
    for step in (1, 2):
        # one mini-batch of the whole batch, one epoch: auto takes the update's own log-probs
        assert shortcut[step]["training/old_log_prob_source"] == 1
        assert recompute[step]["training/old_log_prob_source"] == 0
        assert "timing_s/old_log_prob" not in shortcut[step] and "timing_s/old_log_prob" in recompute[step]
        assert shortcut[step]["actor/ppo_kl"] == 0.0  # ratio exactly 1
        for run in (shortcut, recompute):  # fp32 rollout and trainer on the same weights agree closely
            assert 0.0 <= run[step][GAP] < 1e-4
            assert math.isfinite(run[step]["rollout_corr/kl_k3"])
            assert run[step]["rollout_corr/ppl_ratio"] == pytest.approx(1.0, abs=1e-3)
    # Step 1 samples the same responses from the same weights: the update is the same.
    one, two = shortcut[1], recompute[1]
    assert one["critic/score/mean"] == two["critic/score/mean"]
    assert one["actor/pg_loss"] == pytest.approx(two["actor/pg_loss"], rel=RTOL, abs=1e-9)
    assert one["actor/grad_norm"] == pytest.approx(two["actor/grad_norm"], rel=RTOL)
    assert one[GAP] == pytest.approx(two[GAP], abs=1e-6)


# "recompute" (the check before the update) runs with `make test-slow`; "update" checks after it.
@pytest.mark.parametrize("source", [pytest.param("recompute", marks=pytest.mark.slow), "update"])
def test_gap_threshold_stops_a_run_sampling_at_another_precision(tmp_path: Path, task_dir: Path, source: str) -> None:
    """A bf16 rollout engine of the fp32 trainer's weights: its log-probs differ by ~1e-3 nats, far
    above a threshold of 1e-5, and the run stops at step 1 naming the gap, the key and the causes;
    also when the old log-probs come from the update (the check then runs after it)."""
    proc = run_train(write_config(tmp_path, task_dir), "rollout.dtype=bf16", "rollout.max_logprob_gap=1e-5",
                     f"actor.old_log_prob_source={source}")
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "step 1: the mean |rollout log-prob - trainer log-prob|" in out, out[-3000:]
    assert "above rollout.max_logprob_gap = 1e-05" in out and "weights did not reach it" in out
    assert "rollout.dtype vs model.dtype" in out
    assert not (tmp_path / "run" / "metrics.jsonl").is_file() or not read_metrics(tmp_path / "run")


def test_rollout_log_probs_as_old_with_rejection_over_two_mini_batches(tmp_path: Path, task_dir: Path) -> None:
    """verl's bypass mode: no pass, the rollout engine's log-probs are the old ones; two mini-batches,
    so the gap is measured on the first optimizer step's rows only (those scored under the sampling
    weights), and it stays at the fp32 level; the rejection's dropped share is logged."""
    proc = run_train(write_config(tmp_path, task_dir, actor={"ppo_mini_batch_size": 2}),
                     "actor.old_log_prob_source=rollout", "algorithm.rollout_correction.mode=reject",
                     "algorithm.rollout_correction.lower=0.999", "algorithm.rollout_correction.upper=1.001")
    assert proc.returncode == 0
    metrics = read_metrics(tmp_path / "run")
    for step in (1, 2):
        m = metrics[step]
        assert m["training/old_log_prob_source"] == 2 and "timing_s/old_log_prob" not in m
        assert 0.0 <= m[GAP] < 1e-4
        assert m["rollout_corr/masked_token_frac"] == 0.0  # fp32: every token's w is within 1e-3 of 1
        assert m["rollout_corr/applied_weight_mean"] == 1.0
