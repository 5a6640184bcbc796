"""`tools/prepare_gsm8k.py --tools code_interpreter`: rows for multi-turn rollouts from a local copy
(no network): a system message describing the tool in the Hermes format and verl's
`extra_info.tools_kwargs`, read back the way the agent loop reads them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megarl.agent.loop import parse_tools_kwargs
from megarl.agent.parsers import HermesParser
from megarl.agent.tools import CalculatorTool, PythonTool, ToolSet
from megarl.data.prepare import GSM8K_INSTRUCTION, main, prepare, tools_system_message
from megarl.errors import DataError

pytestmark = pytest.mark.unit

ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A farm sells 1,000 eggs twice. How many?", "answer": "2 * 1000 = 2000\n#### 2,000"},
]


def local_copy(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def test_gsm8k_rows_with_the_code_interpreter(tmp_path: Path) -> None:
    source = local_copy(tmp_path / "train.jsonl")
    assert main("gsm8k", ["--out", str(tmp_path / "out"), "--local", str(source), "--splits", "train",
                 "--tools", "code_interpreter"]) == 0
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert len(rows) == 2
    for row, record, answer in zip(rows, ROWS, ["7", "2000"]):
        system, user = row["prompt"]
        assert user == {"role": "user", "content": f"{record['question']} {GSM8K_INSTRUCTION}"}
        assert system["role"] == "system"
        # the schemas between <tools></tools>, one JSON object a line, are the tool's own
        listed = re.search(r"<tools>\n(.*)\n</tools>", system["content"], re.S)
        assert listed is not None, system["content"]
        assert [json.loads(line) for line in listed.group(1).splitlines()] == [PythonTool.schema]
        call_format = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        assert call_format in system["content"]
        assert row["reward_model"]["ground_truth"] == answer
        assert row["extra_info"]["tools_kwargs"] == {"code_interpreter": {"create_kwargs": {"ground_truth": answer}}}
        # what the agent loop accepts for a run with the code interpreter
        kwargs = parse_tools_kwargs(row["extra_info"]["tools_kwargs"], ToolSet.from_names(["code_interpreter"]).tools)
        assert kwargs["code_interpreter"]["create_kwargs"] == {"ground_truth": answer}


def test_prepared_rows_give_the_calculator_its_reward(tmp_path: Path) -> None:
    """The calculator's tool reward reads the create_kwargs the prepared rows carry: 1 for a last
    result equal to the row's answer, 0 otherwise."""
    source = local_copy(tmp_path / "train.jsonl")
    assert main("gsm8k", ["--out", str(tmp_path / "out"), "--local", str(source), "--splits", "train",
                 "--tools", "calculator"]) == 0
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    for row, (right, wrong) in zip(rows, [("3 + 4", "3 * 4"), ("2 * 1000", "2 + 1000")]):
        kwargs = parse_tools_kwargs(row["extra_info"]["tools_kwargs"], ToolSet.from_names(["calculator"]).tools)
        for expression, reward in ((right, 1.0), (wrong, 0.0)):
            tool = CalculatorTool()
            tool.create("episode", **kwargs["calculator"]["create_kwargs"])
            assert tool.call("episode", {"expression": expression}).error is None
            assert tool.calc_reward("episode") == reward, (row["reward_model"]["ground_truth"], expression)


def test_the_described_call_format_parses() -> None:
    """A call written as the system message says is one the run's Hermes parser reads."""
    system = tools_system_message(["code_interpreter"])["content"]
    example = re.search(r"<tool_call>\n(.*)\n</tool_call>", system).group(1)
    arguments = {"code": "print(3 + 4)"}
    text = "<tool_call>\n" + example.replace("<function-name>", '"code_interpreter"').replace(
        "<args-json-object>", json.dumps(arguments)) + "\n</tool_call>"
    calls = HermesParser().parse(text)
    assert [(c.name, c.arguments) for c in calls.calls] == [("code_interpreter", arguments)]


def test_without_tools_the_rows_are_unchanged(tmp_path: Path) -> None:
    source = local_copy(tmp_path / "train.jsonl")
    prepare("gsm8k", tmp_path / "out", local=str(source), splits=["train"])
    row = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()[0]
    assert [m["role"] for m in row["prompt"]] == ["user"]
    assert "tools_kwargs" not in row["extra_info"]


def test_unknown_tools_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="browser"):
        tools_system_message(["browser"])
    with pytest.raises(SystemExit):  # argparse: not one of the built-in tools
        main("gsm8k", ["--out", str(tmp_path / "out"), "--local", str(local_copy(tmp_path / "train.jsonl")),
              "--splits", "train", "--tools", "browser"])
