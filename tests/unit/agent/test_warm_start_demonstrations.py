"""The warm start's demonstrations of the arithmetic_tools task: the share that calls the calculator
(`--tool-fraction`), and what the others look like."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megarl.agent.warm_start import calculator_demonstrations, conversation_ids, main
from megarl.data.parquet_io import write_parquet
from megarl.data.tasks.arithmetic_tools import ArithmeticToolsTask, build_tools_tokenizer, call_text

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def task_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    root = tmp_path_factory.mktemp("arithmetic_tools")
    tokenizer = build_tools_tokenizer(root / "tokenizer")
    write_parquet(ArithmeticToolsTask(digits=3).rows(20, 0, "train"), root / "train.parquet")
    return tokenizer, root / "train.parquet"


@pytest.mark.parametrize("fraction, calls", [(0.0, 0), (0.25, 5), (0.3, 6), (1.0, 20)])
def test_tool_fraction_is_the_share_of_calling_episodes(task_files: tuple[object, Path], fraction: float,
                                                        calls: int) -> None:
    tokenizer, train = task_files
    episodes = calculator_demonstrations(tokenizer, train, limit=20, tool_fraction=fraction, seed=3)
    call_id = tokenizer.convert_tokens_to_ids("<tool_call>")
    assert len(episodes) == 20
    assert sum(call_id in ids for ids, _ in episodes) == calls


def test_direct_answers_are_one_turn_with_the_right_number(task_files: tuple[object, Path]) -> None:
    tokenizer, train = task_files
    rows = pq.read_table(str(train)).to_pylist()[:4]
    episodes = calculator_demonstrations(tokenizer, train, limit=4, tool_fraction=0.5, seed=0)
    kinds = []
    for row, (ids, mask) in zip(rows, episodes):
        prompt, answer = row["prompt"][-1]["content"], row["reward_model"]["ground_truth"]
        direct = conversation_ids(tokenizer, prompt, [f"{answer}<|im_end|>"], [])
        with_tool = conversation_ids(tokenizer, prompt, [call_text(prompt.rstrip("=")), f"{answer}<|im_end|>"],
                                     [answer])
        assert (ids, mask) in (direct, with_tool)
        kinds.append((ids, mask) == with_tool)
        if (ids, mask) == direct:  # the loss covers exactly the answer's digits and the EOS
            assert sum(mask) == len(answer) + 1 and mask[-sum(mask):] == [1] * sum(mask)
    assert sorted(kinds) == [False, False, True, True]


def test_a_fraction_outside_0_1_is_refused(task_files: tuple[object, Path], tmp_path: Path) -> None:
    tokenizer, train = task_files
    with pytest.raises(ValueError, match="tool_fraction"):
        calculator_demonstrations(tokenizer, train, limit=4, tool_fraction=1.5)
    common = ["--data", str(train), "--tokenizer", str(train.parent / "tokenizer"), "--out", str(tmp_path / "m"),
              "--steps", "0"]
    with pytest.raises(ValueError, match="tool_fraction"):
        main([*common, "--mixed-steps", "1", "--tool-fraction", "-0.1"])
    with pytest.raises(ValueError, match="--mixed-steps"):  # without the mixed phase the fraction would do nothing
        main([*common, "--tool-fraction", "0.3"])
