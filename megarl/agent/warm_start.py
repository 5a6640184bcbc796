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
