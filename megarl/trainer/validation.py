"""Validation: generate for the whole validation set, score, and report per data source.

Metric names follow verl: ``val-core/<data_source>/reward/mean@<n>`` (mean score of all n samples),
``val-core/<data_source>/acc/mean@<n>`` when the scorer reports accuracy, and
``val-core/<data_source>/pass@<n>`` (share of prompts with at least one correct sample) when n > 1;
``val/reward_mean`` is the mean score over every validation sample.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from megarl.protocol import Batch


def validation_batches(dataset: Any, batch_size: int | None) -> list[Batch]:
    """The whole validation set as prompt batches of `batch_size` (None: one batch)."""
    rows = dataset.get_rows(list(range(len(dataset))))
    batch = dataset.collate(rows, uids=[f"val-{e['row']}" for e in rows])
    return batch.split(int(batch_size or len(batch)))


def summarise(scores: np.ndarray, acc: np.ndarray | None, sources: np.ndarray, uids: np.ndarray, n: int) -> dict[str, float]:
    """Per-data-source means and pass@n from per-sample arrays (all (N,))."""
    metrics: dict[str, float] = {"val/reward_mean": float(scores.mean()) if len(scores) else 0.0}
    correct = acc if acc is not None else scores
    for source in sorted(set(sources.tolist())):
        sel = sources == source
        metrics[f"val-core/{source}/reward/mean@{n}"] = float(scores[sel].mean())
        if acc is not None:
            metrics[f"val-core/{source}/acc/mean@{n}"] = float(acc[sel].mean())
        if n > 1:
            solved = {}
            for uid, ok in zip(uids[sel].tolist(), (correct[sel] > 0).tolist()):
                solved[uid] = solved.get(uid, False) or ok
            metrics[f"val-core/{source}/pass@{n}"] = float(np.mean(list(solved.values())))
    return metrics


def validate(batches: Sequence[Batch], generate: Callable[[Batch, int], Batch],
             score: Callable[[Batch], Batch], n: int) -> tuple[dict[str, float], list[Batch]]:
    """Generate for every prompt batch and score the responses.

    `generate(prompts, first) -> responses` (n per prompt; `first`: the index of the batch's first
    prompt in the validation set, so that sampled validation rows take random streams of their own,
    `SamplingParams.row_offset`); `score(responses) -> responses` with `token_level_scores` and
    `reward_info/<key>` columns added. Returns the metrics and the scored batches.
    """
    firsts = np.cumsum([0] + [len(batch) for batch in batches[:-1]]).tolist()
    scored = [score(generate(batch, int(first))) for batch, first in zip(batches, firsts)]
    has_acc = all("reward_info/acc" in gen for gen in scored)
    scores = np.concatenate([gen["token_level_scores"].sum(-1).numpy() for gen in scored])
    acc = np.concatenate([np.asarray(gen["reward_info/acc"], dtype=np.float64) for gen in scored]) if has_acc else None
    sources = np.concatenate([np.asarray(gen["data_source"]).astype(str) for gen in scored])
    uids = np.concatenate([np.asarray(gen["uid"]).astype(str) for gen in scored])
    return summarise(scores, acc, sources, uids, n), scored
