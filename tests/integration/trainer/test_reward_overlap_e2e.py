"""`reward.overlap`: the driver scores a step's responses while the workers run the step's first
forward pass. The scores do not depend on when they are computed, so a run with the overlap trains
exactly like one without it (same seed: bit-identical metrics), and `training/reward_overlapped`
says which path ran. The time it saves is measured by benchmarks/reward_overlap.py, not here."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_train_e2e import read_metrics, run_train, task_dir, write_config  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

# PPO with a colocated critic, a reference (KL loss) and the old-log-prob pass: three forward
# passes, the first of which (old log-probs) carries the scoring.
PPO_ALL_PASSES = dict(
    algorithm={"adv_estimator": "gae", "lam": 0.95},
    rollout={"n": 2},
    actor={"ppo_micro_batch_size_per_gpu": 2, "use_kl_loss": True, "kl_loss_coef": 0.01,
           "old_log_prob_source": "recompute"},
    critic={"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2},
)
COMPARED = ("critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "actor/pg_loss", "actor/kl_loss",
            "actor/grad_norm", "critic/vf_loss", "critic/values/mean", "response_length/mean")


def test_scoring_beside_the_first_pass_trains_like_scoring_before_it(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    runs = {}
    for overlap in (True, False):
        work = tmp_path / f"overlap-{overlap}"
        work.mkdir()
        config = write_config(work, task_dir, **PPO_ALL_PASSES, reward={"overlap": overlap})
        assert run_train(config).returncode == 0
        runs[overlap] = read_metrics(work / "run")
    for step in (1, 2):
        beside, before = runs[True][step], runs[False][step]
        assert beside["training/reward_overlapped"] == 1.0 and before["training/reward_overlapped"] == 0.0
        for key in COMPARED:
            assert beside[key] == before[key], (step, key, beside[key], before[key])
        # Scoring ran inside the old-log-prob phase with the overlap, before it without.
        assert beside["timing_s/reward"] <= beside["timing_s/old_log_prob"]


def test_no_overlap_where_the_scores_pick_the_batch_or_no_pass_runs(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    """GRPO with the on-policy shortcut and no reference: no pass runs before the update, so
    scoring stays where it was (and the run still trains)."""
    config = write_config(tmp_path, task_dir, reward={"overlap": True}, trainer={"total_training_steps": 1})
    assert run_train(config).returncode == 0
    metrics = read_metrics(tmp_path / "run")[1]
    assert metrics["training/reward_overlapped"] == 0.0
    assert "timing_s/old_log_prob" not in metrics and "critic/score/mean" in metrics
