"""The `make demo-tools` run in numbers: per-step series and first-10 / last-10 step means of a
finished run's metrics, as JSON, and a PNG of the tool-call rate and the reward by step.

    make demo-tools
    python benchmarks/demo_tools.py --metrics runs/megarl-tools/grpo-calculator/metrics.jsonl \
        --command "make demo-tools" --warm-start-log data/arithmetic_tools/warm_start.log

(`--warm-start-log`: a file holding the line the warm start printed, e.g. make's output saved.)

Series (one value per training step): `tool_call_rate` (share of episodes that call the
calculator), `score_mean` (critic/score/mean: rule score + tool reward, 0..2), `right_answer_share`
(reward/score_mean: the rule score alone, 1 when the last number written is the answer),
`tool_reward_mean`, `retokenize_mismatch` (share of responses), `step_s` (wall seconds of the step).
Writes --out (default benchmarks/results/demo_tools.json) and the PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from megarl.tracking.plots import _pyplot, _save_png

SERIES = {  # name in the results -> metric key in metrics.jsonl
    "tool_call_rate": "agent/tool_call_rate",
    "score_mean": "critic/score/mean",
    "right_answer_share": "reward/score_mean",
    "tool_reward_mean": "agent/tool_reward/mean",
    "retokenize_mismatch": "agent/retokenize_mismatch",
    "tool_errors": "agent/tool_errors",
    "turns_mean": "agent/turns/mean",
    "step_s": "timing_s/step",
}
VALIDATION_KEY = "val/reward_mean"
WINDOW = 10


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of `path` ({"step": int, "metrics": {...}} each); errors name the line."""
    records = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                int(record["step"]), dict(record["metrics"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{path}: line {number} is not a {{step, metrics}} record ({err})") from err
            records.append(record)
    return records


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step series of the training steps (those that logged the tool-call rate), the mean of
    each over the first and the last `WINDOW` steps, and the validation rewards by step."""
    train = [r for r in records if SERIES["tool_call_rate"] in r["metrics"]]
    if len(train) < 2 * WINDOW:
        raise ValueError(f"{len(train)} training steps with {SERIES['tool_call_rate']}; need at least {2 * WINDOW}")
    series: dict[str, list[float | None]] = {"step": [int(r["step"]) for r in train]}
    summary: dict[str, Any] = {}
    for name, key in SERIES.items():
        values = [r["metrics"].get(key) for r in train]
        series[name] = values
        known = [v for v in values if v is not None and math.isfinite(v)]
        if not known:
            continue
        summary[name] = {f"first_{WINDOW}": statistics.fmean([v for v in values[:WINDOW] if v is not None]),
                         f"last_{WINDOW}": statistics.fmean([v for v in values[-WINDOW:] if v is not None]),
                         "min": min(known), "max": max(known)}
    validation = {int(r["step"]): r["metrics"][VALIDATION_KEY] for r in records if VALIDATION_KEY in r["metrics"]}
    return {"steps": len(train), "summary": summary, "validation_reward_mean": validation, "series": series}


def plot(result: dict[str, Any], path: Path) -> None:
    """Tool-call rate, score and right-answer share by step (thin: per step; thick: 10-step mean)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    steps = result["series"]["step"]
    for name, label, color in (("tool_call_rate", "tool-call rate", "tab:blue"),
                               ("score_mean", "score (rule + tool reward, 0..2)", "tab:orange"),
                               ("right_answer_share", "right-answer share", "tab:green")):
        values = [math.nan if v is None else v for v in result["series"][name]]
        ax.plot(steps, values, color=color, alpha=0.3, linewidth=1)
        smooth = [statistics.fmean(values[max(0, i - WINDOW + 1):i + 1]) for i in range(len(values))]
        ax.plot(steps, smooth, color=color, linewidth=2, label=label)
    ax.set_xlabel("GRPO step")
    ax.set_title("make demo-tools: calling the calculator is learned (thick: 10-step mean)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    _save_png(plt, fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--metrics", default="runs/megarl-tools/grpo-calculator/metrics.jsonl")
    parser.add_argument("--out", default="benchmarks/results/demo_tools.json")
    parser.add_argument("--command", default="make demo-tools", help="the command that made the run (recorded)")
    parser.add_argument("--warm-start-log", help="a file holding the warm start's printed summary line (recorded)")
    parser.add_argument("--note", default="", help="free text recorded with the results (machine, load)")
    args = parser.parse_args(argv)
    report = shlex.join(["python", "benchmarks/demo_tools.py", *(sys.argv[1:] if argv is None else argv)])
    result: dict[str, Any] = {"command": args.command, "report_command": report, "metrics_file": args.metrics,
                              "note": args.note}
    if args.warm_start_log:
        text = Path(args.warm_start_log).read_text()
        lines = [ln.strip() for ln in text.splitlines() if ln.startswith("warm start:")]
        result["warm_start"] = lines[-1] if lines else None
    result.update(summarise(read_records(Path(args.metrics))))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    for name, values in result["summary"].items():
        first, last = values[f"first_{WINDOW}"], values[f"last_{WINDOW}"]
        print(f"{name:22s} first {WINDOW}: {first:.3f}  last {WINDOW}: {last:.3f}")
    print(f"-> {out}, {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
