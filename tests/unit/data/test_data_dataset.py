"""RLDataset over parquet: round trip, chat templates, overlong filtering, truncation, bad input."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from data_helpers import row, write_rows
from tokenizers import processors
from transformers import PreTrainedTokenizerBase

from megarl.config.schema import DataConfig
from megarl.data.dataset import RLDataset
from megarl.data.tokenizer import train_bpe_tokenizer
from megarl.errors import ConfigError, DataError
from megarl.protocol.batch import Batch

pytestmark = pytest.mark.unit

CONTENTS_A = ["3+4=", "12+345=", "7*8-1=", "0="]
CONTENTS_B = ["99-9=", "1+1+1+1="]


def two_files(tmp_path: Path) -> list[str]:
    a = write_rows(tmp_path / "a.parquet", [row(c, answer=str(i), index=i) for i, c in enumerate(CONTENTS_A)])
    b = write_rows(
        tmp_path / "b.parquet",
        [row(c, answer=f"b{i}", data_source="countdown", index=i) for i, c in enumerate(CONTENTS_B)],
    )
    return [a, b]


def test_round_trip_through_parquet(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    files = two_files(tmp_path)
    dataset = RLDataset(files, char_tokenizer, max_prompt_length=16, cache_dir=cache_dir)
    assert len(dataset) == dataset.num_rows_read == 6 and dataset.num_dropped_overlong == 0
    assert dataset.data_sources() == ["arithmetic", "countdown"]
    expected_answers = ["0", "1", "2", "3", "b0", "b1"]
    for index, content in enumerate(CONTENTS_A + CONTENTS_B):
        example = dataset[index]
        assert char_tokenizer.decode(example["input_ids"]) == content
        assert len(example["input_ids"]) == len(content)  # plain text, one token per character
        assert example["raw_prompt"] == [{"role": "user", "content": content}]
        assert example["ground_truth"] == expected_answers[index]
        assert example["extra_info"] == {"split": "train", "index": index % 4 if index < 4 else index - 4}
        assert example["data_source"] == ("arithmetic" if index < 4 else "countdown")
    assert dataset.locate(5) == (files[1], 1)
    assert dataset.locate(-1) == (files[1], 1)
    with pytest.raises(IndexError):
        dataset[6]


def test_collate_left_pads_with_mask_and_positions(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    dataset = RLDataset(two_files(tmp_path), char_tokenizer, max_prompt_length=10, cache_dir=cache_dir)
    examples = dataset.get_rows([1, 3, 5])
    batch = dataset.collate(examples, uids=["u1", "u3", "u5"])
    assert isinstance(batch, Batch) and len(batch) == 3
    assert batch["input_ids"].shape == (3, 10)
    pad = char_tokenizer.pad_token_id
    for b, content in enumerate(["12+345=", "0=", "1+1+1+1="]):
        n = len(content)
        ids = char_tokenizer(content)["input_ids"]
        assert batch["input_ids"][b].tolist() == [pad] * (10 - n) + ids
        assert batch["attention_mask"][b].tolist() == [0] * (10 - n) + [1] * n
        assert batch["position_ids"][b].tolist() == [0] * (10 - n) + list(range(n))
    assert list(batch["uid"]) == ["u1", "u3", "u5"]
    assert list(batch["ground_truth"]) == ["1", "3", "b1"]
    assert list(batch["data_source"]) == ["arithmetic", "arithmetic", "countdown"]
    assert batch["raw_prompt"][2] == [{"role": "user", "content": "1+1+1+1="}]
    # Default uid: the global row, unique across files.
    assert list(dataset.collate(examples)["uid"]) == ["1", "3", "5"]


def test_pad_to_longest(tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str) -> None:
    dataset = RLDataset(
        two_files(tmp_path), char_tokenizer, max_prompt_length=16, pad_to="longest", cache_dir=cache_dir
    )
    batch = dataset.collate(dataset.get_rows([0, 3]))
    assert batch["input_ids"].shape == (2, 4)  # "3+4=" is the longest


def test_chat_template_is_applied(
    tmp_path: Path, chat_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    path = write_rows(tmp_path / "c.parquet", [row("3+4=")])
    with_template = RLDataset(path, chat_tokenizer, max_prompt_length=64, cache_dir=cache_dir)
    text = chat_tokenizer.decode(with_template[0]["input_ids"])
    assert text == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
    plain = RLDataset(
        path, chat_tokenizer, max_prompt_length=64, apply_chat_template="false", cache_dir=cache_dir
    )
    assert chat_tokenizer.decode(plain[0]["input_ids"]) == "3+4="


def test_plain_text_joins_messages_and_accepts_strings(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    rows = [row("1+1="), row("x")]
    rows[0]["prompt"] = [{"role": "system", "content": "12"}, {"role": "user", "content": "3+4="}]
    rows[1]["prompt"] = [{"role": "user", "content": "5="}]
    path = write_rows(tmp_path / "m.parquet", rows)
    dataset = RLDataset(path, char_tokenizer, max_prompt_length=16, cache_dir=cache_dir)
    # "\n" is not in the character set: it becomes <unk> (id 3) between the two blank-line-joined messages.
    ids = dataset[0]["input_ids"]
    assert char_tokenizer.decode(ids, skip_special_tokens=True) == "123+4="
    assert ids.count(char_tokenizer.unk_token_id) == 2
    string_rows = [{**row("0"), "question": "7-2="}]
    string_path = write_rows(tmp_path / "s.parquet", string_rows)
    by_key = RLDataset(
        string_path, char_tokenizer, prompt_key="question", max_prompt_length=16, cache_dir=cache_dir
    )
    assert char_tokenizer.decode(by_key[0]["input_ids"]) == "7-2="
    assert by_key[0]["raw_prompt"] == "7-2="


def test_true_chat_template_without_one_is_a_config_error(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    path = write_rows(tmp_path / "c.parquet", [row("3+4=")])
    with pytest.raises(ConfigError, match="no chat template"):
        RLDataset(path, char_tokenizer, apply_chat_template=True, cache_dir=cache_dir)


def test_overlong_prompts_are_dropped_counted_and_logged(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    contents = ["1=", "1234=", "1234567=", "12345678=", "12345678901="]  # 2, 5, 8, 9, 12 tokens
    path = write_rows(tmp_path / "o.parquet", [row(c, answer=str(i)) for i, c in enumerate(contents)])
    with caplog.at_level(logging.WARNING):
        dataset = RLDataset(path, char_tokenizer, max_prompt_length=8, cache_dir=cache_dir)
    assert len(dataset) == 3 and dataset.num_dropped_overlong == 2 and dataset.num_rows_read == 5
    assert "dropped 2 of 5 prompts longer than max_prompt_length=8" in caplog.text
    assert [dataset[i]["ground_truth"] for i in range(3)] == ["0", "1", "2"]
    assert dataset.prompt_lengths.tolist() == [2, 5, 8]
    assert dataset.locate(2) == (path, 2)


@pytest.mark.parametrize("setting", ["padding", "truncation"])
def test_overlong_filter_ignores_the_tokenizers_padding_and_truncation(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str, setting: str
) -> None:
    # A tokenizer.json (or an earlier call) may leave padding or truncation on the backend: lengths
    # measured with it were the batch's longest (every row dropped) or the cut (overlong rows kept,
    # refused later at fetch).
    contents = ["1=", "1234=", "12345678901="]  # 2, 5, 12 tokens
    path = write_rows(tmp_path / "s.parquet", [row(c, answer=str(i)) for i, c in enumerate(contents)])
    backend = char_tokenizer.backend_tokenizer
    if setting == "padding":
        backend.enable_padding()  # to the batch's longest
    else:
        backend.enable_truncation(max_length=6)
    try:
        dataset = RLDataset(path, char_tokenizer, max_prompt_length=8, cache_dir=cache_dir)
    finally:
        backend.no_padding()
        backend.no_truncation()
    assert dataset.prompt_lengths.tolist() == [2, 5] and dataset.num_dropped_overlong == 1
    assert [dataset[i]["ground_truth"] for i in range(2)] == ["0", "1"]


def test_overlong_filter_in_worker_processes_matches(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    contents = [str(10 ** (i % 9)) + "=" for i in range(40)]  # lengths 2..10
    path = write_rows(tmp_path / "p.parquet", [row(c, answer=str(i)) for i, c in enumerate(contents)])
    serial = RLDataset(path, char_tokenizer, max_prompt_length=6, cache_dir=cache_dir)
    parallel = RLDataset(
        path, char_tokenizer, max_prompt_length=6, num_proc=2, cache_dir=str(tmp_path / "other_cache")
    )
    kept = [i for i, c in enumerate(contents) if len(c) <= 6]
    assert [serial[i]["ground_truth"] for i in range(len(serial))] == [str(i) for i in kept]
    assert [parallel[i]["ground_truth"] for i in range(len(parallel))] == [str(i) for i in kept]


@pytest.mark.parametrize(("mode", "expected"), [("left", "6789"), ("right", "0123"), ("middle", "0189")])
def test_truncation_when_not_filtering(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str, mode: str, expected: str
) -> None:
    path = write_rows(tmp_path / "t.parquet", [row("0123456789"), row("12")])
    dataset = RLDataset(
        path,
        char_tokenizer,
        max_prompt_length=4,
        truncation=mode,
        filter_overlong_prompts=False,
        cache_dir=cache_dir,
    )
    assert len(dataset) == 2
    assert char_tokenizer.decode(dataset[0]["input_ids"]) == expected
    assert char_tokenizer.decode(dataset[1]["input_ids"]) == "12"


def test_truncation_error_names_file_row_and_column(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    path = write_rows(tmp_path / "t.parquet", [row("12"), row("0123456789")])
    dataset = RLDataset(
        path,
        char_tokenizer,
        max_prompt_length=4,
        truncation="error",
        filter_overlong_prompts=False,
        cache_dir=cache_dir,
    )
    assert char_tokenizer.decode(dataset[0]["input_ids"]) == "12"
    with pytest.raises(DataError, match=rf"{path}: row 1, column 'prompt': prompt has 10 tokens"):
        dataset[1]


def test_missing_column_names_file_and_column(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    good = write_rows(tmp_path / "good.parquet", [row("1=")])
    rows = [row("1=")]
    del rows[0]["reward_model"]
    bad = write_rows(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError, match=rf"{bad}: column 'reward_model' is missing"):
        RLDataset([good, bad], char_tokenizer, cache_dir=cache_dir)
    with pytest.raises(DataError, match=rf"{good}: column 'question' is missing"):
        RLDataset(good, char_tokenizer, prompt_key="question", cache_dir=cache_dir)
    # Without rule-based rewards the ground truth may be absent.
    dataset = RLDataset(bad, char_tokenizer, require_ground_truth=False, cache_dir=cache_dir)
    assert dataset[0]["ground_truth"] is None


@pytest.mark.parametrize("filter_overlong", [True, False])
def test_malformed_rows_name_file_row_and_column(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str, filter_overlong: bool
) -> None:
    first = write_rows(tmp_path / "first.parquet", [row("1="), row("2=")])
    rows = [row("1="), row("2="), row("3=")]
    rows[1]["prompt"] = [{"role": "user", "content": None}]
    broken_prompt = write_rows(tmp_path / "prompt.parquet", rows)
    rows = [row("1="), row("2=")]
    rows[1]["reward_model"] = {"style": "rule", "ground_truth": None}
    broken_truth = write_rows(tmp_path / "truth.parquet", rows)
    options = {"filter_overlong_prompts": filter_overlong, "max_prompt_length": 8, "cache_dir": cache_dir}
    # Validation is eager with the overlong filter (one pass over all rows), lazy on access without.
    if filter_overlong:
        with pytest.raises(
            DataError, match=rf"{broken_prompt}: row 1, column 'prompt': message 0 has no string 'content'"
        ):
            RLDataset([first, broken_prompt], char_tokenizer, **options)
        with pytest.raises(
            DataError, match=rf"{broken_truth}: row 1, column 'reward_model': has no 'ground_truth'"
        ):
            RLDataset(broken_truth, char_tokenizer, **options)
    else:
        dataset = RLDataset([first, broken_prompt], char_tokenizer, **options)
        assert dataset[2]["ground_truth"] == "0"
        with pytest.raises(DataError, match=rf"{broken_prompt}: row 1, column 'prompt'"):
            dataset.get_rows([2, 3])
        with pytest.raises(DataError, match=rf"{broken_truth}: row 1, column 'reward_model'"):
            RLDataset(broken_truth, char_tokenizer, **options)[1]


def test_empty_prompt_list_and_bad_data_source(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    rows = [row("1="), row("2=")]
    rows[1]["prompt"] = []
    path = write_rows(tmp_path / "e.parquet", rows)
    with pytest.raises(DataError, match=rf"{path}: row 1, column 'prompt': expected a non-empty list"):
        RLDataset(path, char_tokenizer, cache_dir=cache_dir)
    rows = [row("1="), row("2=", data_source="")]
    path = write_rows(tmp_path / "d.parquet", rows)
    with pytest.raises(DataError, match=rf"{path}: row 1, column 'data_source'"):
        RLDataset(path, char_tokenizer, cache_dir=cache_dir)


def test_unreadable_and_missing_files(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"this is not parquet at all")
    with pytest.raises(DataError, match=rf"{garbage}: not a readable parquet file"):
        RLDataset(str(garbage), char_tokenizer, cache_dir=cache_dir)
    with pytest.raises(DataError, match="nope.parquet: file does not exist"):
        RLDataset(str(tmp_path / "nope.parquet"), char_tokenizer, cache_dir=cache_dir)


def test_files_with_conflicting_column_types(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    a = write_rows(tmp_path / "a.parquet", [row("1=", answer="1")])
    other = row("2=")
    other["reward_model"] = {"style": "rule", "ground_truth": {"target": 2, "numbers": [1, 1]}}
    b = write_rows(tmp_path / "b.parquet", [other])
    with pytest.raises(DataError, match="different types"):
        RLDataset([a, b], char_tokenizer, cache_dir=cache_dir)


def test_all_rows_overlong_is_an_error(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    path = write_rows(tmp_path / "l.parquet", [row("123456=")])
    with pytest.raises(DataError, match="no rows left"):
        RLDataset(path, char_tokenizer, max_prompt_length=3, cache_dir=cache_dir)


def test_bad_options(tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase) -> None:
    path = write_rows(tmp_path / "x.parquet", [row("1=")])
    for options, message in [
        ({"truncation": "top"}, "truncation"),
        ({"pad_to": "max"}, "pad_to"),
        ({"max_prompt_length": 0}, "max_prompt_length"),
    ]:
        with pytest.raises(ConfigError, match=message):
            RLDataset(path, char_tokenizer, **options)
    with pytest.raises(ConfigError, match="no parquet files"):
        RLDataset([], char_tokenizer)


def test_prompt_lengths_are_int_arrays(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    path = write_rows(tmp_path / "x.parquet", [row("1="), row("22=")])
    dataset = RLDataset(path, char_tokenizer, cache_dir=cache_dir)
    assert dataset.prompt_lengths.dtype == np.int64 and dataset.prompt_lengths.tolist() == [2, 3]


def test_from_config_reads_the_data_section(
    tmp_path: Path, char_tokenizer: PreTrainedTokenizerBase, cache_dir: str
) -> None:
    path = write_rows(tmp_path / "x.parquet", [row("0123456789"), row("12")])
    config = DataConfig(
        max_prompt_length=4, truncation="middle", filter_overlong_prompts=False, apply_chat_template="auto"
    )
    dataset = RLDataset.from_config(config, [path], char_tokenizer, cache_dir=cache_dir)
    assert char_tokenizer.decode(dataset[0]["input_ids"]) == "0189"


def test_measured_lengths_match_fetched_ids_with_a_bos_adding_tokenizer(
    tmp_path: Path, cache_dir: str
) -> None:
    # The length pass asks the Rust backend directly; fetching goes through transformers. A
    # tokenizer whose post-processor adds BOS must count the same in both.
    tokenizer = train_bpe_tokenizer(["3+4=7 and some words"] * 20, 270, tmp_path / "tok")
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tokenizer.bos_token_id)]
    )
    contents = ["3+4=", "some words and 3+4=7", "x"]
    path = write_rows(tmp_path / "b.parquet", [row(c) for c in contents])
    dataset = RLDataset(path, tokenizer, max_prompt_length=64, cache_dir=cache_dir)
    fetched = [dataset[i]["input_ids"] for i in range(3)]
    assert all(ids[0] == tokenizer.bos_token_id for ids in fetched)
    assert dataset.prompt_lengths.tolist() == [len(ids) for ids in fetched]
