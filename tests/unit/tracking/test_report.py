"""Run report: PNG plots readable by matplotlib and a summary with the right numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import argparse

from megarl.errors import MegarlError
from megarl.tracking.cli import register_cli
from megarl.tracking.report import write_report

pytestmark = pytest.mark.unit


def _write_run(run_dir: Path, n_steps: int = 20) -> None:
    """A synthetic run: reward 0.1*step, val reward at steps 0, 10, 20, gen takes 3 s of a 5 s step."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 0, "time": 1000.0, "metrics": {"val-core/arith/reward/mean@1": 0.05}}) + "\n")
        for step in range(1, n_steps + 1):
            metrics = {
                "critic/score/mean": 0.1 * step,
                "response_length/mean": 10.0 + step,
                "response_length/min": 5.0,
                "response_length/max": 20.0 + step,
                "actor/ppo_kl": 0.001 * step,
                "actor/kl_loss": 0.002 * step,
                "actor/entropy": 2.0 - 0.05 * step,
                "perf/throughput": 1000.0 + 10 * step,
                "timing_s/gen": 3.0,
                "timing_s/update_actor": 1.5,
                "timing_s/reward": 0.5,
                "timing_s/step": 5.0,
                "memory/gen/peak_rss_gb": 1.5 + 0.01 * step,
                "memory/update_actor/peak_rss_gb": 2.5,
            }
            if step % 10 == 0:
                metrics["val-core/arith/reward/mean@1"] = 0.05 * step
            f.write(json.dumps({"step": step, "time": 1000.0 + 5.0 * step, "metrics": metrics}) + "\n")


def test_report_writes_plots_and_summary(tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    _write_run(tmp_path)
    paths = write_report(tmp_path, k=5)
    assert set(paths) == {"reward", "response_length", "kl", "throughput", "timing", "entropy", "memory", "summary"}
    for name, path in paths.items():
        assert path.parent == tmp_path / "report"
        if name != "summary":
            image = mpimg.imread(path)
            assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300, name
            assert image.std() > 0.01, f"{name}.png is blank"
    text = paths["summary"].read_text()
    # first 5 steps: 0.1..0.5 -> mean 0.3; last 5 (16..20): 1.6..2.0 -> mean 1.8
    assert "first 5 steps 0.3000, last 5 steps 1.8000 (+1.5000)" in text
    assert "steps: 0–20 (21 logged)" in text
    assert "0.0500 at step 0 -> 1.0000 at step 20" in text  # validation before/after
    # mean throughput: 1000 + 10 * mean(1..20) = 1105
    assert "mean 1105.0 tokens/s" in text
    # gen: 20 x 3 s = 60 s of 100 s of step time
    assert "biggest phase: gen, 60.0 s in total (60.0% of step time)" in text
    assert "training time (sum of step times): 1:40" in text
    assert "| update_actor | 30.00 | 30.0% |" in text


def test_nested_phases_count_once_in_the_phase_table(tmp_path: Path) -> None:
    """With reward.overlap the reward (1 s) is scored inside old_log_prob (4 s in all): the table counts
    old_log_prob's own 3 s, so the shares add up to the step (10 s), not to 110%."""
    from megarl.tracking.metrics import compute_timing_metrics
    from megarl.trainer.timing import Timer

    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    timer = Timer(clock=clock)
    with timer("step"):
        with timer("gen"):
            clock.now += 4.0
        with timer("old_log_prob"):
            with timer("reward"):
                clock.now += 1.0
            clock.now += 3.0
        with timer("update_actor"):
            clock.now += 2.0
    inner, timings = timer.inner(), timer.pop()
    metrics = compute_timing_metrics(timings, 100, inner=inner)
    assert metrics["timing_s/old_log_prob"] == 4.0 and metrics["timing_self_s/old_log_prob"] == 3.0
    assert "timing_self_s/step" not in metrics and "timing_self_s/gen" not in metrics
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "metrics": metrics}) + "\n" for s in (1, 2)))
    text = write_report(tmp_path)["summary"].read_text()
    assert "| old_log_prob * | 6.00 | 30.0% |" in text and "| reward | 2.00 | 10.0% |" in text
    assert "| gen | 8.00 | 40.0% |" in text and "| update_actor | 4.00 | 20.0% |" in text
    assert "without the phases timed inside it" in text


