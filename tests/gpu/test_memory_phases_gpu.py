"""Colocated memory phases on CUDA: one `megarl train` run (GRPO, HF rollout engine, the actor's
state offloaded outside its phases, the rollout engine asleep outside generation). The step's peak
allocated device memory stays within 1.1x of the larger of its training-phase and rollout-phase
peaks: training and rollout take turns on the device instead of adding up. Skipped without CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_check  # noqa: E402

pytestmark = pytest.mark.gpu
STEPS = 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_colocated_step_peak_stays_within_the_larger_phase(tmp_path: Path) -> None:
    data, run = tmp_path / "data", tmp_path / "run"
    subprocess.run([sys.executable, "-m", "megarl.cli", "data", "make", "arithmetic", "--out", str(data),
                    "--tokenizer-out", str(data / "tokenizer"), "--num-operands", "2", "--min-value", "0",
                    "--max-value", "4", "--operators", "+", "--train-size", "400", "--val-size", "32"],
                   check=True, capture_output=True, text=True)
    overrides = gpu_check.train_overrides("cuda", str(data), str(run), STEPS)
    proc = subprocess.run([sys.executable, "-m", "megarl.cli", "train", str(ROOT / "configs" / "quickstart_cpu.yaml"),
                           *overrides], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-5000:]
    metrics = gpu_check.read_metrics(run / "metrics.jsonl")
    summary = gpu_check.memory_summary(metrics)
    print(json.dumps(summary, indent=1))
    steady = metrics[STEPS]
    phases = summary[str(STEPS)]["max_allocated_gb"]
    assert {"sync_weights", "gen", "update_actor"} <= set(phases), phases
    assert "old_log_prob" not in phases  # one on-policy mini-batch: the update supplies the old log-probs
    # The actor's state is out of the device while the rollout generates, and the rollout's weights
    # and cache are gone while the actor updates.
    assert steady["perf/colocated_peak_ratio"] <= gpu_check.PEAK_RATIO_MAX, summary
