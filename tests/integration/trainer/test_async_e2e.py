"""One-step-off-policy training (`trainer.async_mode=one_step_off`) with the rollout engines in a
pool of their own (`resources.rollout_pool`), end to end on a local Ray cluster:

- every trained row was generated with the weights of one update before (or, after a checkpoint,
  which drains the pipeline, with the current ones): checked row by row in the rollout dumps;
- every rollout rank receives exactly the bytes of its shard over the bridge between the pools;
- a run killed while a generation is in flight resumes to the metrics of an uninterrupted run;
- partial rollout (`trainer.partial_rollout`): a generation in flight is interrupted, the new
  weights are synced, and it continues (or its unfinished rows start again), every token dumped
  with the weight version that sampled it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from test_train_e2e import read_metrics, run_train, task_dir, write_config  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

ASYNC = dict(trainer={"async_mode": "one_step_off"},
             rollout={"free_cache_engine": False},
             algorithm={"rollout_correction": {"mode": "tis", "threshold": 2.0}},
             resources={"rollout_pool": {"nnodes": 1, "devices_per_node": 2}})
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean",
            "rollout_corr/kl_k3", "async/staleness_mean")


def expected_version(step: int, save_freq: int) -> int:
    """The weight version (updates done) the rows trained at `step` were generated with: the first
    step and the step after a checkpoint generate with the current weights (step - 1), the others
    were generated during the previous step, before its update (step - 2)."""
    fresh = step == 1 or (step - 1) % save_freq == 0
    return step - 1 if fresh else step - 2


def model_bytes(model_dir: Path) -> int:
    total = 0
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            total += t.numel() * t.element_size()
    return total


def test_one_step_off_trains_each_row_one_version_old(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    dumps = tmp_path / "rollouts"
    config = write_config(tmp_path, task_dir, **ASYNC)
    proc = run_train(config, "trainer.total_training_steps=5", "trainer.save_freq=3",
                     f"trainer.rollout_data_dir={dumps}")
    assert proc.returncode == 0
    metrics = read_metrics(tmp_path / "run")
    for step in range(1, 6):
        rows = [json.loads(line) for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
        versions = {row["rollout_weights_version"] for row in rows}
        assert len(rows) == 16 and versions == {expected_version(step, 3)}, (step, versions)
        staleness = step - 1 - expected_version(step, 3)
        assert metrics[step]["async/staleness_max"] == staleness == metrics[step]["async/staleness_min"], step
        # The correction weights every row; one update apart, the two policies differ measurably.
        assert "rollout_corr/applied_weight_mean" in metrics[step], step
        if staleness:
            assert metrics[step]["rollout_corr/kl_k3"] > 0, step
    # The actor trains at TP=2: each training rank reshards into a full copy for its rollout rank
    # (2 rollout ranks at rollout TP=1), which receives exactly that, nothing more, at every sync.
    full = model_bytes(tmp_path / "run" / "initial_model")
    # Syncs: step 1 before its generation; step 2 before launching step 3's; none in step 3 (a
    # checkpoint step launches nothing) nor in step 5 (step 4 launched its generation with the
    # weights of step 3's update, one version old); step 4 before its own generation. A step
    # without a sync logs no sync/* (it repeated the last sync's).
    synced = [step for step in range(1, 6) if "sync/bytes_minimum" in metrics[step]]
    assert synced == [1, 2, 4], synced
    for step in synced:
        m = metrics[step]
        assert m["sync/bytes_minimum"] == 2 * full, (step, m["sync/bytes_minimum"], full)
        assert m["sync/bytes_received"] == m["sync/bytes_minimum"] and m["sync/bytes_excess_max"] == 0, step
        assert m["sync/bytes_within_training"] > 0 and m["sync/pieces_verified"] > 0, step


def test_bounded_staleness_syncs_only_when_a_row_would_be_too_old(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    dumps = tmp_path / "rollouts"
    config = write_config(tmp_path, task_dir, **{**ASYNC, "trainer": {"async_mode": "bounded_staleness",
                                                                     "max_staleness": 2}})
    proc = run_train(config, "trainer.total_training_steps=6", "trainer.save_freq=4",
                     f"trainer.rollout_data_dir={dumps}")
    assert proc.returncode == 0
    metrics = read_metrics(tmp_path / "run")
    # Worked by hand: step 1 generates fresh (v0); steps 2 and 3 were generated during steps 1 and 2
    # still with v0 (trained with v1, v2: 1 and 2 versions old); launching step 4's generation
    # during step 3 would give 3 > 2, so v2 is synced first; the checkpoint at step 4 drains the
    # pipeline, so step 5 generates fresh with v4, and step 6 (launched during step 5) with v4.
    versions = {1: 0, 2: 0, 3: 0, 4: 2, 5: 4, 6: 4}
    synced = {1: 1.0, 2: 0.0, 3: 1.0, 4: 0.0, 5: 1.0, 6: 0.0}
    for step, version in versions.items():
        rows = [json.loads(line) for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
        assert {row["rollout_weights_version"] for row in rows} == {version}, step
        assert step - 1 - version <= 2 and metrics[step]["async/staleness_max"] == step - 1 - version, step
        assert metrics[step]["sync/synced"] == synced[step], step


# Partial rollout at a fixed interruption point: one chunk of 2 tokens (of at most 4) with the weights
# of the launch, the rest with the weights after the update.
PARTIAL = ("trainer.partial_rollout_chunk_tokens=2", "trainer.partial_rollout_interrupt_after=1")


def dumped_rows(dumps: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (dumps / f"{step}.jsonl").read_text().splitlines()]


# "drop" (unfinished rows start again after the sync) runs with `make test-slow`.
@pytest.mark.parametrize("partial", ["continue", pytest.param("drop", marks=pytest.mark.slow)])
def test_partial_rollout_goes_on_with_the_new_weights(tmp_path: Path, task_dir: Path, partial: str) -> None:  # noqa: F811
    dumps = tmp_path / "rollouts"
    config = write_config(tmp_path, task_dir, **ASYNC)
    # Every row's trainer log-probs, for the gap of the tokens sampled after the sync: the update runs
    # the rows of zero advantage too (a fresh model scores most groups 0).
    proc = run_train(config, "trainer.total_training_steps=5", "trainer.save_freq=3", f"trainer.partial_rollout={partial}",
                     *PARTIAL, f"trainer.rollout_data_dir={dumps}", "actor.skip_zero_advantage_rows=false")
    assert proc.returncode == 0
    metrics = read_metrics(tmp_path / "run")
    full = model_bytes(tmp_path / "run" / "initial_model")
    continued = 0
    for step in range(1, 6):
        v = expected_version(step, 3)
        for row in dumped_rows(dumps, step):
            n = row["response_length"]
            if v == step - 1:  # generated whole with the current weights (first step, after a checkpoint)
                assert "token_versions" not in row and row["rollout_weights_version"] == v, (step, row)
                continue
            # Launched during the previous step with v, interrupted after 2 tokens, synced to v + 1.
            tokens = row["token_versions"]
            if partial == "continue":
                assert tokens == [v] * min(n, 2) + [v + 1] * max(n - 2, 0), (step, row)
            else:  # an unfinished row starts again: all of one version
                assert tokens in ([v] * n, [v + 1] * n) and (n <= 2 or tokens == [v + 1] * n), (step, row)
            assert row["rollout_weights_version"] == tokens[0], (step, row)
            continued += n > 2
        m = metrics[step]
        if v != step - 1:
            assert m["async/token_staleness_max"] <= 1 and m["sync/synced"] == 1.0, step
            if partial == "continue":
                assert m["async/partial_rows"] > 0, step
            # Tokens sampled after the sync carry the trained weights' log-probs (fp32 both sides; one
            # update apart, as the tokens before the sync are, they differ by ~1e-2).
            fresh_gap = m.get("async/fresh_tokens_logprob_abs_diff_max")
            if fresh_gap is None:  # drop: every row was sampled again after the sync, the batch is fresh
                assert partial == "drop" and m["async/staleness_max"] == 0, step
                fresh_gap = m["training/rollout_logprob_abs_diff_max"]
            assert 0 <= fresh_gap < 1e-4, step
        # Every sync, those that interrupt a generation included, moves exactly each rank's minimum;
        # a step without one logs no sync/*.
        assert ("sync/bytes_received" in m) == bool(m["sync/synced"]), step
        if m["sync/synced"]:
            assert m["sync/bytes_received"] == m["sync/bytes_minimum"] == 2 * full and m["sync/bytes_excess_max"] == 0, step
    assert continued > 0  # the tiny model writes responses longer than the first chunk


def test_partial_rollout_interrupted_by_the_update_keeps_the_staleness_bound(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    """Asynchronous mode: bounded staleness with partial rollouts stopped by the driver's signal once the
    update is done (no fixed interruption point: which tokens get which version depends on timing).
    Responses of 160 tokens (EOS ignored), 2 per prompt: the generation's cost is per token, the tiny
    model's update costs little more for 8 rows than for 1, so generations are still running when
    the signal rises (measured: generation ~0.3 s, update ~0.15 s)."""
    dumps = tmp_path / "rollouts"
    config = write_config(tmp_path, task_dir, **ASYNC)
    proc = run_train(config, "trainer.total_training_steps=5", "trainer.async_mode=bounded_staleness",
                     "trainer.max_staleness=2", "trainer.partial_rollout=continue",
                     "trainer.partial_rollout_chunk_tokens=1", "data.max_response_length=160", "rollout.ignore_eos=true",
                     "model.hf_config.max_position_embeddings=192", "rollout.n=2",
                     f"trainer.rollout_data_dir={dumps}")
    assert proc.returncode == 0
    metrics = read_metrics(tmp_path / "run")
    for step in range(1, 6):
        for row in dumped_rows(dumps, step):
            tokens = row.get("token_versions", [row["rollout_weights_version"]] * row["response_length"])
            assert tokens == sorted(tokens) and row["rollout_weights_version"] == min(tokens), (step, row)
            assert all(0 <= step - 1 - t <= 2 for t in tokens), (step, row)  # the bound, token by token
        assert metrics[step]["async/staleness_max"] <= 2, step
    # Some generation was interrupted by an update and went on with the newer weights.
    assert max(metrics[step].get("async/partial_rows", 0.0) for step in range(2, 6)) > 0


# Three runs each. Partial rollout (one step off, with the generation interrupted and continued across
# the update) runs in `make test`; the two plain pipelines with `make test-slow`.
@pytest.mark.parametrize("mode", [pytest.param("one_step_off", marks=pytest.mark.slow),
                                  pytest.param("bounded_staleness", marks=pytest.mark.slow), "partial_rollout"])
def test_killed_pipelined_run_resumes_with_the_same_metrics(tmp_path: Path, task_dir: Path, mode: str) -> None:  # noqa: F811
    pipelined = {"one_step_off": ("trainer.async_mode=one_step_off",),
                 "bounded_staleness": ("trainer.async_mode=bounded_staleness", "trainer.max_staleness=2"),
                 "partial_rollout": ("trainer.async_mode=one_step_off", "trainer.partial_rollout=continue", *PARTIAL)}
    common = ("trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.max_ckpt_to_keep=3", *pipelined[mode])
    straight = tmp_path / "straight"
    straight.mkdir()
    assert run_train(write_config(straight, task_dir, **ASYNC), *common).returncode == 0
    expected = read_metrics(straight / "run")
    assert expected[4]["async/staleness_max"] == 1  # step 4 trained on rows generated during step 3

    killed = tmp_path / "killed"
    killed.mkdir()
    config = write_config(killed, task_dir, **ASYNC)
    proc = subprocess.Popen([sys.executable, "-m", "megarl.cli", "train", str(config), *common],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=killed, start_new_session=True)
    # Killed once step 3 is logged: step 4's generation was launched during step 3 (not a checkpoint
    # step) and is lost with the processes; the resume must produce it again, the same.
    metrics_file = killed / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics_file.exists() and any(json.loads(line)["step"] == 3 for line in metrics_file.read_text().splitlines()):
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    logged = read_metrics(killed / "run")
    assert 3 in logged and 4 not in logged, sorted(logged)

    assert run_train(config, *common).returncode == 0
    resumed = read_metrics(killed / "run")
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        partial = ("async/partial_rows", "async/token_staleness_mean") if mode == "partial_rollout" and step == 4 else ()
        for key in COMPARED + partial:  # step 4 is the one generated across the update
            assert resumed[step][key] == pytest.approx(expected[step][key], rel=1e-5, abs=1e-7), (step, key)


def test_one_step_off_logs_the_epoch_and_the_syncs_of_each_steps_own_rows(tmp_path: Path) -> None:
    """10 prompts in batches of 4 (2 a epoch), 2 epochs, validation after step 2 and 4.

    `training/epoch` is the epoch of the step's own prompts, as in sync mode (0, 0, 1, 1): before, it
    was read after the next step's prompts were taken for the generation launched during the step,
    so step 2 said 1. `sync/synced` (and the sync/* metrics) describe the syncs the step ran:
    step 1 before its generation, step 2 before launching step 3's; the validation after step 2
    syncs the weights of step 2's update for itself, and step 3 launches step 4's generation with
    them, one version old, without a sync of its own; step 4 launches nothing. Before, the
    validation's sync was reported by step 3."""
    task = tmp_path / "small"
    subprocess.run([sys.executable, "-m", "megarl.cli", "data", "make", "arithmetic", "--out", str(task),
                    "--tokenizer-out", str(task / "tokenizer"), "--num-operands", "2", "--min-value", "0",
                    "--max-value", "4", "--operators", "+", "--train-size", "10", "--val-size", "4"],
                   check=True, capture_output=True, text=True)
    config = write_config(tmp_path, task, **{
        **ASYNC, "actor": {"megatron": {"tensor_model_parallel_size": 1}},
        "resources": {"actor_pool": {"devices_per_node": 1}, "rollout_pool": {"nnodes": 1, "devices_per_node": 1}},
        "trainer": {"async_mode": "one_step_off", "total_training_steps": None, "total_epochs": 2, "test_freq": 2}})
    assert run_train(config).returncode == 0
    metrics = read_metrics(tmp_path / "run")
    assert sorted(metrics) == [1, 2, 3, 4]
    assert [metrics[step]["training/epoch"] for step in (1, 2, 3, 4)] == [0, 0, 1, 1]
    assert [metrics[step]["async/staleness_max"] for step in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert "val/reward_mean" in metrics[2] and "val/reward_mean" in metrics[4]
    assert [metrics[step]["sync/synced"] for step in (1, 2, 3, 4)] == [1.0, 1.0, 0.0, 0.0]
    for step, m in metrics.items():  # a step without a sync logs no sync/*
        assert ("sync/bytes_received" in m) == bool(m["sync/synced"]), step
