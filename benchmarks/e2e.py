"""End to end, side by side: megarl GRPO and TRL's GRPOTrainer on the same task, model and budget.

Same for both: the quickstart's task (a+b= with a, b in 0..4, as `make demo` writes it) and its
character tokenizer; the random-init Qwen2 (megarl writes it to `<run>/initial_model/`, TRL loads
that directory); the prompts of every step (megarl's data-loader order, handed to TRL unshuffled);
8 prompts x 8 responses a step, temperature 1.0; constant lr; no KL (beta 0); token-mean loss;
fp32; the reward (megarl's built-in scorer with the megarl run's `reward.reward_kwargs` on both
sides: the quickstart's "starts with the sum"); two CPU cores (megarl: the quickstart's 2 worker
processes x 1 thread at data-parallel size 2; TRL: 1 process x 2 threads). Two sizes (`--size`):

- quickstart: the quickstart's model (4 layers, hidden 256; 2.4M parameters), up to 4 response
  tokens, lr 1e-4;
- 25m: hidden 512, 8 layers, intermediate 1536, 8/4 heads (~25M parameters), 64 response tokens
  every time (megarl `rollout.ignore_eos`, TRL `min_new_tokens`: the two sample differently from the
  same model, and at equal lengths their throughputs compare), lr 1e-5.

    python benchmarks/e2e.py [--size quickstart|25m] [--steps N] [--rounds R] [--precision fp32|bf16]
                             [--quick] [--out PATH]

`--precision bf16` runs both sides in bf16 mixed precision (bf16 matrix multiplies, fp32 master
weights and optimizer state): megarl with `model.dtype=bf16` (its rollout engine generates in bf16 too),
TRL with `bf16=True`. On a CPU with bf16 matrix units (AMX) this is several times the fp32 rate.

`--rounds R` runs the pair R times in turn (megarl, TRL, megarl, TRL, ...), so that a slow spell of
a shared machine falls on both sides, and reports each round's ratios and their median and range
(`rounds` in the JSON); the detailed sections (phases, MFU, the plot) are the first round's.

`--seeds 1,2,3` runs one round per seed instead (megarl `trainer.seed` and `data.seed`, so its own
initial weights and prompt order; TRL `--seed`, from that round's weights and prompts). Rounds of one
seed repeat one learning curve per side (TRL's sampling is fixed by its seed), so whether one side
learns faster than the other against time is a question of several seeds: `reward_over_seeds` in the
JSON pools the rounds (each side's mean reward in equal windows of the span every run covered, each
seed's megarl - TRL difference, its mean and standard error) and the plot shows the pooled curves.

Step 1 is left out of the time averages. Generated tokens/s and training tokens/s are per step
wall time (response tokens, and prompt + response tokens, over the step's seconds). Useful-token
MFU of a phase: its useful FLOPs over its seconds, over the machine's matmul rate measured in the
same run (torch.mm with the run's 2 threads, best of 10, in the run's precision, measured before,
between and after round 1's two runs; the best of the three). Useful FLOPs count
the real (unpadded) tokens of the step and the parameters that multiply them (all but the input
embedding table):
6 x params x tokens for an update (forward and backward; megarl's counts the tokens of the rows it
ran: with `actor.skip_zero_advantage_rows`, on by default, it leaves out the rows of zero advantage,
which add nothing to the gradient and which TRL computes), 2 x params x tokens for a log-prob pass
(over the rows it computed: with that key and several mini-batches it runs after the advantages, on
the update's rows);
attention's sequence-squared term is left out (under 1% at these lengths). TRL has no separate
log-prob pass; its training time is the step minus generation and scoring.

Reward against wall-clock time: each side's step rewards placed at the end of their step (sum of
step times, start-up excluded), compared over the span both ran: mean reward in 6 equal windows and
over the whole span (`reward_vs_wall_clock` in the JSON), and a plot (`--plot`; by default
`results/e2e_<size>_reward_vs_time.png`, or next to the JSON given with `--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    REPO_ROOT,
    RESULTS_DIR,
    PeakMemorySampler,
    load_average,
    machine_info,
    matmul_flops,
    mean,
    parameter_count,
    ratio,
    write_json,
)
from megarl_run import base_overrides, prepare_task, run_megarl, wall_step_mean  # noqa: E402
from report import reward_plot_name  # noqa: E402

from megarl.dtypes import torch_dtype  # noqa: E402

BENCH_PYTHON = REPO_ROOT / ".venv-bench" / "bin" / "python"
PROMPTS, N, THREADS = 8, 8, 2
# Per size: the model (HF config keys over the quickstart's), response tokens, learning rate, steps.
SIZES: dict[str, dict[str, Any]] = {
    "quickstart": {"hf_config": {}, "response_length": 4, "lr": 1e-4, "steps": 120, "full_length": False,
                   "model": "random-init Qwen2, 4 layers, hidden 256, head_dim 64, character vocabulary"},
    "25m": {"hf_config": {"hidden_size": 512, "num_hidden_layers": 8, "intermediate_size": 1536,
                          "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 128},
            "response_length": 64, "lr": 1e-5, "steps": 8, "full_length": True,
            "model": "random-init Qwen2, 8 layers, hidden 512, intermediate 1536, 8/4 heads, character vocabulary"},
}
# Precisions of both sides: fp32, or bf16 mixed precision (bf16 matrix multiplies, fp32 master
# weights and optimizer state): megarl's `model.dtype`, whose rollout engine then generates in
# bf16 too, and TRL's `bf16=True` (autocast).
PRECISIONS = ("fp32", "bf16")
# TRL also runs with 1 thread: a 2-thread OpenMP process slows down badly when the machine's
# cores are oversubscribed (threads wait for each other at every parallel region), while
# megarl's 1-thread workers do not; the 1-thread figure shows how much of a gap is that effect.
TRL_THREAD_VARIANTS = (1,)


def megarl_prompt_order(cfg: DictConfig, steps: int) -> list[dict[str, str]]:
    """The prompts megarl's loader served in its first `steps` batches (the run's config `cfg`,
    same seed)."""
    from megarl.trainer.setup import build_datasets, load_run_tokenizer

    tokenizer = load_run_tokenizer(cfg)
    loader, _ = build_datasets(cfg, tokenizer)
    rows = []
    for _ in range(steps):
        batch = loader.next_batch()
        for raw, truth in zip(batch["raw_prompt"], batch["ground_truth"]):
            rows.append({"prompt": loader.dataset.renderer.text(raw), "ground_truth": str(truth)})
    return rows


def size_overrides(size: str) -> list[str]:
    """megarl overrides of one size over the quickstart config."""
    spec = SIZES[size]
    return ([f"model.hf_config.{key}={value}" for key, value in spec["hf_config"].items()]
            + [f"data.max_response_length={spec['response_length']}", f"actor.optim.lr={spec['lr']}"]
            + (["rollout.ignore_eos=true"] if spec["full_length"] else []))


def useful_mfu(megarl: dict[str, Any], trl: dict[str, Any], params: int, rates: Sequence[float],
               precision: str = "fp32") -> dict[str, Any]:
    """Useful-token MFU of megarl's update and old-log-prob phases and of TRL's training part,
    summed over the timed steps (see the module doc), against the best of `rates`: torch.mm's
    FLOP/s in the run's `precision` (bf16: the rate its matrix multiplies can reach), measured at
    several moments of the run. On a shared machine one measurement can fall on a busy moment and
    understate what the machine does, which would overstate every MFU; the best one does not."""
    if not rates:
        raise ValueError("useful_mfu: no matmul rate measured")
    rate = max(rates)
    def share(flops: float, seconds: float) -> Optional[float]:
        return flops / seconds / rate if seconds > 0 else None

    timed = [r for r in megarl["records"] if r["step"] > 1 and r.get("total_tokens")]
    tokens = sum(r["total_tokens"] for r in timed)
    # The update runs the rows of nonzero advantage only (actor.skip_zero_advantage_rows): its FLOPs
    # count the tokens it ran. TRL computes every row.
    update_tokens = sum(r["total_tokens"] * (1.0 - (r.get("update_tokens_skipped") or 0.0)) for r in timed)
    # So does the old-log-prob pass where it runs after the advantages (the same key, several mini-batches).
    logprob_tokens = sum(r["total_tokens"] * (1.0 - (r.get("old_log_prob_tokens_skipped") or 0.0)) for r in timed)
    skipped_rows = [r["update_rows_skipped"] for r in timed if r.get("update_rows_skipped") is not None]
    update_s = sum(r.get("update_actor_s", 0.0) for r in timed)
    logprob_s = sum(r.get("old_log_prob_s", 0.0) for r in timed)
    trl_timed = [r for r in trl["records"] if r["step"] > 1 and r.get("prompt_tokens") is not None]
    trl_tokens = sum(r["prompt_tokens"] + r["response_tokens"] for r in trl_timed)
    trl_train_s = sum(r["step_s"] - (r["gen_and_score_s"] or 0.0) for r in trl_timed)
    return {
        "useful_params": params,
        f"matmul_{precision}_flops_per_s": rate,
        f"matmul_{precision}_flops_per_s_measured": list(rates),
        "mfu_precision": precision,
        "megarl_update_mfu": share(6.0 * params * update_tokens, update_s),
        "megarl_old_log_prob_mfu": share(2.0 * params * logprob_tokens, logprob_s),
        "megarl_update_gflops_per_s": 6.0 * params * update_tokens / update_s / 1e9 if update_s else None,
        "megarl_update_tokens_per_step": update_tokens / len(timed) if timed else None,
        "megarl_update_rows_skipped_mean": sum(skipped_rows) / len(skipped_rows) if skipped_rows else None,
        "trl_training_mfu": share(6.0 * params * trl_tokens, trl_train_s),
        "megarl_tokens_per_step": tokens / len(timed) if timed else None,
        "trl_tokens_per_step": trl_tokens / len(trl_timed) if trl_timed else None,
    }


def megarl_reward_options(cfg: DictConfig) -> dict[str, Any]:
    """The scorer options of the megarl run's config `cfg` (`reward.reward_kwargs`), handed to
    TRL's reward."""
    return dict(OmegaConf.to_container(cfg.reward.reward_kwargs) or {})


