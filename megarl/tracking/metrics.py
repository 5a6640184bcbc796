"""Standard per-step metrics with the names verl users know, computed from a batch of tensors.

Pure functions on CPU tensors; no logging, no torch.distributed. Statistics are taken over the
tokens (or sequences) that count: token-level tensors are restricted to ``response_mask``.

Names produced (each only when its inputs are present in the batch):
- ``critic/score/{mean,max,min}``: sequence score = sum over the response of ``token_level_scores``.
- ``critic/rewards/{mean,max,min}``: sequence reward = sum of ``token_level_rewards`` (after KL-in-reward).
- ``critic/advantages/*``, ``critic/returns/*``, ``critic/values/*``: over response tokens.
- ``critic/vf_explained_var``: ``1 - var(returns - values) / (var(returns) + 1e-5)`` over response
  tokens, unbiased variances (when ``values`` is present).
- ``response_length/{mean,max,min,clip_ratio}``: tokens per response; clip_ratio is the fraction of
  responses whose length equals the maximum response length (they were cut off).
- ``prompt_length/{mean,max,min,clip_ratio}``: from ``prompt_mask`` (B,P) or the first P columns of
  ``attention_mask`` (B,P+R).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import torch

SELF_TIME_PREFIX = "timing_self_s/"  # a phase's seconds without the phases nested in it
VF_EXPLAINED_VAR_EPS = 1e-5  # verl's epsilon in the explained-variance denominator

_SEQUENCE_SUMS = (("token_level_scores", "critic/score"), ("token_level_rewards", "critic/rewards"))
_TOKEN_STATS = (("advantages", "critic/advantages"), ("returns", "critic/returns"), ("values", "critic/values"))


def _keys(batch: Any) -> set[str]:
    return set(batch.keys())


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """mean/max/min of a 1-D tensor, accumulated in float64; NaN for an empty tensor."""
    if values.numel() == 0:
        return {f"{prefix}/mean": math.nan, f"{prefix}/max": math.nan, f"{prefix}/min": math.nan}
    v = values.detach().to(torch.float64)
    return {f"{prefix}/mean": float(v.mean()), f"{prefix}/max": float(v.max()), f"{prefix}/min": float(v.min())}


def _unbiased_var(values: torch.Tensor) -> float:
    if values.numel() < 2:
        return math.nan
    return float(values.to(torch.float64).var(unbiased=True))


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(
            f"compute_data_metrics: batch['{name}'] has shape {tuple(tensor.shape)}, expected {expected} "
            "(B responses x R response tokens, aligned with 'response_mask')"
        )


def compute_data_metrics(
    batch: Any,
    max_response_length: Optional[int] = None,
    max_prompt_length: Optional[int] = None,
) -> dict[str, float]:
    """Data metrics of one training batch.

    Args:
        batch: mapping-like (dict, ``Batch``) with ``response_mask`` (B,R) and any of
            ``token_level_scores``, ``token_level_rewards``, ``advantages``, ``returns``, ``values``
            (all (B,R)); for prompt lengths ``prompt_mask`` (B,P) or ``attention_mask`` (B,P+R).
        max_response_length: the length a response is cut at; defaults to R.
        max_prompt_length: the longest prompt allowed; defaults to P.

    Returns:
        ``{name: float}``; lengths are in tokens. Empty selections give NaN.
    """
    keys = _keys(batch)
    if "response_mask" not in keys:
        raise KeyError(f"compute_data_metrics: the batch has no 'response_mask' (B,R); keys: {sorted(keys)}")
    response_mask = batch["response_mask"].bool()
    if response_mask.dim() != 2:
        raise ValueError(f"compute_data_metrics: 'response_mask' must be (B,R), got shape {tuple(response_mask.shape)}")
    num_seqs, resp_len = response_mask.shape
    metrics: dict[str, float] = {}

    for key, prefix in _SEQUENCE_SUMS:
        if key in keys:
            t = batch[key]
            _check_shape(key, t, (num_seqs, resp_len))
            # Scores are placed on response tokens only; the mask guards against stray values in padding.
            metrics.update(_stats(prefix, torch.where(response_mask, t.to(torch.float64), 0.0).sum(-1)))

    token_values: dict[str, torch.Tensor] = {}
    for key, prefix in _TOKEN_STATS:
        if key in keys:
            t = batch[key]
            _check_shape(key, t, (num_seqs, resp_len))
            token_values[key] = torch.masked_select(t.to(torch.float64), response_mask)
            metrics.update(_stats(prefix, token_values[key]))
    if "values" in token_values and "returns" in token_values:
        returns = token_values["returns"]
        diff_var = _unbiased_var(returns - token_values["values"])
        metrics["critic/vf_explained_var"] = 1.0 - diff_var / (_unbiased_var(returns) + VF_EXPLAINED_VAR_EPS)

    attention: Optional[torch.Tensor] = None
    if "attention_mask" in keys:
        attention = batch["attention_mask"]
        if attention.dim() != 2 or attention.shape[0] != num_seqs or attention.shape[1] < resp_len:
            raise ValueError(
                f"compute_data_metrics: 'attention_mask' has shape {tuple(attention.shape)}, expected "
                f"({num_seqs}, P+{resp_len}) covering prompt and response"
            )
    # A response's tokens: those of the attention mask (in a multi-turn rollout the tool outputs too,
    # which response_mask leaves out and rollout.response_length counts), else of response_mask.
    response_tokens = response_mask if attention is None else attention[:, attention.shape[1] - resp_len:].bool()
    response_length = response_tokens.sum(-1).to(torch.float64)
    limit = resp_len if max_response_length is None else max_response_length
    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = float((response_length == limit).to(torch.float64).mean())

    prompt_mask: Optional[torch.Tensor] = None
    if "prompt_mask" in keys:
        prompt_mask = batch["prompt_mask"].bool()
    elif attention is not None:
        prompt_mask = attention[:, : attention.shape[1] - resp_len].bool()
    if prompt_mask is not None:
        prompt_length = prompt_mask.sum(-1).to(torch.float64)
        p_limit = prompt_mask.shape[1] if max_prompt_length is None else max_prompt_length
        metrics.update(_stats("prompt_length", prompt_length))
        metrics["prompt_length/clip_ratio"] = float((prompt_length == p_limit).to(torch.float64).mean())
    return metrics


def compute_timing_metrics(
    timings: Mapping[str, float],
    num_tokens: int,
    num_response_tokens: Optional[int] = None,
    inner: Optional[Mapping[str, float]] = None,
) -> dict[str, float]:
    """``timing_s/<phase>`` (seconds) and ``timing_per_token_ms/<phase>`` for each phase.

    ``inner``: per phase, seconds of the phases nested in it (`Timer.inner`); a phase that had any
    (other than ``step``, the total) also gets ``timing_self_s/<phase>``, its time without them, which
    the report's phase table and timing plot use so that nested time is not counted twice.

    Per-token time divides by ``num_tokens`` (prompt + response tokens of the batch), except for
    the generation phase ``gen``, which divides by ``num_response_tokens`` when given (as verl does:
    generation cost scales with generated tokens). Phases with zero tokens get no per-token entry.
    """
    metrics: dict[str, float] = {}
    for phase, seconds in timings.items():
        metrics[f"timing_s/{phase}"] = float(seconds)
        tokens = num_response_tokens if (phase == "gen" and num_response_tokens is not None) else num_tokens
        if tokens > 0:
            metrics[f"timing_per_token_ms/{phase}"] = float(seconds) * 1000.0 / tokens
    for phase, nested in (inner or {}).items():
        if phase != "step" and phase in timings and nested > 0:
            metrics[f"{SELF_TIME_PREFIX}{phase}"] = max(0.0, float(timings[phase]) - float(nested))
    return metrics


def compute_throughput(total_tokens: int, step_time: float, n_devices: int) -> dict[str, float]:
    """Throughput of one step: ``perf/throughput`` in tokens per second per device.

    Args:
        total_tokens: prompt + response tokens processed in the step (non-padding).
        step_time: wall time of the whole step in seconds (> 0).
        n_devices: devices (GPUs, or CPU worker processes) the step ran on (>= 1).
    """
    if step_time <= 0:
        raise ValueError(f"compute_throughput: step_time must be > 0 seconds, got {step_time}")
    if n_devices < 1:
        raise ValueError(f"compute_throughput: n_devices must be >= 1, got {n_devices}")
    return {
        "perf/total_num_tokens": float(total_tokens),
        "perf/time_per_step": float(step_time),
        "perf/throughput": float(total_tokens) / (float(step_time) * n_devices),
    }


def count_tokens(batch: Any) -> tuple[int, int]:
    """(prompt + response tokens, response tokens) of a batch, from ``attention_mask`` and ``response_mask``."""
    response_tokens = int(batch["response_mask"].bool().sum())
    total = int(batch["attention_mask"].bool().sum()) if "attention_mask" in _keys(batch) else response_tokens
    return total, response_tokens


def reduce_metrics(
    metrics: Union[Sequence[Mapping[str, Any]], Mapping[str, Sequence[Any]]],
) -> dict[str, float]:
    """Mean of each metric over several records.

    Accepts a list of ``{name: value}`` dicts (e.g. one per micro-batch; a name missing from some
    dicts is averaged over those that have it) or a ``{name: [values]}`` dict. Values may be
    numbers or 0-d tensors. Names with no values are dropped.
    """
    collected: dict[str, list[float]] = {}
    if isinstance(metrics, Mapping):
        for name, values in metrics.items():
            collected.setdefault(name, []).extend(float(v) for v in values)
    else:
        for record in metrics:
            for name, value in record.items():
                collected.setdefault(name, []).append(float(value))
    return {name: math.fsum(vals) / len(vals) for name, vals in collected.items() if vals}
