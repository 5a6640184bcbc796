"""A supervised warm start on tool-use demonstrations (plain PyTorch, CPU minutes for a tiny model).

RL from a random initialisation almost never samples a well-formed tool call, so there is nothing to
reinforce; agent RL recipes start from a model that has seen the call format. `fit_demonstrations`
trains a HF causal LM on whole conversations (prompt, calls, tool outputs, answers) with the loss on
the model's own turns only (tool outputs and prompts are context), and saves it with its tokenizer
as a model directory that `model.path` can name.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megarl.agent.chat import ToolTurnEncoder


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


def fit_demonstrations(hf_config: dict[str, Any], tokenizer: Any, episodes: Sequence[tuple[list[int], list[int]]],
                       out_dir: str | Path, steps: int = 200, batch_size: int = 16, lr: float = 1e-3,
                       seed: int = 0) -> dict[str, float]:
    """Fit a randomly initialised model of `hf_config` to `episodes` (ids, loss mask); save it and
    the tokenizer to `out_dir`. Returns the first and last batch's mean token loss."""
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy; only this entry point needs it

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**{**hf_config, "vocab_size": len(tokenizer),
                                     "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id})
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    losses: list[float] = []
    for _ in range(steps):
        chosen = [episodes[rng.randrange(len(episodes))] for _ in range(batch_size)]
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
    return {"loss_first": losses[0], "loss_last": losses[-1]}


def calculator_demonstrations(tokenizer: Any, train_parquet: str | Path, limit: int) -> list[tuple[list[int], list[int]]]:
    """Episodes of the `arithmetic_tools` task's rows done right: call the calculator on the prompt's
    expression, then answer with its result."""
    import pyarrow.parquet as pq

    from megarl.data.tasks.arithmetic_tools import call_text

    rows = pq.read_table(str(train_parquet)).to_pylist()[:limit]
    episodes = []
    for row in rows:
        prompt, answer = row["prompt"][-1]["content"], str(row["reward_model"]["ground_truth"])
        episodes.append(conversation_ids(tokenizer, prompt, [call_text(prompt.rstrip("=")), f"{answer}<|im_end|>"],
                                         [answer]))
    return episodes


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from megarl.data.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(description="Warm-start a tiny Qwen2 model on calculator demonstrations "
                                                 "of the arithmetic_tools task (`megarl data make arithmetic_tools`)")
    parser.add_argument("--data", required=True, help="train.parquet of the task")
    parser.add_argument("--tokenizer", required=True, help="the task's tokenizer directory")
    parser.add_argument("--out", required=True, help="model directory to write (model + tokenizer)")
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps (few: the RL run does the rest)")
    parser.add_argument("--demonstrations", type=int, default=1000, help="rows of --data to imitate")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": args.hidden_size,
              "intermediate_size": 2 * args.hidden_size, "num_hidden_layers": args.layers, "num_attention_heads": 2,
              "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False}
    episodes = calculator_demonstrations(tokenizer, args.data, args.demonstrations)
    fit = fit_demonstrations(config, tokenizer, episodes, args.out, steps=args.steps, lr=args.lr, seed=args.seed)
    print(f"warm start: {len(episodes)} demonstrations, {args.steps} steps, token loss "
          f"{fit['loss_first']:.3f} -> {fit['loss_last']:.3f}; model -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
