"""`megarl train` end to end with the vLLM engine: a few GRPO steps of the quickstart (`make demo`'s
config and task) on 2 CPU workers, each holding an in-process vLLM engine fed by the weight sync.

Checks that the run really generated with vLLM (the startup line names the engine), that every
weight sync moved exactly the plan's minimum bytes (derived here from the checkpoint as well), and
that vLLM's log-probs of the sampled tokens equal the trainer's to fp32 accuracy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

pytestmark = pytest.mark.vllm  # skipped by tests/conftest.py where vLLM is not installed

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart_cpu.yaml"
STEPS = 3
# vLLM's CPU fp32 log-probs match transformers' to ~1e-5 (greedy) and ~4e-5 (T=1, the quickstart's
# temperature). Bound: 2.5x the latter. A sync that did not reach the engine shows far above it: the
# first Adam step (lr 1e-4) moves the quickstart's log-probs by ~1e-2.
LOGPROB_GAP_MAX = 1e-4


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's task (Makefile `demo`: 2 operands 0..4, '+'), smaller."""
    out = tmp_path_factory.mktemp("arith")
    subprocess.run(
        [sys.executable, "-m", "megarl.cli", "data", "make", "arithmetic", "--out", str(out),
         "--tokenizer-out", str(out / "tokenizer"), "--num-operands", "2", "--min-value", "0",
         "--max-value", "4", "--operators", "+", "--train-size", "200", "--val-size", "16"],
        check=True, capture_output=True, text=True,
    )
    return out


def tensor_parallel_bytes(checkpoint: Path) -> int:
    """Bytes of the tensors Megatron splits over tensor-parallel ranks: all but the 1-D norm weights
    (q/k/v biases are split with their projections)."""
    total = 0
    with safe_open(str(checkpoint), framework="pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            if not name.endswith("norm.weight"):
                total += tensor.numel() * tensor.element_size()
    return total


def quickstart_overrides(task_dir: Path, run_dir: Path) -> list[str]:
    """The quickstart with the vLLM engine for STEPS steps at actor TP=2 (the sync reshards into
    rollout TP=1): no validation, checkpoints or plots."""
    return [
        "rollout.engine=vllm",
        "actor.megatron.tensor_model_parallel_size=2",
        f"data.train_files=[{task_dir / 'train.parquet'}]",
        "data.val_files=[]",
        "data.val_batch_size=null",
        f"data.tokenizer={task_dir / 'tokenizer'}",
        f"trainer.total_training_steps={STEPS}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.progress_bar=false",
        f"trainer.default_local_dir={run_dir}",
        "tracking.backends=[jsonl,console]",
        "tracking.report_plots=false",
    ]


def test_quickstart_grpo_with_vllm_engine(tmp_path: Path, task_dir: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = quickstart_overrides(task_dir, run_dir)
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_LOGGING_LEVEL="ERROR")
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", str(QUICKSTART), *overrides],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    # The engine the workers built, as the run reports it at startup.
    assert "rollout engine: vllm (rollout.engine=vllm)" in proc.stdout, proc.stdout[-3000:]

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    metrics = {row["step"]: row["metrics"] for row in map(json.loads, lines)}
    assert sorted(metrics) == list(range(1, STEPS + 1))

    # Actor TP=2 and rollout TP=1 on the same 2 ranks: each rank holds its half of every
    # tensor-parallel tensor and all norm weights, so both ranks together must receive exactly the
    # tensor-parallel bytes, once per step.
    expected_bytes = tensor_parallel_bytes(run_dir / "initial_model" / "model.safetensors")
    for step, m in metrics.items():
        assert m["sync/bytes_minimum"] == expected_bytes, (step, m["sync/bytes_minimum"], expected_bytes)
        assert m["sync/bytes_received"] == m["sync/bytes_minimum"], (step, m["sync/bytes_received"])

    # Steps 2.. generate with synced (updated) weights: their log-probs must still match the trainer's.
    for step, m in metrics.items():
        gap = m["training/rollout_logprob_abs_diff_max"]
        assert 0.0 <= gap < LOGPROB_GAP_MAX, (step, gap)
        assert m["actor/grad_norm"] > 0.0
