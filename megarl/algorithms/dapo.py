"""DAPO (https://arxiv.org/abs/2503.14476): dynamic sampling with group filtering, overlong shaping.

Dynamic sampling: drop the groups (responses to one prompt) whose metric is the same for every
response (all right or all wrong: zero advantage, no learning signal) and keep generating until
enough prompts remain. One driver step::

    state = DynamicSamplingState(num_prompts_needed=train_batch_size, max_num_gen_batches=cap)
    while True:
        batch = generate_and_score(...)
        keep = filter_groups(sequence_metric(metric, ...), group_index, uids=batch["uid"])
        kept.append(batch[keep])
        if state.record(num_groups(group_index[keep])):   # raises past the cap
            break
    batch = concat(kept)[: train_batch_size * n]           # trim to the size needed
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megarl.algorithms.utils import check_finite, compact_groups
from megarl.errors import ConfigError, DataError, MegarlError

TENSOR_METRICS = ("seq_final_reward", "seq_reward")


class DynamicSamplingError(MegarlError, RuntimeError):
    """Generation went past ``max_num_gen_batches`` without enough prompts that have a learning signal."""


def sequence_metric(
    name: str,
    *,
    token_level_scores: Optional[torch.Tensor] = None,
    token_level_rewards: Optional[torch.Tensor] = None,
    reward_extra_info: Optional[Mapping[str, Sequence[float] | np.ndarray | torch.Tensor]] = None,
) -> torch.Tensor:
    """(B,) float64 per-response value of the filter metric ``algorithm.filter_groups.metric``.

    ``seq_final_reward``: sum of ``token_level_rewards`` (after KL shaping); ``seq_reward``: sum of
    ``token_level_scores``; any other name: that key of the reward function's extra info
    (e.g. ``acc``, ``score``). A name none of these has is a ConfigError listing the available ones;
    a key some responses have no number for (None) is a DataError naming those responses.
    """
    if name == "seq_final_reward" and token_level_rewards is not None:
        return token_level_rewards.sum(dim=-1, dtype=torch.float64)
    if name == "seq_reward" and token_level_scores is not None:
        return token_level_scores.sum(dim=-1, dtype=torch.float64)
    available = [n for n, t in zip(TENSOR_METRICS, (token_level_rewards, token_level_scores)) if t is not None]
    available += sorted(reward_extra_info or {})
    where = f"algorithm.filter_groups.metric = {name!r}"
    if reward_extra_info is None or name not in reward_extra_info:
        if name in TENSOR_METRICS:
            raise ConfigError(f"{where}: not available; available here: {available}")
        raise ConfigError(
            f"{where}: not available; available here: {available}. No response of this batch has "
            f"{name!r} in its reward info: the reward function returned it for none of them (a call that "
            f"returns a bare number, or fails, gives only 'score'). Return {name!r} in the dict of every call, "
            "or filter by one of the available keys")
    values = np.asarray(reward_extra_info[name], dtype=object).reshape(-1)
    missing = [i for i, v in enumerate(values.tolist()) if v is None or isinstance(v, (str, bytes))]
    if missing:
        raise DataError(
            f"{where}: no number for responses {missing[:10]} of {len(values)} "
            f"(values there: {[values[i] for i in missing[:3]]}); available here: {available}")
    return torch.as_tensor(values.astype(np.float64))


def filter_groups(
    metric_values: torch.Tensor,
    group_index: torch.Tensor,
    *,
    uids: Optional[Sequence[object] | np.ndarray] = None,
) -> torch.Tensor:
    """(B,) bool: keep the responses of groups whose metric differs somewhere within the group.

    A group of identical values (max == min, exactly) is dropped; a group of one response is kept
    (as in verl: it has no spread to judge by). NaN/inf metrics raise DataError naming the sample.
    """
    if metric_values.shape != group_index.shape or metric_values.dim() != 1:
        raise DataError(
            f"filter_groups: metric_values {tuple(metric_values.shape)} and group_index "
            f"{tuple(group_index.shape)} must both be (batch,)"
        )
    check_finite("filter metric", metric_values, uids,
                 hint="The metric of algorithm.filter_groups.metric comes from the reward function (its score, "
                      "or that key of its reward info); check the reward function for these samples.")
    if metric_values.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    inverse, sizes = compact_groups(group_index)
    values = metric_values.to(torch.float64)
    init = values.new_empty(len(sizes))
    group_max = init.scatter_reduce(0, inverse, values, reduce="amax", include_self=False)
    group_min = init.scatter_reduce(0, inverse, values, reduce="amin", include_self=False)
    keep_group = (group_max != group_min) | (sizes == 1)
    return keep_group[inverse]


def num_groups(group_index: torch.Tensor) -> int:
    """Number of distinct groups (prompts) in ``group_index``."""
    return int(torch.unique(group_index).numel())


@dataclass
class DynamicSamplingState:
    """Bookkeeping of one training step's "generate until enough groups" loop.

    ``max_num_gen_batches <= 0`` means no cap (as ``algorithm.filter_groups.max_num_gen_batches``).
    """

    num_prompts_needed: int
    max_num_gen_batches: int = 0
    num_gen_batches: int = 0
    num_prompts_kept: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts_needed <= 0:
            raise ConfigError(f"data.train_batch_size = {self.num_prompts_needed}: must be > 0")

    @property
    def enough(self) -> bool:
        return self.num_prompts_kept >= self.num_prompts_needed

    def record(self, num_prompts_kept: int) -> bool:
        """Count one generation batch that kept ``num_prompts_kept`` prompts; True once there are enough.

        Raises DynamicSamplingError when the cap is reached and there are still too few.
        """
        self.num_gen_batches += 1
        self.num_prompts_kept += int(num_prompts_kept)
        if self.enough:
            return True
        if 0 < self.max_num_gen_batches <= self.num_gen_batches:
            raise DynamicSamplingError(
                f"DAPO dynamic sampling: {self.num_gen_batches} generation batches kept only "
                f"{self.num_prompts_kept} of the {self.num_prompts_needed} prompts needed (the rest had the same "
                f"filter metric for every response). Raise algorithm.filter_groups.max_num_gen_batches "
                f"(now {self.max_num_gen_batches}; <= 0 means no cap), use more responses per prompt "
                "(rollout.n), or check that the reward varies within groups (too easy/hard data, a "
                "constant reward function)."
            )
        return False

    def reset(self) -> None:
        """Start the next training step."""
        self.num_gen_batches = 0
        self.num_prompts_kept = 0


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment (B,) float32, added to each response's reward.

    0 up to ``max_response_length - overlong_buffer_len`` tokens, then falling linearly to
    ``-penalty_factor`` at ``max_response_length``: ``min(-(len - expected) / buffer * factor, 0)``.
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ConfigError(
            f"reward.overlong_buffer.len = {overlong_buffer_len}: must be in (0, max response length = "
            f"{max_response_length}]"
        )
    expected_len = max_response_length - overlong_buffer_len
    exceed = response_lengths.to(torch.float32) - expected_len
    return (-exceed / overlong_buffer_len * penalty_factor).clamp(max=0.0)