def test_report_plots_the_kl_penalised_in_the_reward(tmp_path: Path) -> None:
    """PPO with KL in the reward logs `actor/reward_kl_penalty` and no KL loss: the KL plot draws it."""
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "metrics": {"critic/score/mean": s, "actor/reward_kl_penalty": 0.01 * s}}) + "\n"
        for s in (1, 2, 3)))
    paths = write_report(tmp_path)
    assert set(paths) == {"reward", "kl", "summary"}


def test_report_skips_plots_without_their_metrics(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "metrics": {"critic/score/mean": s}}) + "\n" for s in (1, 2, 3))
    )
    paths = write_report(tmp_path)
    assert set(paths) == {"reward", "summary"}
    # default k = min(10, n // 2) = 1: first step 1, last step 3
    assert "first 1 steps 1.0000, last 1 steps 3.0000 (+2.0000)" in paths["summary"].read_text()


def _run_cli(argv: list[str]) -> int:
    # Only this module's subcommand: the full `megarl` parser imports every subsystem (slow).
    parser = argparse.ArgumentParser(prog="megarl")
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_report_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write_run(tmp_path, n_steps=4)
    assert _run_cli(["report", str(tmp_path), "--k", "2"]) == 0
    out = capsys.readouterr().out
    assert "first 2 steps 0.1500, last 2 steps 0.3500" in out
    assert str(tmp_path / "report" / "reward.png") in out
    with pytest.raises(MegarlError, match="metrics file not found"):  # megarl.cli prints it and exits 1
        _run_cli(["report", str(tmp_path / "missing")])
    for k in ("0", "-3"):
        with pytest.raises(SystemExit) as done:  # a usage error, before anything is read
            _run_cli(["report", str(tmp_path), f"--k={k}"])
        assert done.value.code == 2
        assert f"{k!r} is not a number of steps; valid: an integer >= 1" in capsys.readouterr().err


def test_long_runs_draw_smoothed_curves_and_stacked_areas(tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    _write_run(tmp_path, n_steps=70)  # > 30 points: moving average; > 60 steps: stacked area
    paths = write_report(tmp_path)
    for name in ("reward", "timing"):
        assert mpimg.imread(paths[name]).std() > 0.01
    assert "first 10 steps 0.5500, last 10 steps 6.5500" in paths["summary"].read_text()


def test_moving_average_is_trailing() -> None:
    from megarl.tracking.plots import _moving_average

    assert _moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert _moving_average([3.0, 6.0, 9.0], 5) == [3.0, 4.5, 6.0]


def test_many_phases_fold_into_other(tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    lines = [
        json.dumps({"step": s, "metrics": {f"timing_s/phase{i:02d}": float(i + 1) for i in range(12)}})
        for s in (1, 2, 3)
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    paths = write_report(tmp_path)
    assert set(paths) == {"timing", "summary"}
    assert mpimg.imread(paths["timing"]).std() > 0.01
    # no timing_s/step: shares are of the sum of phases, 12 / (1 + ... + 12) = 12 / 78
    assert "biggest phase: phase11, 36.0 s in total (15.4% of step time)" in paths["summary"].read_text()


def test_validation_and_checkpoint_time_stay_out_of_the_steps_phase_table(tmp_path: Path) -> None:
    """`timing_s/val` and `timing_s/save_checkpoint` lie outside `timing_s/step`: the phase table
    adds up to the step time without them, and the summary gives them on a line of their own."""
    _write_run(tmp_path)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for rec in records:
        if rec["step"] in (10, 20):
            rec["metrics"].update({"timing_s/val": 4.0, "timing_s/save_checkpoint": 1.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = write_report(tmp_path)["summary"].read_text()
    assert "| gen | 60.00 | 60.0% |" in text  # 20 x 3 s of 20 x 5 s
    assert "| val |" not in text and "| save_checkpoint |" not in text
    assert "- outside the steps: validation 8.0 s, checkpoints 2.0 s" in text
