"""Token sampling from next-token logits: temperature, top-k, top-p and the sampled log-probs.

Pure torch functions; the order (temperature, then top-k, then top-p on the renormalised top-k
distribution) is the one vLLM and transformers use.
"""

from __future__ import annotations

import torch

from megarl.rollout.base import SamplingParams


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits with tokens outside top-k / top-p set to -inf.

    Args:
        logits: (N, V) float32 raw next-token logits.
    Returns:
        (N, V) float32; ``log_softmax`` of it is the sampling distribution.
    """
    scaled = logits.float() / params.temperature
    if params.top_k_enabled and params.top_k < scaled.shape[-1]:
        kth_largest = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Drop a token once the more likely tokens already hold top_p of the mass; the most likely
        # token is always kept (its mass_before is 0).
        drop_sorted = mass_before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs` (N, V) from one uniform per row (N,) in [0, 1): the first token
    whose cumulative probability exceeds `u` x the row's total, so row i's token depends on row i's
    probabilities and number alone. Tokens of probability 0 add nothing to the cumulative sum
    (float64) and are never taken; the target stays below the total, where rounding would put it at
    the end, so the last token of positive probability is the furthest one taken."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    target = uniforms.to(device=probs.device, dtype=torch.float64).unsqueeze(-1) * total
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tokens.clamp_(max=probs.shape[-1] - 1)


def sample_next_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    logprobs_mode: str,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row and its log-prob.

    Args:
        logits: (N, V) raw next-token logits.
        logprobs_mode: "processed" (log-prob under the filtered, tempered distribution; greedy
            counts as temperature 1 without filters) or "raw" (``log_softmax(logits)``).
        uniforms: (N,) one uniform in [0, 1) per row, drawn from each row's own stream
            (`megarl.rollout.seeds.row_uniforms`): rows sample by `inverse_cdf_sample`,
            independently of one another and of the batch they are in. Needed unless greedy.
    Returns:
        tokens (N,) int64 and log_probs (N,) float32.
    """
    logits = logits.float()
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)
        distribution = torch.log_softmax(logits, dim=-1)
    else:
        filtered = filter_logits(logits, params)
        distribution = torch.log_softmax(filtered, dim=-1)
        if uniforms is None:
            raise ValueError("sample_next_tokens: sampling needs one uniform per row (uniforms)")
        tokens = inverse_cdf_sample(distribution.exp(), uniforms)
        if logprobs_mode == "raw":
            distribution = torch.log_softmax(logits, dim=-1)
    log_probs = distribution.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, log_probs
