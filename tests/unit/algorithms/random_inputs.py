"""Random inputs shared by the algorithm tests (seeded, CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RandomRollout:
    rewards: torch.Tensor  # (B, R)
    values: torch.Tensor  # (B, R)
    mask: torch.Tensor  # (B, R) float 0/1 with right padding, holes (observations), one empty row
    group_index: torch.Tensor  # (B,) non-contiguous ids, shuffled order, groups of 1..5
    baselines: torch.Tensor  # (B,)


def random_rollout(seed: int, batch: int = 23, length: int = 9, dtype: torch.dtype = torch.float64,
                   holes: bool = True, outcome_only: bool = False) -> RandomRollout:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[batch // 2] = 0  # an all-masked row
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    if holes:  # multi-turn: observation tokens inside a response
        mask &= torch.rand(batch, length, generator=gen) > 0.25
    rewards = torch.randn(batch, length, generator=gen, dtype=dtype)
    if outcome_only:  # one reward on the last generated token, as rule-based scorers give
        last = (lengths - 1).clamp_min(0)
        scalar = torch.randint(0, 3, (batch,), generator=gen).to(dtype)
        rewards = torch.zeros(batch, length, dtype=dtype)
        rewards[torch.arange(batch), last] = scalar
    sizes, total = [], 0
    while total < batch:
        s = min(int(torch.randint(1, 6, (1,), generator=gen)), batch - total)
        sizes.append(s)
        total += s
    ids = torch.cat([torch.full((s,), 7 * g + 3) for g, s in enumerate(sizes)])
    group_index = ids[torch.randperm(batch, generator=gen)]
    return RandomRollout(
        rewards=rewards,
        values=torch.randn(batch, length, generator=gen, dtype=dtype),
        mask=mask.to(dtype),
        group_index=group_index,
        baselines=torch.randn(batch, generator=gen, dtype=dtype),
    )
