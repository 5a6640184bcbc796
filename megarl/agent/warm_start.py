"""A supervised warm start on tool-use demonstrations (plain PyTorch, CPU minutes for a tiny model).

RL from a random initialisation almost never samples a well-formed tool call, so there is nothing to
reinforce; agent RL recipes start from a model that has seen the call format. `fit_demonstrations`
trains a HF causal LM on whole conversations (prompt, calls, tool outputs, answers) with the loss on
the model's own turns only (tool outputs and prompts are context), and saves it with its tokenizer
as a model directory that `model.path` can name.

`calculator_demonstrations(..., tool_fraction=f)` makes a share `f` of the episodes call the
calculator and the rest answer directly with the (right) number. The command line fits all-calculator
demonstrations first (`--steps`: the call format, copying the expression and the tool's result), then
`--mixed-steps` on demonstrations mixed by `--tool-fraction`, which teach the model to answer
directly on part of its episodes. A tiny model cannot compute a 6-digit sum, so those direct answers
are mostly wrong and RL has to discover that calling the tool pays (`make demo-tools`: 120 steps,
then 30 at 0.3, after which about half of the sampled episodes call the calculator).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from megarl.agent.chat import ToolTurnEncoder
from megarl.data.tasks.arithmetic_tools import call_text
from megarl.data.tokenizer import load_tokenizer


def conversation_ids(tokenizer: Any, prompt: str, turns: Sequence[str], tool_outputs: Sequence[str]) -> tuple[list[int], list[int]]:
    """Token ids of one episode and its loss mask (1 on the model's turns): the prompt rendered
    with the chat template, then model turns alternating with tool-role turns, as the agent loop
    builds them. `turns` has one more entry than `tool_outputs` (the final answer)."""
    encoder = ToolTurnEncoder(tokenizer)
    ids = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True))
    ids = tokenizer.encode("".join(ids), add_special_tokens=False)
    mask = [0] * len(ids)
    for k, turn in enumerate(turns):
        turn_ids = tokenizer.encode(turn, add_special_tokens=False)
        ids, mask = ids + turn_ids, mask + [1] * len(turn_ids)
        if k < len(tool_outputs):
            tool_ids = encoder.encode([tool_outputs[k]])
            ids, mask = ids + tool_ids, mask + [0] * len(tool_ids)
    return ids, mask


Episode = tuple[list[int], list[int]]  # token ids of one conversation, and its loss mask (1 on model turns)


def fit_demonstrations(hf_config: dict[str, Any], tokenizer: Any, episodes: Sequence[Episode],
                       out_dir: str | Path, steps: int = 200, batch_size: int = 16, lr: float = 1e-3,
                       seed: int = 0, then: Sequence[tuple[Sequence[Episode], int]] = ()) -> dict[str, float]:
    """Fit a randomly initialised model of `hf_config` to `episodes` (ids, loss mask) for `steps`
    optimizer steps of `batch_size` episodes drawn with replacement, then to each `(episodes, steps)`
    of `then` in turn (same model and optimizer); save the model and the tokenizer to `out_dir`.
    Returns the mean token loss of the first and the last batch."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy; only this entry point needs it

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**{**hf_config, "vocab_size": len(tokenizer),
                                     "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id})
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    losses: list[float] = []
    for phase, phase_steps in ((episodes, steps), *then):
        if phase_steps > 0 and not phase:
            raise ValueError(f"warm start: {phase_steps} steps asked on an empty set of demonstrations")
        for _ in range(phase_steps):
            chosen = [phase[rng.randrange(len(phase))] for _ in range(batch_size)]
            width = max(len(ids) for ids, _ in chosen)
            ids = torch.full((len(chosen), width), tokenizer.pad_token_id, dtype=torch.long)
            attention = torch.zeros_like(ids)
            labels = torch.full_like(ids, -100)
            for row, (seq, mask) in enumerate(chosen):
                ids[row, :len(seq)] = torch.tensor(seq)
                attention[row, :len(seq)] = 1
                labels[row, :len(seq)] = torch.where(torch.tensor(mask).bool(), torch.tensor(seq), -100)
            loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(float(loss.detach()))
    out = Path(out_dir)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return {"loss_first": losses[0] if losses else float("nan"), "loss_last": losses[-1] if losses else float("nan")}


def calculator_demonstrations(tokenizer: Any, train_parquet: str | Path, limit: int, tool_fraction: float = 1.0,
                              seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Episodes (ids, loss mask) of the first `limit` rows of the `arithmetic_tools` task's
    `train_parquet`, with the right answer. Exactly `round(tool_fraction * rows)` of them, chosen at
    random with `seed`, call the calculator on the prompt's expression and then answer with its
    result; the others answer directly with the number (one turn, no tool)."""
    if not 0.0 <= tool_fraction <= 1.0:
        raise ValueError(f"warm start: tool_fraction must be in [0, 1], got {tool_fraction}")
    rows = pq.read_table(str(train_parquet)).to_pylist()[:limit]
    with_tool = set(random.Random(seed).sample(range(len(rows)), round(tool_fraction * len(rows))))
    episodes = []
    for index, row in enumerate(rows):
        try:
            prompt, answer = row["prompt"][-1]["content"], str(row["reward_model"]["ground_truth"])
        except (KeyError, IndexError, TypeError) as err:
            raise ValueError(f"{train_parquet}: row {index} lacks prompt[-1].content or "
                             f"reward_model.ground_truth ({err!r})") from err
        if index in with_tool:
            episodes.append(conversation_ids(tokenizer, prompt, [call_text(prompt.rstrip("=")),
                                                                 f"{answer}<|im_end|>"], [answer]))
        else:
            episodes.append(conversation_ids(tokenizer, prompt, [f"{answer}<|im_end|>"], []))
    return episodes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Warm-start a tiny Qwen2 model on calculator demonstrations "
                                                 "of the arithmetic_tools task (`megarl data make arithmetic_tools`)")
    parser.add_argument("--data", required=True, help="train.parquet of the task")
    parser.add_argument("--tokenizer", required=True, help="the task's tokenizer directory")
    parser.add_argument("--out", required=True, help="model directory to write (model + tokenizer)")
    parser.add_argument("--steps", type=int, default=120,
                        help="optimizer steps on demonstrations that all call the calculator (the call format, "
                             "copying the expression and the tool's result)")
    parser.add_argument("--demonstrations", type=int, default=1000, help="rows of --data to imitate")
    parser.add_argument("--tool-fraction", type=float, default=1.0,
                        help="share (0..1) of the demonstrations of the --mixed-steps phase that call the "
                             "calculator; the others answer directly with the number, which a tiny model mostly "
                             "gets wrong. Below 1 the model then calls the tool on only part of its episodes and "
                             "RL has to learn that calling it pays")
    parser.add_argument("--mixed-steps", type=int, default=0,
                        help="optimizer steps after --steps on the demonstrations mixed by --tool-fraction")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tool_fraction != 1.0 and args.mixed_steps <= 0:
        raise ValueError(f"warm start: --tool-fraction {args.tool_fraction} applies to the --mixed-steps phase; "
                         "pass --mixed-steps > 0")
    tokenizer = load_tokenizer(args.tokenizer)
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": args.hidden_size,
              "intermediate_size": 2 * args.hidden_size, "num_hidden_layers": args.layers, "num_attention_heads": 2,
              "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False}
    calls = calculator_demonstrations(tokenizer, args.data, args.demonstrations)
    mixed = calculator_demonstrations(tokenizer, args.data, args.demonstrations, tool_fraction=args.tool_fraction,
                                      seed=args.seed)
    start = time.perf_counter()
    fit = fit_demonstrations(config, tokenizer, calls, args.out, steps=args.steps, lr=args.lr, seed=args.seed,
                             then=[(mixed, args.mixed_steps)])
    print(f"warm start: {len(calls)} demonstrations, {args.steps} steps all calling the calculator, then "
          f"{args.mixed_steps} steps with {args.tool_fraction:.0%} calling it, in {time.perf_counter() - start:.1f} s; "
          f"token loss {fit['loss_first']:.3f} -> {fit['loss_last']:.3f}; model -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
