"""TRL's GRPOTrainer on the quickstart task: the peer side of the end-to-end benchmark.

Runs in the benchmark environment (`benchmarks/make_bench_env.sh`: megarl + TRL), so the prompts,
the character tokenizer and the reward scorer are megarl's own code. It trains the model found in
`--model-dir` (the megarl run's `initial_model/`, so both systems start from the same weights) on
the prompts of `--prompts` in the given order (megarl's data loader order, written by the e2e
section), `--prompts-per-step` prompts x `--num-generations` completions per step.

Setup (TRL's documented single-process CPU path): fp32, `torch.set_num_threads(--threads)`, no
vLLM, beta = 0 (no reference model), one optimizer step per generation batch (fully on-policy, so
TRL reuses the current log-probs as the old ones instead of a second forward pass), token-mean
loss ("dapo" in TRL's terms), per-group std scaling, clip epsilon 0.2, AdamW with the constant
learning rate, weight decay 0, gradient clipping 1.0, temperature 1.0, no gradient checkpointing
(TRL's default turns it on; megarl's compared runs do not recompute, so neither side does). With `--full-length` every
completion has `--max-completion-length` tokens (transformers' `min_new_tokens`), to compare with
megarl's `rollout.ignore_eos` at equal lengths.

Writes JSON to `--out`: per step the wall time (callback from step begin to step end), the time in
generation + scoring, prompt and completion tokens, and the mean reward. The reward is megarl's
built-in arithmetic scorer with `--reward-options`, the scorer options of the megarl run it is
compared with (its `reward.reward_kwargs`): without them the scorer's default rule applies.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", required=True, help="HF model directory (megarl's initial_model/)")
    p.add_argument("--tokenizer", required=True, help="the task's HF tokenizer directory")
    p.add_argument("--prompts", required=True, help='JSON list of {"prompt", "ground_truth"} in step order')
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-completion-length", type=int, default=4)
    p.add_argument("--full-length", action="store_true",
                   help="every completion runs to --max-completion-length (EOS suppressed until then)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--reward-options", default="{}",
                   help='JSON {scorer: {option: value}}: the megarl run\'s reward.reward_kwargs, so that both sides '
                        'score with the same rule (e.g. {"arithmetic": {"mode": "startswith"}})')
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bf16", action="store_true",
                   help="mixed precision (GRPOConfig bf16=True: bf16 autocast, fp32 weights and optimizer)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute activations in the backward pass (TRL's default; off here, as megarl's runs)")
    p.add_argument("--work-dir", required=True, help="TRL's output_dir (nothing is saved there)")
    p.add_argument("--out", required=True, help="JSON results path")
    return p.parse_args(argv)


def grpo_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """GRPOConfig's arguments for this run (built without importing TRL)."""
    return dict(
        output_dir=args.work_dir,
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        gradient_accumulation_steps=1,
        num_generations=args.num_generations,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        shuffle_dataset=False,
        max_steps=args.steps,
        seed=args.seed,
        use_cpu=True,
        bf16=args.bf16,
        # TRL's default (True in the TRL version pinned here) recomputes each layer's activations in the backward pass:
        # about a third more work in the update. megarl does not recompute unless
        # model.enable_gradient_checkpointing is set (off in the configs compared), so neither side does.
        gradient_checkpointing=args.gradient_checkpointing,
        fp16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": args.max_completion_length} if args.full_length else None,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(args.threads)
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megarl.data.tokenizer import load_tokenizer
    from megarl.rewards.scorers import score_builtin

    rows = json.loads(Path(args.prompts).read_text())
    needed = args.steps * args.prompts_per_step
    if len(rows) < needed:
        raise SystemExit(f"{args.prompts}: {len(rows)} prompts, need {needed} for {args.steps} steps")
    dataset = datasets.Dataset.from_list(rows[:needed])
    reward_options = json.loads(args.reward_options)

    step_rewards: list[float] = []

    def arithmetic_reward(prompts: list[str], completions: list[str], ground_truth: list[str], **_: Any) -> list[float]:
        scores = [score_builtin("arithmetic", c, gt, options=reward_options)["score"]
                  for c, gt in zip(completions, ground_truth)]
        step_rewards.append(sum(scores) / len(scores))
        return scores

    gen_seconds: list[float] = []
    prompt_tokens: list[int] = []
    completion_tokens: list[int] = []

    class TimedGRPOTrainer(GRPOTrainer):
        """Times generation + scoring and counts the tokens of each generation batch."""

        def _generate_and_score_completions(self, inputs: Any) -> Any:
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            gen_seconds.append(time.perf_counter() - start)
            prompt_tokens.append(int(out["prompt_mask"].sum()))
            completion_tokens.append(int(out["completion_mask"].sum()))
            return out

    step_seconds: list[float] = []
    step_ends: list[float] = []  # perf_counter at each step's end: wall clock between steps
    logged_step_time: list[float] = []  # TRL's own "step_time" log entry, as a cross-check

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self._start = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            step_ends.append(time.perf_counter())
            step_seconds.append(step_ends[-1] - self._start)

        def on_log(self, *_: Any, logs: dict[str, Any] | None = None, **__: Any) -> None:
            if logs and "step_time" in logs:
                logged_step_time.append(float(logs["step_time"]))

    config = GRPOConfig(**grpo_config_kwargs(args))
    tokenizer = load_tokenizer(args.tokenizer)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=arithmetic_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimer()],
    )
    start = time.perf_counter()
    trainer.train()
    train_wall = time.perf_counter() - start

    records = []
    for i, seconds in enumerate(step_seconds):
        records.append({
            "step": i + 1,
            "step_s": seconds,
            "wall_s": step_ends[i] - step_ends[i - 1] if i else None,  # from the previous step's end
            "gen_and_score_s": gen_seconds[i] if i < len(gen_seconds) else None,
            "prompt_tokens": prompt_tokens[i] if i < len(prompt_tokens) else None,
            "response_tokens": completion_tokens[i] if i < len(completion_tokens) else None,
            "score_mean": step_rewards[i] if i < len(step_rewards) else None,
            "trl_logged_step_time_s": logged_step_time[i] if i < len(logged_step_time) else None,
        })
    payload = {
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "torch_threads": torch.get_num_threads(),
        "train_wall_s": train_wall,
        "config": {k: getattr(config, k) for k in (
            "per_device_train_batch_size", "num_generations", "max_completion_length", "temperature",
            "learning_rate", "lr_scheduler_type", "beta", "epsilon", "loss_type", "scale_rewards",
            "num_iterations", "steps_per_generation", "max_grad_norm", "weight_decay", "bf16", "use_cpu",
            "gradient_checkpointing")},
        "reward_options": reward_options,
        "records": records,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
