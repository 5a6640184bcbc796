"""One-step-off-policy `megarl train` with vLLM engines in a pool of their own: the actor trains at
TP=2 on 2 processes, the rollout runs vLLM at TP=2 on 2 other processes, and every sync over the
bridge writes each rollout rank's vLLM shard straight into its engine's parameters.

Checks every sync moved exactly the minimum (each rollout rank: its vLLM tensor-parallel shard,
derived here from the checkpoint), that the first step's rows (generated fresh) have vLLM's
log-probs equal to the trainer's to fp32 accuracy, and that the later rows were one version old;
the weight-sync probe (`rollout.probe_freq=1`) finds vLLM's log-probs equal to the trainer's after
every sync. With partial rollout (`trainer.partial_rollout=continue`, interrupted after one chunk of 2
tokens), the vLLM engines continue the rows with the new weights: each token's version is the one
expected, and the tokens sampled after the sync have vLLM's log-probs equal to the trainer's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from test_vllm_train_e2e import LOGPROB_GAP_MAX, QUICKSTART, STEPS, quickstart_overrides, task_dir  # noqa: F401 (fixture)

pytestmark = pytest.mark.vllm  # skipped by tests/conftest.py where vLLM is not installed


def rollout_tp2_bytes(checkpoint: Path) -> int:
    """Bytes both vLLM TP=2 ranks hold together: every tensor split once, the norm weights (1-D)
    replicated on both."""
    total = 0
    with safe_open(str(checkpoint), framework="pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            copies = 2 if name.endswith("norm.weight") else 1
            total += copies * tensor.numel() * tensor.element_size()
    return total


def test_one_step_off_with_vllm_tp2_in_its_own_pool(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    run_dir = tmp_path / "run"
    overrides = [*quickstart_overrides(task_dir, run_dir), "rollout.tensor_model_parallel_size=2",
                 "rollout.free_cache_engine=false", "trainer.async_mode=one_step_off",
                 "resources.rollout_pool.nnodes=1", "resources.rollout_pool.devices_per_node=2",
                 "rollout.probe_freq=1"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_LOGGING_LEVEL="ERROR")
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", str(QUICKSTART), *overrides],
                          capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "rollout engine: vllm (rollout.engine=vllm)" in proc.stdout, proc.stdout[-3000:]

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    metrics = {row["step"]: row["metrics"] for row in map(json.loads, lines)}
    assert sorted(metrics) == list(range(1, STEPS + 1))
    expected = rollout_tp2_bytes(run_dir / "initial_model" / "model.safetensors")
    for step, m in metrics.items():
        assert m["async/staleness_max"] == (0 if step == 1 else 1), step
        assert ("sync/bytes_minimum" in m) == bool(m["sync/synced"]), step  # a step without a sync logs none
        if m["sync/synced"]:
            assert m["sync/bytes_minimum"] == expected, (step, m["sync/bytes_minimum"], expected)
            assert m["sync/bytes_received"] == expected and m["sync/bytes_excess_max"] == 0, step
    # Step 1 trains on rows generated with the weights it trains: the engine has exactly them.
    assert 0.0 <= metrics[1]["training/rollout_logprob_abs_diff_max"] < LOGPROB_GAP_MAX
    # Later rows are one update old: the gap shows that update (the first Adam step moves ~1e-2).
    assert metrics[2]["training/rollout_logprob_abs_diff_max"] > 10 * LOGPROB_GAP_MAX
    # The probe checks the weights each sync brought, also where the rows trained on are older.
    probed = [step for step, m in metrics.items() if m["sync/synced"]]
    assert probed and probed[0] == 1, probed
    for step in probed:
        assert metrics[step]["probe/weights_version"] == step - 1, (step, metrics[step].get("probe/weights_version"))
        assert 0.0 <= metrics[step]["probe/logprob_abs_diff_max"] < LOGPROB_GAP_MAX, step


def test_partial_rollout_continues_in_vllm_after_the_sync(tmp_path: Path, task_dir: Path) -> None:  # noqa: F811
    run_dir, dumps = tmp_path / "run", tmp_path / "rollouts"
    overrides = [*quickstart_overrides(task_dir, run_dir), "rollout.tensor_model_parallel_size=2",
                 "rollout.free_cache_engine=false", "trainer.async_mode=one_step_off",
                 "resources.rollout_pool.nnodes=1", "resources.rollout_pool.devices_per_node=2",
                 "trainer.partial_rollout=continue", "trainer.partial_rollout_chunk_tokens=2",
                 "trainer.partial_rollout_interrupt_after=1", f"trainer.rollout_data_dir={dumps}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_LOGGING_LEVEL="ERROR")
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", str(QUICKSTART), *overrides],
                          capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    metrics = {row["step"]: row["metrics"] for row in map(json.loads, lines)}
    continued = 0
    for step in range(2, STEPS + 1):  # generated during the previous step with its weights, then continued
        v = step - 2
        for line in (dumps / f"{step}.jsonl").read_text().splitlines():
            row = json.loads(line)
            n = row["response_length"]
            assert row["token_versions"] == [v] * min(n, 2) + [v + 1] * max(n - 2, 0), (step, row)
            continued += n > 2
        assert 0.0 <= metrics[step]["async/fresh_tokens_logprob_abs_diff_max"] < LOGPROB_GAP_MAX, step
        assert metrics[step]["sync/bytes_excess_max"] == 0, step
    assert continued > 0
