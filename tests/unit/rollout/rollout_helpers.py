"""Tiny random HF models and prompt batches for the rollout tests, plus plain reference decoders."""

from __future__ import annotations

import torch

from megarl.data.padding import left_pad
from megarl.protocol import Batch

VOCAB = 97
PAD = 0


def tiny_qwen2_config(**overrides: object):
    from transformers import Qwen2Config

    # A wide initialisation makes next-token distributions peaked enough for top-k/top-p to matter.
    fields: dict[str, object] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
        initializer_range=0.2, tie_word_embeddings=False, pad_token_id=PAD, eos_token_id=None,
        bos_token_id=None,
    )
    fields.update(overrides)
    return Qwen2Config(**fields)


def tiny_model(seed: int = 0, **overrides: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_qwen2_config(**overrides), dtype=torch.float32).eval()


def prompt_batch(prompts: list[list[int]], uids: list[str] | None = None) -> Batch:
    """Left-padded prompt batch with ids, mask and a uid column."""
    input_ids, attention_mask, _ = left_pad(prompts, PAD)
    uids = uids or [f"prompt-{i}" for i in range(len(prompts))]
    return Batch.from_dict({"input_ids": input_ids, "attention_mask": attention_mask}, non_tensors={"uid": uids})


PROMPTS = [[5, 17, 42, 8], [33, 2], [71, 70, 69, 68, 67, 3]]


@torch.no_grad()
def reference_log_softmax(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """(len(response), V) float64 log_softmax of the logits that predict each response token, from
    one uncached forward over the unpadded prompt + response."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(response)], dim=-1)


@torch.no_grad()
def argmax_decode(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding by repeated full forwards, no cache, no batching."""
    tokens = list(prompt)
    for _ in range(steps):
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
        tokens.append(int(torch.argmax(logits)))
    return tokens[len(prompt):]


def kept_response(batch: Batch, row: int) -> list[int]:
    """Response tokens of one row where response_mask is 1."""
    mask = batch["response_mask"][row].bool()
    return batch["responses"][row][mask].tolist()
