"""`trainer.queue_generation`: in sync mode the next step's weight sync and generation are sent to
the workers right behind the actor update, so they run while the driver finishes the step. The
workers run the calls in the order sent, with the prompts, seeds and weights of the step-by-step
order, so a run with it trains exactly like one without it (same seed: bit-identical metrics);
`training/generation_queued` says which path ran. The time it saves is measured by
benchmarks/e2e.py, not here."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_train_e2e import SYNC_AND_GEN, read_memory_trace, read_metrics, run_train, task_dir, write_config  # noqa: F401

pytestmark = pytest.mark.integration

# Not compared: timings, memory, worker-call counts and the sync's own seconds.
VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/", "memory/", "sync/seconds_max", "sync/verify_s",
            "async/rollout_busy_s", "reward/time_s", "training/generation_queued")


def test_a_generation_queued_behind_the_update_trains_like_one_sent_after_it(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    runs, traces = {}, {}
    for queued in (True, False):
        work = tmp_path / f"queued-{queued}"
        work.mkdir()
        # TP=2 training -> TP=1 rollout (the sync moves weights between ranks and verifies them);
        # the engines sleep after each generation and wake around the queued sync; validation
        # after step 2 runs behind the generation queued for step 3.
        config = write_config(work, task_dir, trainer={"total_training_steps": 4, "queue_generation": queued,
                                                       "test_freq": 2},
                              rollout={"free_cache_engine": True})
        assert run_train(config).returncode == 0
        runs[queued] = read_metrics(work / "run")
        traces[queued] = read_memory_trace(work / "run", with_val=True)
    assert sorted(runs[True]) == sorted(runs[False]) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        queued, sent_after = runs[True][step], runs[False][step]
        # Step 1's batch comes from the first sync; each later one was queued behind an update.
        assert queued["training/generation_queued"] == float(step > 1)
        assert sent_after["training/generation_queued"] == 0.0
        keys = {k for k in sent_after if not k.startswith(VOLATILE) and k not in ("timing_s/sync_weights",)}
        assert keys <= set(queued), (step, sorted(keys - set(queued)))
        differ = [(key, queued[key], sent_after[key]) for key in sorted(keys) if queued[key] != sent_after[key]]
        assert not differ, (step, differ)
        # Every step synced the weights (sync/synced) and verified what moved between ranks.
        assert queued["sync/synced"] == 1.0 and queued["sync/pieces_verified"] > 0
        # A queued sync is not a timed phase of the step it lands in, but its memory and the
        # generation's are probed as without the queue, and its calls count in that step.
        assert ("timing_s/sync_weights" in queued) == (step == 1)
        assert "memory/sync_weights/peak_rss_gb" in queued and "memory/gen/peak_rss_gb" in queued
        assert queued["perf/worker_calls"] == sent_after["perf/worker_calls"]
    # The engines wake and sleep in the same order, recorded in the same steps and phases, except
    # around the validation after step 2 (in step 2's line, phase "val"): without the queue it syncs
    # the new weights itself and sleeps, and step 3 syncs them again; with it they were synced for
    # step 3 already, and the validation only sleeps after it.
    assert {k: v for k, v in traces[True].items() if k != 2} == {k: v for k, v in traces[False].items() if k != 2}
    assert traces[True][3] == SYNC_AND_GEN
    val_sync = [("val", "rollout", "wake_up:weights"), ("val", "rollout", "wake_up")]
    assert traces[False][2] == [*SYNC_AND_GEN, *val_sync, ("val", "rollout", "sleep")]
    assert traces[True][2] == [*SYNC_AND_GEN, ("val", "rollout", "sleep")]
    assert "val/reward_mean" in runs[True][2]  # compared above with the rest
