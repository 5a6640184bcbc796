"""DAPO group filter, dynamic-sampling bookkeeping and overlong reward shaping."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from megarl.algorithms import (
    DynamicSamplingError,
    DynamicSamplingState,
    filter_groups,
    num_groups,
    overlong_penalty,
    sequence_metric,
)
from megarl.errors import ConfigError, DataError

pytestmark = pytest.mark.unit


def reference_filter(values: list[float], groups: list[int]) -> list[bool]:
    members: dict[int, list[float]] = defaultdict(list)
    for v, g in zip(values, groups):
        members[g].append(v)
    return [len(members[g]) == 1 or len(set(members[g])) > 1 for g in groups]


def test_filter_hand_example() -> None:
    acc = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    group = torch.tensor([3, 3, 3, 8, 8, 1, 1, 6])  # all right | mixed | all wrong | single
    keep = filter_groups(acc, group)
    assert keep.tolist() == [False, False, False, True, True, False, False, True]
    assert num_groups(group[keep]) == 2


@pytest.mark.parametrize("seed", range(5))
def test_filter_matches_loop(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    group = torch.randint(0, 9, (40,), generator=gen) * 11
    values = torch.randint(0, 2, (40,), generator=gen).double()  # accuracies: equal groups are common
    assert filter_groups(values, group).tolist() == reference_filter(values.tolist(), group.tolist())


def test_filter_edge_cases() -> None:
    assert filter_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long)).shape == (0,)
    values = torch.tensor([0.5, float("nan"), 1.0])
    with pytest.raises(DataError, match=r"filter metric.*sample 1 \(uid 'b'\).*algorithm\.filter_groups\.metric"):
        filter_groups(values, torch.tensor([0, 0, 1]), uids=np.array(["a", "b", "c"], dtype=object))


def test_sequence_metric_sources() -> None:
    scores = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.5], [2.0, -1.0]])
    assert sequence_metric("seq_reward", token_level_scores=scores).tolist() == [1.0, 2.0]
    assert sequence_metric("seq_final_reward", token_level_rewards=rewards).tolist() == [0.5, 1.0]
    assert sequence_metric("acc", reward_extra_info={"acc": [1, 0]}).tolist() == [1.0, 0.0]
    with pytest.raises(ConfigError, match=r"metric = 'f1'.*\['seq_reward', 'acc', 'score'\]"):
        sequence_metric("f1", token_level_scores=scores, reward_extra_info={"acc": [1, 0], "score": [0, 0]})


def test_sequence_metric_names_a_key_missing_from_the_reward_info() -> None:
    scores = torch.zeros(3, 2)
    # No response's reward info has the key: the function never returned it.
    with pytest.raises(ConfigError) as err:
        sequence_metric("acc", token_level_scores=scores, reward_extra_info={"score": [1.0, 0.0, 1.0]})
    assert "metric = 'acc': not available; available here: ['seq_reward', 'score']" in str(err.value)
    assert "Return 'acc' in the dict of every call" in str(err.value)
    # Some responses lack a value (the trainer's object columns hold None there): named, not NaN.
    info = {"acc": np.array([1.0, None, 0.0], dtype=object), "score": np.array([1.0, 0.5, 0.0], dtype=object)}
    with pytest.raises(DataError, match=r"metric = 'acc': no number for responses \[1\] of 3 \(values there: "
                                        r"\[None\]\); available here: \['seq_reward', 'acc', 'score'\]"):
        sequence_metric("acc", token_level_scores=scores, reward_extra_info=info)
    # Object columns of numbers (numpy bools among them) are read as float64.
    info["acc"] = np.array([np.bool_(True), 0.0, 1], dtype=object)
    assert sequence_metric("acc", reward_extra_info=info).tolist() == [1.0, 0.0, 1.0]


def test_dynamic_sampling_until_enough() -> None:
    state = DynamicSamplingState(num_prompts_needed=8, max_num_gen_batches=3)
    assert state.record(3) is False
    assert state.record(4) is False
    assert state.record(2) is True  # 9 >= 8: enough on the third (last allowed) batch
    assert (state.num_gen_batches, state.num_prompts_kept) == (3, 9)
    state.reset()
    assert (state.num_gen_batches, state.num_prompts_kept, state.enough) == (0, 0, False)


def test_dynamic_sampling_cap_error_says_what_to_change() -> None:
    state = DynamicSamplingState(num_prompts_needed=8, max_num_gen_batches=2)
    state.record(1)
    with pytest.raises(DynamicSamplingError, match=r"2 generation batches kept only 1 of the 8.*max_num_gen_batches"):
        state.record(0)


def test_dynamic_sampling_without_cap() -> None:
    state = DynamicSamplingState(num_prompts_needed=1, max_num_gen_batches=0)
    for _ in range(50):
        assert state.record(0) is False
    assert state.record(1) is True


def test_overlong_penalty_hand_example() -> None:
    # max 20, buffer 4: no penalty up to 16 tokens, then linear down to -factor at 20
    out = overlong_penalty(torch.tensor([10, 16, 17, 18, 20]), max_response_length=20, overlong_buffer_len=4,
                           penalty_factor=1.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
    out = overlong_penalty(torch.tensor([19]), 20, 4, penalty_factor=0.5)
    assert out.item() == pytest.approx(-0.375)
    with pytest.raises(ConfigError, match="overlong_buffer.len = 0"):
        overlong_penalty(torch.tensor([1]), 20, 0)
    with pytest.raises(ConfigError, match="overlong_buffer.len = 21"):
        overlong_penalty(torch.tensor([1]), 20, 21)
