"""Validation: generate for the whole validation set, score, and report per data source.

Metric names follow verl's: ``<section>/<data_source>/<variable>/<metric>``, where the variables are
``reward`` (a sample's score) and every numeric ``reward_info`` key the scorer reports (``acc``, ...),
and the metrics, over the n samples of each prompt, averaged over the prompts:
``mean@<n>``; with n > 1 also ``std@<n>`` (the samples' spread), ``best@<n>/mean`` and
``worst@<n>/mean`` (the best and worst of the n: for ``acc``, the share of prompts solved at least
once, pass@n; computed exactly, where verl estimates them by bootstrap). The core variable is ``acc``
when the scorer reports it, else ``reward``: its ``mean@<n>`` and ``best@<n>/mean`` are in section
``val-core``, everything else in ``val-aux``. ``val/reward_mean`` is the mean score over every sample.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from megarl.protocol import Batch
from megarl.rewards.manager import with_common_reward_info


def validation_batches(dataset: Any, batch_size: int | None) -> list[Batch]:
    """The whole validation set as prompt batches of `batch_size` (None: one batch)."""
    rows = dataset.get_rows(list(range(len(dataset))))
    batch = dataset.collate(rows, uids=[f"val-{e['row']}" for e in rows])
    return batch.split(int(batch_size or len(batch)))


def summarise(scores: np.ndarray, extras: Mapping[str, np.ndarray], sources: np.ndarray, uids: np.ndarray,
              n: int) -> dict[str, float]:
    """The validation metrics (see the module docstring) from per-sample arrays, all (N,): `scores`,
    `extras` (numeric ``reward_info`` values by key), `sources` (data source), `uids` (the prompt)."""
    metrics: dict[str, float] = {"val/reward_mean": float(scores.mean()) if len(scores) else 0.0}
    variables = {"reward": scores, **{key: values for key, values in extras.items() if key != "reward"}}
    core = "acc" if "acc" in variables else "reward"
    for source in sorted(set(sources.tolist())):
        sel = sources == source
        prompts: dict[str, list[int]] = {}
        for i in np.flatnonzero(sel).tolist():
            prompts.setdefault(str(uids[i]), []).append(i)
        for var, values in variables.items():
            per_prompt = [values[rows] for rows in prompts.values()]
            found = {f"mean@{n}": float(values[sel].mean())}
            if n > 1:
                found[f"std@{n}"] = float(np.mean([v.std() for v in per_prompt]))
                found[f"best@{n}/mean"] = float(np.mean([v.max() for v in per_prompt]))
                found[f"worst@{n}/mean"] = float(np.mean([v.min() for v in per_prompt]))
            for metric, value in found.items():
                section = "val-core" if var == core and metric in (f"mean@{n}", f"best@{n}/mean") else "val-aux"
                metrics[f"{section}/{source}/{var}/{metric}"] = value
    return metrics


def numeric_reward_info(scored: Sequence[Batch]) -> dict[str, np.ndarray]:
    """The ``reward_info/<key>`` columns of the scored batches whose values are all numbers, as float64
    arrays by key (0.0 in a batch scored before the key was first returned: `with_common_reward_info`;
    text a scorer reports, e.g. an extracted answer, is left out)."""
    scored = with_common_reward_info(scored)
    keys = [k for k in scored[0].non_tensor_keys if k.startswith("reward_info/")] if scored else []
    out = {}
    for key in sorted(keys):
        try:
            out[key[len("reward_info/"):]] = np.concatenate(
                [np.asarray(gen[key], dtype=np.float64).reshape(-1) for gen in scored])
        except (TypeError, ValueError):
            continue
    return out


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
    scores = np.concatenate([gen["token_level_scores"].sum(-1).double().numpy() for gen in scored])
    sources = np.concatenate([np.asarray(gen["data_source"]).astype(str) for gen in scored])
    uids = np.concatenate([np.asarray(gen["uid"]).astype(str) for gen in scored])
    return summarise(scores, numeric_reward_info(scored), sources, uids, n), scored
