"""The sampler and loader resume exactly where a checkpoint left them, across epoch boundaries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from data_helpers import row, write_rows
from transformers import PreTrainedTokenizerBase

from megarl.data.dataset import RLDataset
from megarl.data.loader import RLDataLoader
from megarl.data.sampler import StatefulSampler
from megarl.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.unit


def drain(sampler: StatefulSampler, count: int) -> list[tuple[int, list[int]]]:
    return [(epoch, batch.tolist()) for epoch, batch in (sampler.next_batch() for _ in range(count))]


@pytest.mark.parametrize("drop_last", [True, False])
def test_each_epoch_visits_every_row_once(drop_last: bool) -> None:
    sampler = StatefulSampler(10, 3, shuffle=True, seed=7, drop_last=drop_last)
    assert sampler.batches_per_epoch == (3 if drop_last else 4)
    for epoch in range(3):
        batches = list(sampler)
        assert len(batches) == sampler.batches_per_epoch
        assert [len(b) for b in batches] == ([3, 3, 3] if drop_last else [3, 3, 3, 1])
        seen = np.concatenate(batches)
        assert len(set(seen.tolist())) == len(seen)
        if not drop_last:
            assert sorted(seen.tolist()) == list(range(10))
        assert seen.tolist() == sampler.epoch_order(epoch)[: len(seen)].tolist()
    assert sampler.epoch == 2  # the third epoch is finished; the next batch starts epoch 3
    assert sampler.next_batch()[0] == 3


def test_orders_depend_on_seed_and_epoch_only() -> None:
    a, b = StatefulSampler(50, 5, seed=1), StatefulSampler(50, 5, seed=1)
    assert drain(a, 25) == drain(b, 25)
    assert a.epoch_order(0).tolist() != a.epoch_order(1).tolist()
    assert StatefulSampler(50, 5, seed=2).epoch_order(0).tolist() != a.epoch_order(0).tolist()
    assert StatefulSampler(50, 5, shuffle=False).epoch_order(3).tolist() == list(range(50))


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("consumed", [0, 1, 2, 3, 4, 5, 9, 11])
def test_resume_continues_with_exactly_the_next_batch(drop_last: bool, consumed: int) -> None:
    # 10 rows in batches of 3: 3 or 4 batches an epoch; the cut points fall before, on and after epoch ends.
    reference = drain(StatefulSampler(10, 3, seed=3, drop_last=drop_last), 16)
    first = StatefulSampler(10, 3, seed=3, drop_last=drop_last)
    head = drain(first, consumed)
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    resumed = StatefulSampler(10, 3, seed=3, drop_last=drop_last)
    resumed.load_state_dict(state)
    assert head + drain(resumed, 16 - consumed) == reference


def test_resume_inside_for_loops_over_epochs() -> None:
    def run(stop_after: int | None, state: dict | None) -> tuple[list[list[int]], dict]:
        sampler = StatefulSampler(7, 2, seed=5, drop_last=False)
        if state is not None:
            sampler.load_state_dict(state)
        out: list[list[int]] = []
        while sampler.epoch < 3:
            for batch in sampler:
                out.append(batch.tolist())
                if stop_after is not None and len(out) == stop_after:
                    return out, sampler.state_dict()
            if sampler.epoch == 2 and sampler.position == sampler.batches_per_epoch:
                break
        return out, sampler.state_dict()

    full, _ = run(None, None)
    assert len(full) == 12  # 3 epochs x 4 batches
    for cut in (1, 4, 5, 11):
        head, state = run(cut, None)
        tail, _ = run(None, state)
        assert head + tail == full


def test_state_from_a_different_layout_is_refused() -> None:
    state = StatefulSampler(10, 3, seed=3).state_dict()
    for key, other in [
        ("num_rows", StatefulSampler(11, 3, seed=3)),
        ("batch_size", StatefulSampler(10, 2, seed=3)),
        ("seed", StatefulSampler(10, 3, seed=4)),
    ]:
        with pytest.raises(CheckpointError, match=f"saved with {key}="):
            other.load_state_dict(state)
    with pytest.raises(CheckpointError, match="no 'drop_last'"):
        StatefulSampler(10, 3, seed=3).load_state_dict({k: v for k, v in state.items() if k != "drop_last"})
    with pytest.raises(CheckpointError, match="out of range"):
        StatefulSampler(10, 3, seed=3).load_state_dict({**state, "position": 9})


def test_too_few_rows_for_one_batch() -> None:
    with pytest.raises(ConfigError, match="no batch of 4 with drop_last"):
        StatefulSampler(3, 4)
    assert StatefulSampler(3, 4, drop_last=False).batches_per_epoch == 1
    with pytest.raises(ConfigError, match="batch_size"):
        StatefulSampler(3, 0)


def test_loader_resume_gives_the_same_batches(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    path = write_rows(tmp_path / "l.parquet", [row(f"{i}+{i}=", answer=str(2 * i)) for i in range(11)])
    dataset = RLDataset(path, char_tokenizer, max_prompt_length=8, cache_dir=cache_dir)

    def batches(loader: RLDataLoader, count: int) -> list[tuple[list[list[int]], list[str], list[str]]]:
        out = []
        for _ in range(count):
            batch = loader.next_batch()
            out.append((batch["input_ids"].tolist(), list(batch["uid"]), list(batch["ground_truth"])))
        return out

    reference = batches(RLDataLoader(dataset, 4, seed=9), 8)  # 2 batches an epoch: 4 epochs
    assert len(RLDataLoader(dataset, 4)) == 2
    first = RLDataLoader(dataset, 4, seed=9)
    head = batches(first, 3)
    resumed = RLDataLoader(dataset, 4, seed=9)
    resumed.load_state_dict(first.state_dict())
    assert head + batches(resumed, 5) == reference
    # uids name epoch and row; within a batch they are distinct.
    for _, uids, answers in reference:
        assert len(set(uids)) == 4
        for uid, answer in zip(uids, answers):
            assert int(answer) == 2 * int(uid.split("-")[1])
    assert [uids[0].split("-")[0] for _, uids, _ in reference] == ["0", "0", "1", "1", "2", "2", "3", "3"]


def test_loader_iterates_one_epoch_per_for_loop(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    path = write_rows(tmp_path / "l.parquet", [row(f"{i}=") for i in range(6)])
    loader = RLDataLoader(
        RLDataset(path, char_tokenizer, cache_dir=cache_dir), 2, shuffle=False, drop_last=True
    )
    first = [list(b["uid"]) for b in loader]
    second = [list(b["uid"]) for b in loader]
    assert first == [["0-0", "0-1"], ["0-2", "0-3"], ["0-4", "0-5"]]
    assert second == [["1-0", "1-1"], ["1-2", "1-3"], ["1-4", "1-5"]]


@pytest.mark.parametrize("seed", [-1, -(2**40), 1.5])
def test_a_seed_numpy_refuses_is_a_config_error_when_the_sampler_is_built(seed: Any) -> None:
    # numpy's default_rng takes integers >= 0: the first batch, after the workers started, would fail.
    with pytest.raises(ConfigError, match=rf"seed \(data.seed\) must be an integer >= 0, got {seed!r}"):
        StatefulSampler(10, 2, seed=seed)
    assert StatefulSampler(10, 2, seed=0).next_batch()[1].shape == (2,)
    assert StatefulSampler(10, 2, seed=2**70).next_batch()[1].shape == (2,)  # no upper bound
