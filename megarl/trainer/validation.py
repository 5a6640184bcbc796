"""Validation: generate for the whole validation set, score, and report per data source.

Metric names follow verl: ``val-core/<data_source>/reward/mean@<n>`` (mean score of all n samples),
``val-core/<data_source>/acc/mean@<n>`` when the scorer reports accuracy, and
``val-core/<data_source>/pass@<n>`` (share of prompts with at least one correct sample) when n > 1;
``val/reward_mean`` is the mean score over every validation sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megarl.protocol import Batch


def _val_batches(trainer: Any) -> list[Batch]:
    dataset = trainer.run.val_dataset
    rows = dataset.get_rows(list(range(len(dataset))))
    batch = dataset.collate(rows, uids=[f"val-{e['row']}" for e in rows])
    size = trainer.cfg.data.val_batch_size or len(batch)
    return batch.split(int(size))


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


def validate(trainer: Any) -> dict[str, float]:
    sampling = trainer.sampling(trainer.global_step, validation=True)
    scores, accs, sources, uids = [], [], [], []
    has_acc = True
    for batch in _val_batches(trainer):
        gen = trainer.generate(batch, sampling)
        result = trainer.run.reward_manager.score_batch(gen, trainer.run.tokenizer)
        scores.append(result.scores.numpy())
        if "acc" in result.reward_info:
            accs.append(np.asarray(result.reward_info["acc"], dtype=np.float64))
        else:
            has_acc = False
        sources.append(np.asarray(gen["data_source"]).astype(str))
        uids.append(np.asarray(gen["uid"]).astype(str))
    return summarise(
        np.concatenate(scores), np.concatenate(accs) if has_acc and accs else None,
        np.concatenate(sources), np.concatenate(uids), int(sampling["n"]),
    )
