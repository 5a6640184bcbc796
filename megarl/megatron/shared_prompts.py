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

from megarl.megatron.packing import CompactRows

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
    cpu_tokens = rows.tokens.cpu()
    prompt_lens = rows.prompt_lens.cpu()
    response_lens = rows.total_lens.cpu() - prompt_lens
    b, r, width = len(prompt_lens), rows.response_len, cpu_tokens.shape[1]
    # Rows in group order; each row's group, and where its response starts in the group's sequence:
    # the prompt, then the responses of the group's earlier members.
    order = torch.tensor([i for members in groups for i in members], dtype=torch.long)
    sizes = torch.tensor([len(members) for members in groups], dtype=torch.long)
    group_of = torch.empty(b, dtype=torch.long)
    group_of[order] = torch.repeat_interleave(torch.arange(len(groups)), sizes)
    ordered = response_lens[order]
    before = ordered.cumsum(0) - ordered  # response tokens of the rows before, over all groups
    first = sizes.cumsum(0) - sizes  # each group's first position in `order`
    start = torch.empty(b, dtype=torch.long)
    start[order] = prompt_lens[order] + before - before[first].repeat_interleave(sizes)
    s = int((start + response_lens).max())  # a group's last member ends its sequence
    # The prompts: each group's first member's prompt tokens.
    heads = torch.tensor([members[0] for members in groups], dtype=torch.long)
    column = torch.arange(s)
    in_prompt = column.unsqueeze(0) < prompt_lens[heads].unsqueeze(1)  # (G, S)
    tokens = torch.zeros((len(groups), s), dtype=torch.long)
    tokens[:, :min(s, width)] = cpu_tokens[heads, :min(s, width)]
    tokens = torch.where(in_prompt, tokens, 0)
    positions = torch.where(in_prompt, column, 0)
    owner = torch.where(in_prompt, PROMPT, PADDING)
    # The responses: token t of row i goes to column start_i + t of its group's sequence.
    t = torch.arange(r).unsqueeze(0)
    valid = t < response_lens.unsqueeze(1)  # (b, R)
    rows_at, t_at = valid.nonzero(as_tuple=True)
    dest = (group_of[rows_at], start[rows_at] + t_at)
    response_tokens = cpu_tokens[rows_at, prompt_lens[rows_at] + t_at]
    tokens[dest] = response_tokens
    positions[dest] = prompt_lens[rows_at] + t_at
    owner[dest] = rows_at
    head_group = group_of.unsqueeze(1).expand(b, r).clone()
    # token 0 from the prompt's last position, token t from the response's token t-1
    head_pos = torch.where((t >= 1) & valid, start.unsqueeze(1) + t - 1, (prompt_lens - 1).unsqueeze(1))
    targets = torch.zeros((b, r), dtype=torch.long)
    targets[rows_at, t_at] = response_tokens
    query, key = owner.unsqueeze(2), owner.unsqueeze(1)
    causal = torch.ones((s, s), dtype=torch.bool).tril()
    visible = causal & (((key == PROMPT) & (query != PADDING)) | (key == query)) & (key != PADDING)
    visible |= torch.eye(s, dtype=torch.bool)  # padding sees itself: every query sees a key
    return SharedPromptRows(
        tokens=tokens.to(device), positions=positions.to(device), mask=(~visible).unsqueeze(1).to(device),
        head=(head_group.to(device), head_pos.to(device)), targets=targets.to(device),
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
