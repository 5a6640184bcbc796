"""Shared-prompt layout (`megarl.megatron.shared_prompts`), worked by hand on a 3-row micro-batch."""

from __future__ import annotations

import pytest
import torch

from megarl.megatron.packing import compact_rows
from megarl.megatron.shared_prompts import prompt_groups, share_prompts, sharing_pays

pytestmark = pytest.mark.unit


def rows_of(prompts: list[list[int]], responses: list[list[int]], prompt_w: int = 3, response_w: int = 3):
    ids = torch.zeros(len(prompts), prompt_w + response_w, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, prompt_w - len(p):prompt_w] = torch.tensor(p)
        mask[i, prompt_w - len(p):prompt_w] = 1
        ids[i, prompt_w:prompt_w + len(r)] = torch.tensor(r)
        mask[i, prompt_w:prompt_w + len(r)] = 1
    return compact_rows(ids, mask, response_w)


def test_layout_of_two_rows_sharing_a_prompt_and_one_alone() -> None:
    # rows 0 and 2 share prompt [5, 6]; row 1's prompt [6] is another prompt
    rows = rows_of([[5, 6], [6], [5, 6]], [[7, 8], [9, 9, 9], [4]])
    groups = prompt_groups(rows)
    assert groups == [[0, 2], [1]]
    shared = share_prompts(rows, groups)
    # sequence 0: 5 6 | 7 8 | 4 ; sequence 1: 6 | 9 9 9, padded to 5
    assert shared.tokens.tolist() == [[5, 6, 7, 8, 4], [6, 9, 9, 9, 0]]
    assert shared.positions.tolist() == [[0, 1, 2, 3, 2], [0, 1, 2, 3, 0]]
    visible = (~shared.mask[:, 0]).int().tolist()
    assert visible[0] == [[1, 0, 0, 0, 0],
                          [1, 1, 0, 0, 0],
                          [1, 1, 1, 0, 0],
                          [1, 1, 1, 1, 0],
                          [1, 1, 0, 0, 1]]  # row 2's response sees the prompt and itself only
    assert visible[1][4] == [0, 0, 0, 0, 1]  # padding sees only itself
    group, position = shared.head
    # row 0: token 7 from position 1 (the prompt's last), token 8 from position 2; row 2: token 4 from 1
    assert group[0].tolist() == [0, 0, 0] and position[0].tolist()[:2] == [1, 2]
    assert group[2].tolist()[0] == 0 and position[2].tolist()[0] == 1
    assert group[1].tolist() == [1, 1, 1] and position[1].tolist() == [0, 1, 2]
    assert shared.targets.tolist() == [[7, 8, 0], [9, 9, 9], [4, 0, 0]]


def test_a_row_with_an_empty_response_adds_no_tokens() -> None:
    # row 1 shares row 0's prompt and has no response token: the sequence is the one of row 0 alone
    rows = rows_of([[5, 6], [5, 6]], [[7, 8], []])
    shared = share_prompts(rows, prompt_groups(rows))
    assert shared.tokens.tolist() == [[5, 6, 7, 8]]
    assert shared.positions.tolist() == [[0, 1, 2, 3]]
    # every head index of the empty row points at the prompt's last position (its outputs are masked)
    assert shared.head[0][1].tolist() == [0, 0, 0] and shared.head[1][1].tolist() == [1, 1, 1]
    assert shared.head[1][0].tolist() == [1, 2, 1]  # row 0: prompt's last, then its own first token


def test_sharing_pays_for_short_responses_not_for_long_ones() -> None:
    # 8 responses to one 4-token prompt, hidden 256 (a quickstart-sized layer: ~590k parameters)
    short = rows_of([[1, 2, 3, 4]] * 8, [[5] * 4] * 8, prompt_w=4, response_w=4)
    assert sharing_pays(short, prompt_groups(short), layer_params=590_000, attention_width=256)
    # 64-token responses: the one 516-token sequence's dense attention costs more than 28 prompt tokens
    long = rows_of([[1, 2, 3, 4]] * 8, [[5] * 64] * 8, prompt_w=4, response_w=64)
    assert not sharing_pays(long, prompt_groups(long), layer_params=590_000, attention_width=256)
    # nothing shared: never
    alone = rows_of([[1], [2]], [[5], [5]])
    assert not sharing_pays(alone, prompt_groups(alone), layer_params=590_000, attention_width=256)
