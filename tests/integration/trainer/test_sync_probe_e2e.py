"""The weight-sync probe (`rollout.probe_freq`) end to end on a local Ray cluster: after the syncs it
is due at, the rollout engines sample the fixed probe prompts and the actor scores the same tokens.

- It checks without changing the run: a probed run trains exactly like an unprobed one, and the
  probe's gap is at the fp32 level (synced weights, same precision).
- It catches what the per-step check cannot see: a rollout engine sampling at another precision
  (bf16 of the fp32 weights) with `calculate_log_probs: false` trains to the end unprobed, and stops
  at step 1 probed, naming the probe batch and the key.
- It runs in the pipelined modes too, where the rows trained on were generated with older weights
  (one_step_off with a rollout pool of its own): every sync is probed at probe_freq 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_async_e2e import ASYNC
from test_train_e2e import read_metrics, run_train, task_dir, write_config  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

PROBE = ("probe/logprob_abs_diff_mean", "probe/logprob_abs_diff_max", "probe/probs_diff_mean",
         "probe/probs_diff_max", "probe/weights_version", "timing_s/probe")
# fp32 on both sides, the same weights: the quickstart's per-step gap is ~1e-7 (rollout.max_logprob_gap's note)
FP32_GAP = 1e-5


def trained(metrics: dict) -> dict:
    """A step's metrics that do not depend on wall-clock time or on the probe (a probed sync is not
    queued behind the update: `training/generation_queued` says how the batch was scheduled, the
    same batch either way)."""
    clocked = ("probe/", "timing_s/", "timing_per_token_ms/", "perf/", "memory/", "async/rollout_busy",
               "training/generation_queued")
    return {k: v for k, v in metrics.items()
            if not (k.startswith(clocked) or k.endswith("_s") or "seconds" in k or "time" in k)}


def test_probe_checks_the_synced_weights_without_changing_the_run(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    plain_dir, probed_dir = tmp_path / "plain", tmp_path / "probed"
    plain_dir.mkdir(), probed_dir.mkdir()
    assert run_train(write_config(plain_dir, task_dir), "trainer.total_training_steps=3").returncode == 0
    assert run_train(write_config(probed_dir, task_dir), "trainer.total_training_steps=3", "rollout.probe_freq=2",
                     "rollout.probe_prompts=3").returncode == 0
    plain, probed = read_metrics(plain_dir / "run"), read_metrics(probed_dir / "run")
    for step in (1, 2, 3):
        assert trained(probed[step]) == trained(plain[step]), step
    # Version v = step - 1 is synced at step `step`: versions 0 and 2 are multiples of 2.
    for step in (1, 3):
        assert set(PROBE) <= set(probed[step]), (step, sorted(probed[step]))
        assert probed[step]["probe/weights_version"] == step - 1
        assert 0 <= probed[step]["probe/logprob_abs_diff_mean"] <= probed[step]["probe/logprob_abs_diff_max"] < FP32_GAP
    assert not any(k.startswith("probe/") for k in probed[2])
    assert not any(k.startswith("probe/") for step in plain for k in plain[step])


@pytest.mark.parametrize("probe_freq", [0, 1])
def test_probe_stops_a_run_whose_rollout_samples_at_another_precision(tmp_path: Path, task_dir: Path,  # noqa: F811
                                                                      probe_freq: int) -> None:
    proc = run_train(write_config(tmp_path, task_dir), "rollout.dtype=bf16", "rollout.calculate_log_probs=false",
                     "rollout.max_logprob_gap=1e-5", f"rollout.probe_freq={probe_freq}")
    out = proc.stdout + proc.stderr
    if probe_freq == 0:  # without the rollout's log-probs nothing would compare the gap: refused at the start
        assert proc.returncode != 0 and not (tmp_path / "run" / "metrics.jsonl").exists(), out[-3000:]
        assert "rollout.max_logprob_gap = 1e-05 with rollout.calculate_log_probs = false and " \
               "rollout.probe_freq = 0" in out, out[-3000:]
        return
    assert proc.returncode != 0
    assert "step 1: the mean |rollout log-prob - trainer log-prob| over the probe batch (8 responses" in out, out[-3000:]
    assert "weights of version 0)" in out and "above rollout.max_logprob_gap = 1e-05" in out
    assert "rollout.dtype vs model.dtype" in out


def test_probe_checks_every_sync_of_a_one_step_off_run(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    proc = run_train(write_config(tmp_path, task_dir, **ASYNC), "trainer.total_training_steps=3",
                     "rollout.probe_freq=1", "rollout.probe_prompts=4")
    assert proc.returncode == 0
    metrics = read_metrics(tmp_path / "run")
    # Step 1 syncs version 0 and generates its own rows, then launches step 2's generation with them;
    # step 2 syncs version 1 before launching step 3's; the last step launches nothing and syncs nothing.
    for step in (1, 2):
        m = metrics[step]
        assert m["sync/synced"] == 1.0 and m["probe/weights_version"] == step - 1, (step, m)
        assert m["probe/logprob_abs_diff_max"] < FP32_GAP, step
    assert metrics[3]["sync/synced"] == 0.0 and "probe/weights_version" not in metrics[3]
    assert metrics[3]["async/staleness_mean"] == 1.0  # its rows: version 1, trained from version 2


def test_sampling_filters_do_not_pass_for_a_sync_failure(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    """With top-p the rollout's (processed) log-probs are of the filtered distribution: the step's gap is
    -log of the mass kept, well above rollout.max_logprob_gap's 0.1 for a fresh model, and is logged but
    not checked (it stopped the run, blaming the weight sync); the probe samples without the filter
    and still compares at the fp32 level."""
    proc = run_train(write_config(tmp_path, task_dir), "trainer.total_training_steps=2", "rollout.top_p=0.5",
                     "rollout.probe_freq=1", "rollout.probe_prompts=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rollout.max_logprob_gap is not checked on the training rows: rollout.top_p = 0.5" in proc.stderr
    metrics = read_metrics(tmp_path / "run")
    for step in (1, 2):
        assert metrics[step]["training/rollout_logprob_abs_diff_mean"] > 0.1
        assert metrics[step]["probe/logprob_abs_diff_max"] < FP32_GAP
