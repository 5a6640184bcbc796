"""Fit a small reward model on preference pairs of the arithmetic task (the `make demo-rm` example).

From the prompts of a parquet file written by `megarl data make arithmetic`, each pair is the same
prompt with a *chosen* response that starts with the right answer and a *rejected* one that starts
with a wrong number, both followed by a few random characters of the task's alphabet (and, half of
the time, the end-of-sequence token), the kinds of completions a policy samples. The model is a tiny
Qwen2 sequence-classification model over the task's own tokenizer, trained with the Bradley-Terry
loss -log sigmoid(r_chosen - r_rejected) in plain PyTorch, and saved as a HF checkpoint with the
tokenizer, so that `reward_model.model_path` (and `critic.model_path`) can point at it.

    python -m megarl.rewards.fit_preference_model --data data/arithmetic/train.parquet \
        --tokenizer data/arithmetic/tokenizer --out data/arithmetic/reward_model
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import pyarrow.parquet as pq
import torch
import transformers

from megarl.data.tokenizer import load_tokenizer


def _prompts_and_answers(path: str) -> list[tuple[str, str]]:
    table = pq.read_table(path, columns=["prompt", "reward_model"]).to_pylist()
    return [(row["prompt"][0]["content"], str(row["reward_model"]["ground_truth"])) for row in table]


def make_pairs(examples: list[tuple[str, str]], alphabet: str, n: int, seed: int) -> list[tuple[str, str, str, bool]]:
    """`n` (prompt, chosen, rejected, with_eos) tuples; chosen starts with the answer, rejected does not."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(n):
        prompt, answer = rng.choice(examples)
        wrong = answer
        while wrong == answer or answer.startswith(wrong) or wrong.startswith(answer):
            wrong = str(rng.randint(0, max(9, 2 * int(answer) + 2)))

        def tail() -> str:
            return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 2)))

        pairs.append((prompt, answer + tail(), wrong + tail(), rng.random() < 0.5))
    return pairs


def _encode(tokenizer, pairs, which: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = []
    for pair in pairs:
        ids = tokenizer(pair[0] + pair[which], add_special_tokens=False)["input_ids"]
        rows.append(ids + ([tokenizer.eos_token_id] if pair[3] else []))
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    return ids, mask


def fit(data: str, tokenizer_dir: str, out: str, steps: int = 300, batch: int = 64, lr: float = 2e-3,
        seed: int = 0) -> float:
    """Train and save the reward model; returns its accuracy (chosen scored above rejected) on
    held-out pairs."""
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(tokenizer_dir)
    examples = _prompts_and_answers(data)
    alphabet = "".join(sorted({c for p, a in examples for c in p + a}))
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False, num_labels=1,
                                      pad_token_id=tokenizer.pad_token_id, rms_norm_eps=1e-6)
    model = transformers.Qwen2ForSequenceClassification(config)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    train = make_pairs(examples, alphabet, steps * batch, seed)
    held_out = make_pairs(examples, alphabet, 512, seed + 1)
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        chunk = train[step * batch:(step + 1) * batch]
        chosen, chosen_mask = _encode(tokenizer, chunk, 1)
        rejected, rejected_mask = _encode(tokenizer, chunk, 2)
        margin = (model(input_ids=chosen, attention_mask=chosen_mask).logits[:, 0]
                  - model(input_ids=rejected, attention_mask=rejected_mask).logits[:, 0])
        loss = -torch.nn.functional.logsigmoid(margin).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    model.eval()
    with torch.no_grad():
        chosen, chosen_mask = _encode(tokenizer, held_out, 1)
        rejected, rejected_mask = _encode(tokenizer, held_out, 2)
        accuracy = float((model(input_ids=chosen, attention_mask=chosen_mask).logits
                          > model(input_ids=rejected, attention_mask=rejected_mask).logits).float().mean())
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    print(f"reward model: {out}, held-out pair accuracy {accuracy:.3f}, {time.perf_counter() - start:.1f} s")
    return accuracy


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.rewards.fit_preference_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="parquet file of `megarl data make arithmetic`")
    parser.add_argument("--tokenizer", required=True, help="the task's tokenizer directory")
    parser.add_argument("--out", required=True, help="output HF model directory")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    fit(args.data, args.tokenizer, args.out, steps=args.steps, seed=args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