def reward_timeline(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(time the step ended, its mean reward) per step with a reward; time = sum of the steps' wall
    seconds (`wall_s`, from the previous step's end), the step timer where a record has none (the first)."""
    points, clock = [], 0.0
    for r in records:
        clock += r["wall_s"] if r.get("wall_s") is not None else r["step_s"]
        if r.get("score_mean") is not None:
            points.append((clock, float(r["score_mean"])))
    return points


def reward_vs_wall_clock(megarl_records: list[dict[str, Any]], trl_records: list[dict[str, Any]],
                         windows: int = 6) -> dict[str, Any]:
    """Reward against training time on both sides, over the span both ran (the shorter run's total
    time, T). A step's reward counts at the time its step ended (`reward_timeline`).

    Returns the edges of `windows` equal windows of [0, T], each side's mean step reward in each
    window (None where a side ended no step in it), each side's mean reward over all steps ended by
    T, and megarl / TRL of that mean ("reward_ratio_at_equal_time", above 1: megarl ahead).
    """
    sides = {"megarl": reward_timeline(megarl_records), "trl": reward_timeline(trl_records)}
    if not all(sides.values()):
        return {"error": "a side has no timed steps with a reward"}
    span = min(points[-1][0] for points in sides.values())
    edges = [span * i / windows for i in range(windows + 1)]
    out: dict[str, Any] = {"span_s": span, "window_edges_s": edges}
    for name, points in sides.items():
        in_window: list[list[float]] = [[] for _ in range(windows)]
        for t, score in points:
            if t <= span:
                in_window[min(int(t / span * windows), windows - 1)].append(score)
        out[f"{name}_window_mean"] = [mean(w) if w else None for w in in_window]
        out[f"{name}_steps_in_span"] = sum(len(w) for w in in_window)
        out[f"{name}_mean_in_span"] = mean([score for t, score in points if t <= span])
    out["reward_ratio_at_equal_time"] = ratio(out["megarl_mean_in_span"], out["trl_mean_in_span"])
    return out


def reward_over_seeds(pairs: Sequence[tuple[int, list[dict[str, Any]], list[dict[str, Any]]]],
                      windows: int = 6) -> dict[str, Any]:
    """Reward against training time over several seeds: `pairs` holds (seed, megarl records, TRL
    records) per round. The span is the shortest of all the runs' training times (T), so every run
    covers it; a step counts at the time its step ended (`reward_timeline`).

    Returns the span, the edges of `windows` equal windows of [0, T], each side's mean step reward
    per window pooled over the seeds (every seed ends about as many steps in a window on one side, so
    this is close to the mean of the seeds' window means), per seed each side's mean reward over
    [0, T] and their difference, the mean of the differences with its standard error (sample
    standard deviation / sqrt(seeds); None with one seed), and megarl / TRL of the two sides' mean
    rewards over [0, T] averaged over the seeds ("reward_ratio_at_equal_time").
    """
    timelines = [(seed, reward_timeline(m), reward_timeline(t)) for seed, m, t in pairs]
    if not timelines or not all(m and t for _, m, t in timelines):
        return {"error": "a run has no timed steps with a reward"}
    span = min(points[-1][0] for _, m, t in timelines for points in (m, t))
    edges = [span * i / windows for i in range(windows + 1)]
    out: dict[str, Any] = {"seeds": [seed for seed, _, _ in timelines], "span_s": span, "window_edges_s": edges}
    per_seed = []
    for side, index in (("megarl", 1), ("trl", 2)):
        in_window: list[list[float]] = [[] for _ in range(windows)]
        for run in timelines:
            for t, score in run[index]:
                if t <= span:
                    in_window[min(int(t / span * windows), windows - 1)].append(score)
        out[f"{side}_window_mean"] = [mean(w) if w else None for w in in_window]
    for seed, m, t in timelines:
        m_mean = mean([score for time_s, score in m if time_s <= span])
        t_mean = mean([score for time_s, score in t if time_s <= span])
        if m_mean is None or t_mean is None:  # a first step longer than another run's whole run
            return {"error": f"seed {seed}: a side ended no step within the {span:.2f} s every run covered"}
        per_seed.append({"seed": seed, "megarl_mean_in_span": m_mean, "trl_mean_in_span": t_mean,
                         "difference": m_mean - t_mean})
    out["per_seed"] = per_seed
    diffs = [r["difference"] for r in per_seed]
    out["megarl_mean_in_span"] = mean([r["megarl_mean_in_span"] for r in per_seed])
    out["trl_mean_in_span"] = mean([r["trl_mean_in_span"] for r in per_seed])
    out["difference_mean"] = mean(diffs)
    out["difference_standard_error"] = (
        (sum((d - out["difference_mean"]) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs)) ** 0.5
        if len(diffs) > 1 else None)
    out["reward_ratio_at_equal_time"] = ratio(out["megarl_mean_in_span"], out["trl_mean_in_span"])
    return out


def _reward_axes() -> tuple[Any, Any]:
    """A figure and axes for a reward-against-training-time plot (matplotlib without a display)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.set_xlabel("training time (s, sum of step times)")
    ax.grid(alpha=0.3)
    return fig, ax


def _save_reward_plot(fig: Any, ax: Any, path: Path) -> Path:
    """Legend, layout, the PNG at `path`; the figure closed."""
    import matplotlib.pyplot as plt

    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return path


def plot_reward_over_seeds(pairs: Sequence[tuple[int, list[dict[str, Any]], list[dict[str, Any]]]],
                           path: Path, windows: int = 12) -> Path:
    """PNG: each side's step reward pooled over the seeds in `windows` equal windows of the span
    every run covered (`reward_over_seeds`), against training time."""
    pooled = reward_over_seeds(pairs, windows=windows)
    if "error" in pooled:
        raise ValueError(f"plot_reward_over_seeds: {pooled['error']}")
    edges = pooled["window_edges_s"]
    centres = [(a + b) / 2 for a, b in zip(edges, edges[1:])]
    fig, ax = _reward_axes()
    for name, key in (("megarl", "megarl"), ("TRL", "trl")):
        points = [(c, v) for c, v in zip(centres, pooled[f"{key}_window_mean"]) if v is not None]
        ax.plot([c for c, _ in points], [v for _, v in points], marker="o",
                label=f"{name} (mean over the span {pooled[f'{key}_mean_in_span']:.3f})")
    ax.set_ylabel(f"mean step reward ({windows} windows)")
    ax.set_title(f"Reward against training time, {len(pairs)} seeds pooled")
    return _save_reward_plot(fig, ax, path)


def plot_reward_vs_wall_clock(megarl_records: list[dict[str, Any]], trl_records: list[dict[str, Any]],
                              path: Path, smooth: int = 10) -> Path:
    """PNG: each side's step reward (moving mean over `smooth` steps) against its training time."""
    fig, ax = _reward_axes()
    for name, records in (("megarl", megarl_records), ("TRL", trl_records)):
        points = reward_timeline(records)
        times, scores = [t for t, _ in points], [score for _, score in points]
        smoothed = [mean(scores[max(0, i + 1 - smooth):i + 1]) for i in range(len(scores))]
        ax.plot(times, smoothed, label=f"{name} ({len(scores)} steps)")
    ax.set_ylabel(f"mean reward (moving mean of {smooth} steps)")
    ax.set_title("Reward against wall-clock time, same task, model and prompts")
    return _save_reward_plot(fig, ax, path)


def run_trl(python: Path, model_dir: Path, tokenizer: Path, prompts_file: Path, steps: int,
            work_dir: Path, timeout_s: float, response_length: int, lr: float, full_length: bool,
            reward_options: dict[str, Any], threads: int = THREADS, bf16: bool = False,
            gradient_checkpointing: bool = False, seed: int = 1) -> dict[str, Any]:
    """Run benchmarks/trl_grpo.py in the benchmark environment, sampling its memory. `bf16`: TRL's
    mixed precision (GRPOConfig bf16=True). `gradient_checkpointing`: recompute activations in the
    backward pass, as the megarl run does or not (TRL's own default is to recompute). `seed`: TRL's
    seed (its sampling)."""
    out = work_dir / f"e2e_trl_t{threads}.json"
    cmd = [str(python), str(REPO_ROOT / "benchmarks" / "trl_grpo.py"), "--model-dir", str(model_dir),
           "--tokenizer", str(tokenizer), "--prompts", str(prompts_file), "--steps", str(steps),
           "--prompts-per-step", str(PROMPTS), "--num-generations", str(N),
           "--max-completion-length", str(response_length), "--lr", str(lr), "--threads", str(threads),
           "--reward-options", json.dumps(reward_options), "--seed", str(seed),
           "--work-dir", str(work_dir / "e2e_trl_output"), "--out", str(out)] + (["--full-length"] if full_length else [])
    cmd += ["--bf16"] if bf16 else []
    cmd += ["--gradient-checkpointing"] if gradient_checkpointing else []
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    log_path = work_dir / f"e2e_trl_t{threads}.log"
    load_before = load_average()
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        with PeakMemorySampler(proc.pid) as memory:
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                code = None
    if code != 0 or not out.is_file():
        raise RuntimeError(f"TRL run failed (exit {code}); log {log_path}:\n{log_path.read_text(errors='replace')[-3000:]}")
    result = json.loads(out.read_text())
    if result.get("reward_options") != reward_options:
        raise RuntimeError(f"TRL scored with {result.get('reward_options')}, not megarl's {reward_options}")
    result["memory"] = memory.result()
    result["wall_s"] = round(time.perf_counter() - start, 2)
    result["load_average_before"] = load_before
    result["load_average_after"] = load_average()
    result["summary"] = summarise_trl(result["records"])
    return result


def summarise_trl(records: list[dict[str, Any]], reward_window: int = 5) -> dict[str, Any]:
    """The same averages as megarl_run.summarise_steps, from TRL's per-step records."""
    timed = [r for r in records if r["step"] > 1] or records
    total = sum(r["step_s"] for r in timed)
    gen = sum(r["gen_and_score_s"] or 0.0 for r in timed)
    response = sum(r["response_tokens"] or 0 for r in timed)
    prompt = sum(r["prompt_tokens"] or 0 for r in timed)
    scores = [r["score_mean"] for r in records if r.get("score_mean") is not None]
    return {
        "steps": len(records),
        "timed_steps": len(timed),
        "step_s_mean": mean([r["step_s"] for r in timed]),
        "wall_step_s_mean": wall_step_mean(records),
        "generated_tokens_per_s": response / total if total else None,
        "training_tokens_per_s": (prompt + response) / total if total else None,
        "gen_and_score_share": gen / total if total else None,
        "reward_first": scores[0] if scores else None,
        "reward_last_window_mean": mean(scores[-reward_window:]),
        "reward_window": min(reward_window, len(scores)),
    }


def compare(megarl: dict[str, Any], trl: dict[str, Any]) -> dict[str, Any]:
    """megarl / TRL ratios: above 1 means megarl is larger (slower for step time and memory)."""
    m, t = megarl["summary"], trl["summary"]
    return {
        "step_time": ratio(m["step_s_mean"], t["step_s_mean"]),
        "wall_step_time": ratio(m.get("wall_step_s_mean"), t.get("wall_step_s_mean")),
        "generated_tokens_per_s": ratio(m["generated_tokens_per_s"], t["generated_tokens_per_s"]),
        "training_tokens_per_s": ratio(m["training_tokens_per_s"], t["training_tokens_per_s"]),
        "peak_memory_workload": ratio(megarl["memory"]["workload_mib"], trl["memory"]["workload_mib"]),
        "reward_last_window": ratio(m["reward_last_window_mean"], t["reward_last_window_mean"]),
    }


def round_ratios(megarl: dict[str, Any], trl: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of one megarl/TRL pair."""
    return {"megarl_step_s": megarl["summary"]["step_s_mean"], "trl_step_s": trl["summary"]["step_s_mean"],
            "megarl_wall_step_s": megarl["summary"].get("wall_step_s_mean"),
            "trl_wall_step_s": trl["summary"].get("wall_step_s_mean"),
            **{k: v for k, v in compare(megarl, trl).items()
               if k in ("step_time", "wall_step_time", "generated_tokens_per_s")},
            "reward_ratio_at_equal_time": reward_vs_wall_clock(megarl["records"], trl["records"])
            .get("reward_ratio_at_equal_time"),
            # The machine's load around each side's run: a round whose sides ran under different load
            # compares the load as much as the systems.
            "load_average": {side: [r.get("load_average_before"), r.get("load_average_after")]
                             for side, r in (("megarl", megarl), ("trl", trl))},
            # What the step times and the reward-against-time comparison leave out: each side's whole
            # run minus its steps (start-up: Ray, workers, models; and the end).
            "outside_steps_s": {side: outside_steps_s(r) for side, r in (("megarl", megarl), ("trl", trl))}}


def outside_steps_s(result: dict[str, Any]) -> float | None:
    """A side's run time outside its training steps: the run's wall time (process start to exit)
    minus the steps' time as `reward_timeline` counts it."""
    records = result.get("records") or []
    if result.get("wall_s") is None or not records:
        return None
    steps = sum(r["wall_s"] if r.get("wall_s") is not None else r["step_s"] for r in records)
    return round(result["wall_s"] - steps, 2)


def summarise_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, smallest and largest of each ratio over the rounds."""
    out: dict[str, Any] = {"rounds": len(rounds)}
    for key in ("step_time", "wall_step_time", "generated_tokens_per_s", "reward_ratio_at_equal_time"):
        values = sorted(r[key] for r in rounds if r.get(key) is not None)
        if values:
            mid = len(values) // 2
            median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
            out[key] = {"median": median, "min": values[0], "max": values[-1]}
    return out


def parse_seeds(text: str) -> list[int]:
    """--seeds: comma-separated distinct integers."""
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"seeds repeat in {text!r}: each seed is one round")
    return seeds


def seed_overrides(seed: Optional[int]) -> list[str]:
    """megarl overrides of one round's seed: the initial weights (trainer.seed) and the prompt order
    (data.seed); none where the round keeps the config's."""
    return [] if seed is None else [f"trainer.seed={seed}", f"data.seed={seed}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="quickstart")
    p.add_argument("--steps", type=int, default=None, help="default: 120 at the quickstart size, 8 at 25m")
    p.add_argument("--quick", action="store_true", help="3 steps: a smoke test of both sides")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the megarl/TRL pair this many times in turn; ratios per round, median and range")
    p.add_argument("--seeds", type=parse_seeds, default=None, metavar="S1,S2,...",
                   help="one round per seed (megarl trainer.seed and data.seed, TRL --seed; each round its own "
                        "initial weights and prompts); the reward against time is pooled over the seeds")
    p.add_argument("--work-dir", type=Path, default=None, help="runs and data (default: a temporary folder)")
    p.add_argument("--bench-python", type=Path, default=BENCH_PYTHON, help="python of the TRL environment")
    p.add_argument("--megarl-python", type=Path, default=Path(sys.executable),
                   help="python megarl runs with (e.g. .venv-vllm/bin/python: rollout.engine auto then picks vLLM)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per side")
    p.add_argument("--megarl-override", action="append", default=[], metavar="KEY=VALUE",
                   help="extra megarl config override, repeatable (e.g. actor.old_log_prob_source=recompute, "
                        "which runs the old-log-prob pass so that its MFU is measured)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="both sides: fp32, or bf16 mixed precision (megarl model.dtype=bf16, TRL bf16=True); "
                        "MFU is then against torch.mm's bf16 rate")
    p.add_argument("--out", type=Path, default=None,
                   help="default: results/sections/e2e.json (quickstart, a section of megarl bench), results/e2e_25m.json")
    p.add_argument("--plot", type=Path, default=None,
                   help="reward-vs-time PNG (default: results/e2e_<size>_reward_vs_time.png without --out, else "
                        "<out stem>_reward_vs_time.png next to --out)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.seeds is not None:
        if args.rounds not in (1, len(args.seeds)):
            p.error(f"--rounds {args.rounds} with --seeds {','.join(map(str, args.seeds))}: --seeds runs one round per "
                    "seed; give one of the two")
        args.rounds = len(args.seeds)
    size = SIZES[args.size]
    steps = 3 if args.quick else (args.steps or size["steps"])
    default_out = RESULTS_DIR / "sections" / "e2e.json" if args.size == "quickstart" else RESULTS_DIR / f"e2e_{args.size}.json"
    out = args.out or default_out
    if not args.bench_python.is_file():
        raise SystemExit(f"{args.bench_python} not found: run benchmarks/make_bench_env.sh first (TRL lives there)")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="megarl-bench-e2e-"))
    task = prepare_task(work)
    run_dir = work / "e2e_megarl"

    precision_overrides = [f"model.dtype={args.precision}"]
    megarl_overrides = size_overrides(args.size) + precision_overrides + args.megarl_override
    # The matmul rate before, between and after round 1's two runs (the runs the MFU describes).
    def matmul_rate() -> float:
        return matmul_flops(1024, threads=THREADS, dtype=torch_dtype(args.precision))

    seeds: list[Optional[int]] = list(args.seeds) if args.seeds else [None] * args.rounds
    rates = [matmul_rate()]
    megarl = run_megarl(run_dir, base_overrides(task, run_dir, steps) + megarl_overrides + seed_overrides(seeds[0]),
                        prompts=PROMPTS, n=N, timeout_s=args.timeout, python=str(args.megarl_python))
    rates.append(matmul_rate())
    prompts_file = work / "e2e_prompts.json"
    run_cfg = OmegaConf.load(run_dir / "config.yaml")  # the config the megarl run resolved and saved
    prompts_file.write_text(json.dumps(megarl_prompt_order(run_cfg, steps)))
    trl_seed = int(run_cfg.trainer.seed)
    # Both sides score with the same rule: megarl's scorer options go to TRL's reward function.
    reward_options = megarl_reward_options(run_cfg)
    # The same work on both sides: TRL recomputes activations only when the megarl run does.
    gradient_checkpointing = bool(run_cfg.model.enable_gradient_checkpointing)
    trl_args = dict(response_length=size["response_length"], lr=size["lr"], full_length=size["full_length"],
                    reward_options=reward_options, bf16=args.precision == "bf16",
                    gradient_checkpointing=gradient_checkpointing)
    trl = run_trl(args.bench_python, run_dir / "initial_model", task["tokenizer"], prompts_file, steps, work, args.timeout,
                  seed=trl_seed, **trl_args)
    rates.append(matmul_rate())
    rounds = [{"seed": trl_seed, **round_ratios(megarl, trl)}]
    pairs = [(trl_seed, megarl["records"], trl["records"])]
    for i in range(2, args.rounds + 1):
        # Without --seeds: same task, seed and prompts, TRL from round 1's initial model. With them: this
        # round's seed, its own initial model and prompt order on both sides.
        run_i = work / f"e2e_megarl_round{i}"
        megarl_i = run_megarl(run_i, base_overrides(task, run_i, steps) + megarl_overrides + seed_overrides(seeds[i - 1]),
                              prompts=PROMPTS, n=N, timeout_s=args.timeout,
                              python=str(args.megarl_python))
        model_i, prompts_i, seed_i = run_dir / "initial_model", prompts_file, trl_seed
        if seeds[i - 1] is not None:
            cfg_i = OmegaConf.load(run_i / "config.yaml")
            model_i, prompts_i, seed_i = run_i / "initial_model", work / f"e2e_prompts_round{i}.json", int(cfg_i.trainer.seed)
            prompts_i.write_text(json.dumps(megarl_prompt_order(cfg_i, steps)))
        trl_i = run_trl(args.bench_python, model_i, task["tokenizer"], prompts_i, steps, work,
                        args.timeout, seed=seed_i, **trl_args)
        rounds.append({"seed": seed_i, **round_ratios(megarl_i, trl_i)})
        pairs.append((seed_i, megarl_i["records"], trl_i["records"]))
        print(f"round {i}/{args.rounds}: {json.dumps(rounds[-1])}")
    variants = {}
    for threads in TRL_THREAD_VARIANTS:
        try:
            variants[f"threads={threads}"] = run_trl(args.bench_python, run_dir / "initial_model", task["tokenizer"],
                                                     prompts_file, steps, work, args.timeout, threads=threads,
                                                     seed=trl_seed, **trl_args)
        except RuntimeError as err:  # a variant is extra information, not the comparison itself
            variants[f"threads={threads}"] = {"error": str(err)[-2000:]}

    result = {
        "section": "e2e",
        "machine": machine_info(),
        "setup": {
            "task": "the quickstart's: a+b= with a, b in 0..4 (`make demo`), reward 1 when the completion starts with the sum",
            "reward_options": reward_options,
            "size": args.size,
            "model": f"{size['model']} (same weights both sides)",
            "prompts_per_step": PROMPTS, "responses_per_prompt": N, "max_response_tokens": size["response_length"],
            "full_length": size["full_length"],
            "steps": steps, "lr": size["lr"], "precision": args.precision, "kl": "none (beta 0)", "loss": "token-mean",
            "megarl_overrides": precision_overrides + args.megarl_override,
            "megarl": "2 Ray workers x 1 thread, Megatron DP=2 on gloo (gradients summed through shared memory: "
                      "resources.cpu_grad_reduce) unless megarl_overrides set the layout, rollout.engine auto (HF "
                      "unless the python given has vLLM), actor.old_log_prob_source auto (no separate "
                      "old-log-prob pass: one epoch, one mini-batch, the update's own log-probs), the next "
                      "generation queued behind each update (trainer.queue_generation), rows of zero advantage "
                      "left out of the update (actor.skip_zero_advantage_rows; the same gradient)",
            "trl": f"1 process x {THREADS} threads, model.generate rollout, on-policy (no old-log-prob pass), "
                   f"gradient checkpointing {'on' if gradient_checkpointing else 'off'} as in the megarl run "
                   "(TRL's own default is on)",
            "gradient_checkpointing": gradient_checkpointing,
            "trl_variants": f"TRL again with {', '.join(map(str, TRL_THREAD_VARIANTS))} thread(s): 2-thread OpenMP "
                            "slows down sharply on an oversubscribed machine, 1-thread processes do not",
            "averages": "steps 2..N (step 1 is warm-up); tokens/s over step wall time",
            "memory": "peak of summed RSS of the process tree, sampled every 0.1 s (workload = without Ray daemons)",
        },
        "megarl": megarl,
        "trl": trl,
        "ratios_megarl_over_trl": compare(megarl, trl),
        "rounds": {"per_round": rounds, "summary": summarise_rounds(rounds),
                   "order": "megarl then TRL in each round, rounds one after another",
                   "seeds": "one per round (--seeds)" if args.seeds else "the config's in every round"},
        "reward_vs_wall_clock": reward_vs_wall_clock(megarl["records"], trl["records"]),
        **({"reward_over_seeds": reward_over_seeds(pairs),
            # Each round's reward timeline (end of step in training seconds, step reward), so that the
            # pooled numbers and the plot can be recomputed from the JSON.
            "reward_timelines": [{"seed": seed, "megarl": reward_timeline(m), "trl": reward_timeline(t)}
                                 for seed, m, t in pairs]} if args.seeds else {}),
        # Parameters that multiply each token: all but the input embedding table.
        "mfu": useful_mfu(megarl, trl, parameter_count(run_dir / "initial_model", skip=("embed_tokens.weight",)), rates,
                          args.precision),
        "trl_variants": variants,
        "ratios_megarl_over_trl_variants": {k: compare(megarl, v) for k, v in variants.items() if "summary" in v},
        "load_average_end": load_average(),
    }
    # The results name neither this machine's temporary folders nor the work folder given.
    result = json.loads(json.dumps(result, default=str).replace(str(work), "<work>"))
    write_json(out, result)
    # Not beside the section's JSON by default: results/sections/ is not kept (bench.json sums it up).
    plot_path = args.plot or (RESULTS_DIR / reward_plot_name(args.size) if args.out is None
                              else out.with_name(f"{out.stem}_reward_vs_time.png"))
    plot = (plot_reward_over_seeds(pairs, plot_path) if args.seeds and len(pairs) > 1
            else plot_reward_vs_wall_clock(megarl["records"], trl["records"], plot_path))
    print(f"wrote {plot}")
    print(json.dumps({"ratios_megarl_over_trl": result["ratios_megarl_over_trl"],
                      "rounds": result["rounds"]["summary"], "mfu": result["mfu"],
                      "reward_vs_wall_clock": result["reward_vs_wall_clock"],
                      "reward_over_seeds": result.get("reward_over_seeds"),
                      "megarl": megarl["summary"], "trl": trl["summary"]}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
