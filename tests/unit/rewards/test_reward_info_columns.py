"""Every batch a RewardManager scores carries the reward-info keys its function has returned so far,
0.0 where a response lacks one: DAPO's generation rounds concatenate even when a function returns
{score, acc} on some calls and a bare number on others, and one round got only bare numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megarl.algorithms.dapo import filter_groups, sequence_metric
from megarl.data.tokenizer import build_char_tokenizer
from megarl.protocol.batch import Batch
from megarl.errors import DataError
from megarl.rewards.manager import RewardManager, with_common_reward_info

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

# A dict with `acc` for rows of data source "dict", a bare number for the others.
USER_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = float(solution_str == ground_truth)
    if data_source == "dict":
        return {"score": correct, "acc": correct}
    return 0.5 * correct
"""


def rollout_round(tokenizer, answers: list[str], sources: list[str], uids: list[str]) -> Batch:
    """Responses of one token (the answer digit) and EOS, as a generation round hands them to scoring."""
    ids = [[tokenizer.convert_tokens_to_ids(a), tokenizer.eos_token_id] for a in answers]
    return Batch.from_dict(
        {"responses": torch.tensor(ids), "response_mask": torch.ones(len(ids), 2, dtype=torch.long)},
        non_tensors={"ground_truth": ["7"] * len(ids), "data_source": sources, "uid": uids},
    )


def scored(manager: RewardManager, batch: Batch, tokenizer) -> Batch:
    """The trainer's scoring step: token-level scores and one `reward_info/<key>` column per key."""
    result = manager.score_batch(batch, tokenizer)
    batch["token_level_scores"] = result.token_level_scores
    for key, values in result.reward_info.items():
        batch[f"reward_info/{key}"] = np.asarray(values, dtype=object)
    return batch


def test_rounds_whose_calls_returned_different_keys_concatenate(tmp_path: Path) -> None:
    (tmp_path / "reward.py").write_text(USER_FILE)
    tokenizer = build_char_tokenizer("0123456789", tmp_path / "tok")
    with RewardManager(custom_fn_path=str(tmp_path / "reward.py"), num_workers=1) as manager:
        first = scored(manager, rollout_round(tokenizer, ["7", "3", "7", "7"], ["dict", "dict", "float", "float"],
                                              ["a", "a", "b", "b"]), tokenizer)
        # Only bare numbers in this round: no call returned `acc`.
        second = scored(manager, rollout_round(tokenizer, ["7", "2"], ["float", "float"], ["c", "c"]), tokenizer)
    batch = Batch.concat([first, second])
    assert sorted(first.non_tensor_keys) == sorted(second.non_tensor_keys)
    assert second["reward_info/acc"].tolist() == [0.0, 0.0]  # no call of the round returned it
    assert second["reward_info/score"].tolist() == [0.5, 0.0]
    assert manager.reward_info_keys == ("acc", "score")

    info = {k.split("/", 1)[1]: batch[k] for k in batch.non_tensor_keys if k.startswith("reward_info/")}
    acc = sequence_metric("acc", token_level_scores=batch["token_level_scores"], reward_extra_info=info)
    assert acc.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    keep = filter_groups(acc, batch.group_indices("uid"), uids=batch["uid"])
    assert keep.tolist() == [True, True, False, False, False, False]  # only group "a" has a spread


def test_an_earlier_round_without_a_key_gets_it_as_zeros_before_the_rounds_concatenate(tmp_path: Path) -> None:
    """The first round's calls all returned bare numbers, the second's a dict with `acc`: the first round
    was scored before `acc` was ever seen, so it lacks the column; `with_common_reward_info` adds it
    (0.0, as for a response that lacks a key within a batch) and the rounds concatenate."""
    (tmp_path / "reward.py").write_text(USER_FILE)
    tokenizer = build_char_tokenizer("0123456789", tmp_path / "tok")
    with RewardManager(custom_fn_path=str(tmp_path / "reward.py"), num_workers=1) as manager:
        first = scored(manager, rollout_round(tokenizer, ["7", "2"], ["float", "float"], ["a", "a"]), tokenizer)
        second = scored(manager, rollout_round(tokenizer, ["7", "3"], ["dict", "dict"], ["b", "b"]), tokenizer)
    assert "reward_info/acc" not in first.non_tensor_keys and "reward_info/acc" in second.non_tensor_keys
    with pytest.raises(DataError, match="reward_info/acc"):
        Batch.concat([first, second])
    batch = Batch.concat(with_common_reward_info([first, second]))
    assert batch["reward_info/acc"].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert batch["reward_info/score"].tolist() == [0.5, 0.0, 1.0, 0.0]
