"""End to end, side by side: megarl GRPO and TRL's GRPOTrainer on the same task, model and budget.

Same for both: the single-digit addition task and its character tokenizer; the random-init Qwen2
(megarl writes it to `<run>/initial_model/`, TRL loads that directory); the prompts of every step
(megarl's data-loader order, handed to TRL unshuffled); 8 prompts x 8 responses a step, up to 4
response tokens, temperature 1.0; lr 1e-4 constant; no KL (beta 0); token-mean loss; fp32; two
CPU cores (megarl: 2 worker processes x 1 thread, TP=2; TRL: 1 process x 2 threads).

    python benchmarks/e2e.py [--steps 120] [--quick] [--out benchmarks/results/sections/e2e.json]

Step 1 is left out of the time averages. Generated tokens/s and training tokens/s are per step
wall time (response tokens, and prompt + response tokens, over the step's seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO_ROOT, RESULTS_DIR, PeakMemorySampler, load_average, machine_info, mean, ratio, write_json  # noqa: E402
from megarl_run import base_overrides, prepare_task, run_megarl  # noqa: E402

BENCH_PYTHON = REPO_ROOT / ".venv-bench" / "bin" / "python"
PROMPTS, N, RESPONSE_LENGTH, LR, THREADS = 8, 8, 4, 1e-4, 2
# TRL also runs with 1 thread: a 2-thread OpenMP process slows down badly when the machine's
# cores are oversubscribed (threads wait for each other at every parallel region), while
# megarl's 1-thread workers do not; the 1-thread figure shows how much of a gap is that effect.
TRL_THREAD_VARIANTS = (1,)


def megarl_prompt_order(run_dir: Path, steps: int) -> list[dict[str, str]]:
    """The prompts megarl's loader served in its first `steps` batches (same config, same seed)."""
    from omegaconf import OmegaConf

    from megarl.trainer.setup import build_datasets, load_run_tokenizer

    cfg = OmegaConf.load(run_dir / "config.yaml")
    tokenizer = load_run_tokenizer(cfg)
    loader, _ = build_datasets(cfg, tokenizer)
    rows = []
    for _ in range(steps):
        batch = loader.next_batch()
        for raw, truth in zip(batch["raw_prompt"], batch["ground_truth"]):
            rows.append({"prompt": loader.dataset.renderer.text(raw), "ground_truth": str(truth)})
    return rows


def run_trl(python: Path, model_dir: Path, tokenizer: Path, prompts_file: Path, steps: int,
            work_dir: Path, timeout_s: float, threads: int = THREADS) -> dict[str, Any]:
    """Run benchmarks/trl_grpo.py in the benchmark environment, sampling its memory."""
    out = work_dir / f"e2e_trl_t{threads}.json"
    cmd = [str(python), str(REPO_ROOT / "benchmarks" / "trl_grpo.py"), "--model-dir", str(model_dir),
           "--tokenizer", str(tokenizer), "--prompts", str(prompts_file), "--steps", str(steps),
           "--prompts-per-step", str(PROMPTS), "--num-generations", str(N),
           "--max-completion-length", str(RESPONSE_LENGTH), "--lr", str(LR), "--threads", str(threads),
           "--work-dir", str(work_dir / "e2e_trl_output"), "--out", str(out)]
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
        "generated_tokens_per_s": ratio(m["generated_tokens_per_s"], t["generated_tokens_per_s"]),
        "training_tokens_per_s": ratio(m["training_tokens_per_s"], t["training_tokens_per_s"]),
        "peak_memory_workload": ratio(megarl["memory"]["workload_mib"], trl["memory"]["workload_mib"]),
        "reward_last_window": ratio(m["reward_last_window_mean"], t["reward_last_window_mean"]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120, help="the quickstart's length")
    p.add_argument("--quick", action="store_true", help="3 steps: a smoke test of both sides")
    p.add_argument("--work-dir", type=Path, default=None, help="runs and data (default: a temporary folder)")
    p.add_argument("--bench-python", type=Path, default=BENCH_PYTHON, help="python of the TRL environment")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per side")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "sections" / "e2e.json")
    args = p.parse_args(argv)
    steps = 3 if args.quick else args.steps
    if not args.bench_python.is_file():
        raise SystemExit(f"{args.bench_python} not found: run benchmarks/make_bench_env.sh first (TRL lives there)")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="megarl-bench-e2e-"))
    task = prepare_task(work)
    run_dir = work / "e2e_megarl"

    megarl = run_megarl(run_dir, base_overrides(task, run_dir, steps), prompts=PROMPTS, n=N, timeout_s=args.timeout)
    prompts_file = work / "e2e_prompts.json"
    prompts_file.write_text(json.dumps(megarl_prompt_order(run_dir, steps)))
    trl = run_trl(args.bench_python, run_dir / "initial_model", task["tokenizer"], prompts_file, steps, work, args.timeout)
    variants = {}
    for threads in TRL_THREAD_VARIANTS:
        try:
            variants[f"threads={threads}"] = run_trl(args.bench_python, run_dir / "initial_model", task["tokenizer"],
                                                     prompts_file, steps, work, args.timeout, threads=threads)
        except RuntimeError as err:  # a variant is extra information, not the comparison itself
            variants[f"threads={threads}"] = {"error": str(err)[-2000:]}

    result = {
        "section": "e2e",
        "machine": machine_info(),
        "setup": {
            "task": "single-digit addition (a+b=), reward 1 when the completion starts with the sum",
            "model": "random-init Qwen2, 4 layers, hidden 256, head_dim 64, character vocabulary (same weights both sides)",
            "prompts_per_step": PROMPTS, "responses_per_prompt": N, "max_response_tokens": RESPONSE_LENGTH,
            "steps": steps, "lr": LR, "precision": "fp32", "kl": "none (beta 0)", "loss": "token-mean",
            "megarl": "2 Ray workers x 1 thread, Megatron TP=2 on gloo, HF rollout engine, separate old-log-prob pass",
            "trl": f"1 process x {THREADS} threads, model.generate rollout, on-policy (no old-log-prob pass)",
            "trl_variants": f"TRL again with {', '.join(map(str, TRL_THREAD_VARIANTS))} thread(s): 2-thread OpenMP "
                            "slows down sharply on an oversubscribed machine, 1-thread processes do not",
            "averages": "steps 2..N (step 1 is warm-up); tokens/s over step wall time",
            "memory": "peak of summed RSS of the process tree, sampled every 0.1 s (workload = without Ray daemons)",
        },
        "megarl": megarl,
        "trl": trl,
        "ratios_megarl_over_trl": compare(megarl, trl),
        "trl_variants": variants,
        "ratios_megarl_over_trl_variants": {k: compare(megarl, v) for k, v in variants.items() if "summary" in v},
        "load_average_end": load_average(),
    }
    write_json(args.out, result)
    print(json.dumps({"ratios_megarl_over_trl": result["ratios_megarl_over_trl"],
                      "megarl": megarl["summary"], "trl": trl["summary"]}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
