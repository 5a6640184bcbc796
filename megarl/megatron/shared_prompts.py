"""Micro-batches whose rows share a prompt compute the prompt once (`model.prompt_sharing`).

GRPO-style batches hold n responses to each prompt. In the usual layout every row repeats its
prompt, so the prompt's tokens go through the model n times with identical results. Here the rows
of a micro-batch that start with the same prompt become one sequence, the prompt followed by each
response in turn:

    [p0 p1 p2 | a0 a1 a2 | b0 b1 | c0 c1 c2]     positions 0 1 2 | 3 4 5 | 3 4 | 3 4 5

A response token sees the prompt and the earlier tokens of its own response, nothing of the other
responses; its rotary position is the one it has in its own row. Every output the loss reads is
therefore the one the row would give alone, and so is the gradient: the prompt's hidden states
receive the sum of what each response sends back, as they do when the prompt is repeated. The
output that predicts the first token of each response is the same one (the prompt's last
position); each response reads it against its own first token.

The attention is a dense masked product over each sequence (`LocalAttention` with an explicit
mask), so sharing pays when the prompt tokens saved cost more than the longer sequences'
attention: `sharing_pays` compares both with a count of multiply-adds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megarl.megatron.packing import CompactRows, response_index

PROMPT = -1  # owner of a prompt position (a response position holds its row's index)
PADDING = -2


@dataclass
class SharedPromptRows:
    """One sequence per distinct prompt of a micro-batch (see module doc).

    tokens, positions: (G, S) int64; `positions` are the rotary positions each token has in its own
    row. mask: (G, 1, S, S) bool, True = not visible (Megatron's convention). head: (group (b, R),
    position (b, R)) of the output that predicts response token t of row i; response padding points
    at the prompt's last position (callers mask it). targets: (b, R) the response tokens (0 on
    padding).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    head: tuple[torch.Tensor, torch.Tensor]
    targets: torch.Tensor


def prompt_groups(rows: CompactRows) -> list[list[int]]:
    """Row indices grouped by equal prompt tokens, groups in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (prompt_len, tokens) in enumerate(zip(rows.prompt_lens.tolist(), rows.tokens.tolist())):
        groups.setdefault(tuple(tokens[:prompt_len]), []).append(i)
    return list(groups.values())


def sequence_lengths(rows: CompactRows, groups: list[list[int]]) -> list[int]:
    """Length of each group's shared sequence: its prompt, then every member's response."""
    prompt_lens = rows.prompt_lens.tolist()
    response_lens = (rows.total_lens - rows.prompt_lens).tolist()
    return [prompt_lens[g[0]] + sum(response_lens[i] for i in g) for g in groups]


def share_prompts(rows: CompactRows, groups: list[list[int]]) -> SharedPromptRows:
    """The shared layout of `rows` for `groups` (`prompt_groups`)."""
    device = rows.tokens.device
    prompt_lens = rows.prompt_lens.tolist()
    response_lens = (rows.total_lens - rows.prompt_lens).tolist()
    b, r, s = len(prompt_lens), rows.response_len, max(sequence_lengths(rows, groups))
    tokens = torch.zeros((len(groups), s), dtype=torch.long)
    positions = torch.zeros((len(groups), s), dtype=torch.long)
    owner = torch.full((len(groups), s), PADDING, dtype=torch.long)
    head_group = torch.zeros((b, r), dtype=torch.long)
    head_pos = torch.zeros((b, r), dtype=torch.long)
    cpu_tokens = rows.tokens.cpu()
    for g, members in enumerate(groups):
        p = prompt_lens[members[0]]
        tokens[g, :p] = cpu_tokens[members[0], :p]
        positions[g, :p] = torch.arange(p)
        owner[g, :p] = PROMPT
        start = p
        for i in members:
            n = response_lens[i]
            tokens[g, start:start + n] = cpu_tokens[i, p:p + n]
            positions[g, start:start + n] = torch.arange(p, p + n)
            owner[g, start:start + n] = i
            head_group[i] = g
            # token 0 from the prompt's last position, token t from the response's token t-1
            head_pos[i] = p - 1
            head_pos[i, 1:n] = torch.arange(start, start + n - 1)
            start += n
    index, valid = response_index(rows)  # the position predicting token t; the token is one further on
    next_index = (index + 1).clamp(max=rows.tokens.shape[1] - 1)
    targets = torch.where(valid, rows.tokens.gather(1, next_index), torch.zeros_like(next_index))
    query, key = owner.unsqueeze(2), owner.unsqueeze(1)
    causal = torch.ones((s, s), dtype=torch.bool).tril()
    visible = causal & (((key == PROMPT) & (query != PADDING)) | (key == query)) & (key != PADDING)
    visible |= torch.eye(s, dtype=torch.bool)  # padding sees itself: every query sees a key
    return SharedPromptRows(
        tokens=tokens.to(device), positions=positions.to(device), mask=(~visible).unsqueeze(1).to(device),
        head=(head_group.to(device), head_pos.to(device)), targets=targets,
    )


def sharing_pays(rows: CompactRows, groups: list[list[int]], layer_params: int, attention_width: int) -> bool:
    """Whether the shared layout costs fewer multiply-adds per layer than the padded one.

    Per token a layer's matrices cost about `layer_params`; attention costs `attention_width`
    (heads x head dim) per query-key pair for the scores and as much again for the values. The padded
    layout (b rows of the longest row's width T, causal: about half the pairs) against the shared
    one (G sequences of the longest sequence's width S, an explicit mask: every pair).
    """
    if len(groups) == len(rows.prompt_lens):
        return False  # no prompt is shared
    b, width = rows.tokens.shape
    s = max(sequence_lengths(rows, groups))
    padded = b * width * layer_params + b * width * width * attention_width
    shared = len(groups) * s * layer_params + 2 * len(groups) * s * s * attention_width
    return shared < padded
