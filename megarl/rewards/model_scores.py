"""Reward-model scores on the driver: the model's inputs, and how they meet the rule scores.

Each row's dataset column `reward_model.style` (verl's layout) says who judges it: "rule" rows go to
the rule scorers, "model" rows to the reward model. `RewardCombine` says how the two make a row's
score (see `RewardModelConfig.combine`). A reward model whose tokenizer differs from the actor's gets
the decoded conversation re-tokenised with its own tokenizer and chat template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from megarl.data.row_check import REWARD_STYLES
from megarl.data.tokenizer import load_tokenizer
from megarl.errors import ConfigError, DataError
from megarl.protocol import Batch
from megarl.rewards.manager import RewardResult, last_valid_positions
from megarl.rewards.model_checkpoint import has_own_tokenizer, hf_files_dir

STYLES = REWARD_STYLES
COMBINES = ("by_style", "weighted_sum")


@dataclass(frozen=True)
class RewardCombine:
    """`by_style`: a "rule" row scores its rule score, a "model" row its model score.
    `weighted_sum`: rule_weight x rule score (rule rows only) + model_weight x model score (every row)."""

    mode: str = "by_style"
    rule_weight: float = 1.0
    model_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in COMBINES:
            raise ConfigError(f"reward_model.combine = {self.mode!r}; valid: {list(COMBINES)}")

    def rule_rows(self, styles: np.ndarray) -> np.ndarray:
        """(B,) bool: rows the rule scorers judge."""
        return styles == "rule"

    def combine(self, rule: torch.Tensor, model: torch.Tensor, styles: np.ndarray) -> torch.Tensor:
        """(B,) final scores from (B,) rule scores (0 where not judged) and (B,) model scores."""
        is_rule = torch.as_tensor(self.rule_rows(styles))
        if self.mode == "by_style":
            return torch.where(is_rule, rule, model)
        return self.rule_weight * torch.where(is_rule, rule, torch.zeros_like(rule)) + self.model_weight * model


def row_styles(batch: Batch, default: str = "rule") -> np.ndarray:
    """(B,) the `reward_style` column ("rule" / "model"), `default` where a row has none."""
    if "reward_style" not in batch.non_tensor_keys:
        return np.array([default] * len(batch), dtype=object)
    styles = np.array([default if s is None else str(s) for s in batch["reward_style"]], dtype=object)
    bad = sorted({s for s in styles if s not in STYLES})
    if bad:
        row = int(np.flatnonzero(np.isin(styles, bad))[0])
        raise DataError(f"reward_model.style = {bad[0]!r} in batch row {row} (data_source "
                        f"{batch['data_source'][row]!r}); valid: {list(STYLES)}")
    return styles


def same_vocabulary(actor_tokenizer: Any, rm_tokenizer: Any) -> bool:
    """Whether token ids mean the same to both tokenizers (the RM can read the actor's ids)."""
    return actor_tokenizer.get_vocab() == rm_tokenizer.get_vocab()


def _conversation(prompt: Any, response: str) -> list[dict[str, str]]:
    messages = list(prompt) if isinstance(prompt, (list, tuple, np.ndarray)) else [{"role": "user", "content": str(prompt)}]
    return [dict(m) for m in messages] + [{"role": "assistant", "content": response}]


def reward_model_inputs(batch: Batch, actor_tokenizer: Any, rm_tokenizer: Optional[Any]) -> Batch:
    """The engine's inputs for scoring `batch`'s responses.

    Without `rm_tokenizer` (same vocabulary): the rollout's own `input_ids`, `attention_mask`,
    `responses`. With it: each prompt (`raw_prompt` messages, else its decoded text) and decoded
    response, through the reward model's chat template when it has one (else plain concatenation),
    as one right-padded sequence per row; `responses` is then (B, 0), the score is read at the
    sequence's last token either way.
    """
    if rm_tokenizer is None:
        return Batch.from_dict({k: batch[k] for k in ("input_ids", "attention_mask", "responses")})
    responses, mask = batch["responses"], batch["response_mask"]
    texts = actor_tokenizer.batch_decode([row[m != 0].tolist() for row, m in zip(responses, mask)],
                                         skip_special_tokens=True)
    prompts: Sequence[Any]
    if "raw_prompt" in batch.non_tensor_keys:
        prompts = list(batch["raw_prompt"])
    else:
        width = batch["prompts"].shape[1]
        prompt_mask = batch["attention_mask"][:, :width]
        prompts = actor_tokenizer.batch_decode([row[m != 0].tolist() for row, m in zip(batch["prompts"], prompt_mask)],
                                               skip_special_tokens=True)
    sequences = []
    for prompt, text in zip(prompts, texts):
        if getattr(rm_tokenizer, "chat_template", None):
            ids = rm_tokenizer.apply_chat_template(_conversation(prompt, text), tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 returns an encoding
        else:
            prompt_text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
            ids = rm_tokenizer(prompt_text + text, add_special_tokens=False)["input_ids"]
        sequences.append(list(ids) or [rm_tokenizer.pad_token_id or 0])
    width = max(len(s) for s in sequences)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    attention = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, ids in enumerate(sequences):
        input_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[i, :len(ids)] = 1
    return Batch.from_dict({"input_ids": input_ids, "attention_mask": attention,
                            "responses": torch.zeros(len(sequences), 0, dtype=torch.long)})


def score_metrics(scores: torch.Tensor) -> dict[str, float]:
    """`reward_model/score/{mean,max,min}` of the (B,) reward-model scores."""
    if scores.numel() == 0:
        return {}
    return {"reward_model/score/mean": float(scores.mean()), "reward_model/score/max": float(scores.max()),
            "reward_model/score/min": float(scores.min())}


def reward_model_tokenizer(model_dir: str, actor_tokenizer: Any) -> Optional[Any]:
    """The reward model's own tokenizer when its ids differ from the actor's; None when the reward
    model reads the actor's token ids (no tokenizer of its own, or the same vocabulary)."""
    if not has_own_tokenizer(model_dir):
        return None
    tokenizer = load_tokenizer(hf_files_dir(model_dir))
    return None if same_vocabulary(actor_tokenizer, tokenizer) else tokenizer


def combine_scores(rule: Optional[RewardResult], rule_rows: np.ndarray, model_scores: torch.Tensor,
                   styles: np.ndarray, combine: RewardCombine, response_mask: torch.Tensor) -> RewardResult:
    """One RewardResult for the whole batch (B rows) from the rule scorers' result on the rows
    `rule_rows` (B,) bool (None when there are none) and the reward model's (B,) scores.

    `reward_info` keeps the rule scorers' keys (`score` is theirs, 0 on rows they did not judge) and
    adds `rm_score`;
    `metrics` adds `reward_model/score/{mean,max,min}`.
    """
    size = len(styles)
    rule_scores = torch.zeros(size, dtype=torch.float32)
    info: dict[str, np.ndarray] = {}
    metrics: dict[str, float] = {}
    rows = np.flatnonzero(rule_rows)
    if rule is not None:
        rule_scores[torch.as_tensor(rows)] = rule.scores
        for key, values in rule.reward_info.items():
            full = np.zeros(size, dtype=np.float64)
            full[rows] = values
            info[key] = full
        metrics.update(rule.metrics)
    model_scores = model_scores.float()
    scores = combine.combine(rule_scores, model_scores, styles)
    info["rm_score"] = model_scores.double().numpy()
    last = last_valid_positions(response_mask)
    token_level = torch.zeros(response_mask.shape, dtype=torch.float32)
    has_tokens = torch.nonzero(last >= 0).flatten()
    token_level[has_tokens, last[has_tokens]] = scores[has_tokens]
    metrics.update(score_metrics(model_scores))
    metrics["reward/score_mean"] = float(scores.mean()) if size else 0.0
    return RewardResult(token_level, scores, info, metrics)
