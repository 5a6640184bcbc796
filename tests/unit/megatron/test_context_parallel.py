"""Context-parallel index arithmetic against hand-worked examples, the token budget per CP rank and
the errors of invalid CP layouts (the local spec's attention: test_local_attention.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from megarl.errors import ConfigError
from megarl.megatron.context_parallel import (
    SequenceShard,
    gathered_positions,
    packed_gathered_positions,
    packed_shard_index,
    padded_length,
    shard_index,
)
from megarl.megatron.packing import CompactRows, pack_rows, packed_seq_ids, plan_micro_batches
from megarl.layout import ParallelLayout

pytestmark = pytest.mark.unit


def test_split_keeps_chunks_r_and_2cp_minus_1_minus_r() -> None:
    # width 8, cp 2: four chunks of 2 -> rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2.
    assert shard_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert shard_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    # width 12, cp 3: six chunks of 2 -> (0, 5), (1, 4), (2, 3).
    assert shard_index(12, 3, 0).tolist() == [0, 1, 10, 11]
    assert shard_index(12, 3, 1).tolist() == [2, 3, 8, 9]
    assert shard_index(12, 3, 2).tolist() == [4, 5, 6, 7]
    assert gathered_positions(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert shard_index(5, 1, 0).tolist() == [0, 1, 2, 3, 4]  # no CP: everything, in order
    with pytest.raises(ValueError, match="multiple of 2\\*cp = 4"):
        shard_index(6, 2, 0)


def test_padding_to_a_multiple_of_2cp() -> None:
    assert [padded_length(n, 2) for n in (1, 4, 5, 8, 9)] == [4, 4, 8, 8, 12]
    assert [padded_length(n, 3) for n in (5, 6, 7)] == [6, 6, 12]
    assert padded_length(5, 1) == 5


def test_merge_restores_global_order() -> None:
    """What SequenceShard.gather does after its all-gather: concatenating the ranks' local shards
    (rank order) and reordering by `gathered` gives back the sequence."""
    for width, cp in ((8, 2), (12, 3), (16, 4)):
        x = torch.arange(width) * 10
        shards = [SequenceShard.contiguous(width, cp, r) for r in range(cp)]
        concatenated = torch.cat([s.local(x.unsqueeze(0))[0] for s in shards])
        assert torch.equal(concatenated, x[shards[0].gathered])
        assert torch.equal(concatenated[torch.argsort(shards[0].gathered)], x)


def test_packed_split_is_per_sequence() -> None:
    # Two sequences padded to 4 and 8 (cp 2): chunks of 1 and of 2 tokens.
    # seq 0 at 0..3: rank 0 keeps {0, 3}, rank 1 {1, 2}; seq 1 at 4..11: rank 0 {4,5,10,11}, rank 1 {6..9}.
    lengths = torch.tensor([4, 8])
    assert packed_shard_index(lengths, 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    assert packed_shard_index(lengths, 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    gathered = packed_gathered_positions(lengths, 2)
    assert sorted(gathered.tolist()) == list(range(12))
    shard = SequenceShard.per_sequence(lengths, 2, 1)
    assert shard.width == 12 and shard.local(torch.arange(12).unsqueeze(0)).tolist() == [[1, 2, 6, 7, 8, 9]]


def test_pack_rows_pads_each_row_for_thd_context_parallel() -> None:
    rows = CompactRows(torch.tensor([[5, 6, 7, 0, 0], [1, 2, 3, 4, 9]]), torch.tensor([1, 2]),
                       torch.tensor([3, 5]), response_len=3)
    packed = pack_rows(rows, with_mask=False, align=4)
    assert packed.tokens.tolist() == [[5, 6, 7, 0, 1, 2, 3, 4, 9, 0, 0, 0]]
    assert packed.offsets.tolist() == [0, 4] and packed.padded_lengths.tolist() == [4, 8]
    assert packed.cu_seqlens.tolist() == [0, 4, 12]
    assert packed_seq_ids(packed, 14).tolist() == [0] * 4 + [1] * 8 + [-1, -1]
    plain = pack_rows(rows)
    assert plain.tokens.tolist() == [[5, 6, 7, 1, 2, 3, 4, 9]] and plain.cu_seqlens.tolist() == [0, 3, 8]


def test_token_budget_is_per_cp_rank() -> None:
    lengths = torch.tensor([5, 3, 3, 2])
    # cp 1: a budget of 4 cannot hold the 5-token row.
    with pytest.raises(ConfigError, match="at least 5"):
        plan_micro_batches(lengths, max_tokens=4)
    # cp 2, padded: a row of 5 pads to 8, 4 per rank; rows of 3 pad to 4, 2 per rank each.
    plans = plan_micro_batches(lengths, max_tokens=4, cp=2)
    assert [p.tolist() for p in plans] == [[0], [1, 2], [3]]
    # cp 2, packed as one row: 5+3+3 = 11 pads to 12 (6 per rank); adding the 2 makes 16 (8): two
    # micro-batches, re-split balanced as 5+2 and 3+3 (each pads to 8, 4 per rank).
    plans = plan_micro_batches(lengths, max_tokens=6, packed=True, cp=2)
    assert [p.tolist() for p in plans] == [[0, 3], [1, 2]]
    # cp 2, THD (each row padded): 8+4 = 12 (6 per rank); 8+4+4 = 16 (8) closes the micro-batch;
    # re-split balanced: 8+4 (the rows of 5 and 2) and 4+4, 6 and 4 per rank.
    plans = plan_micro_batches(lengths, max_tokens=6, packed=True, cp=2, pad_each=True)
    assert [p.tolist() for p in plans] == [[0, 3], [1, 2]]
    with pytest.raises(ConfigError, match="6 per rank at context parallel size 2\\); raise it to at least 6"):
        plan_micro_batches(torch.tensor([9]), max_tokens=4, cp=2)


def test_invalid_cp_layouts_are_refused() -> None:
    with pytest.raises(ConfigError, match="not divisible by tp\\*pp\\*cp = 1\\*1\\*3 = 3"):
        ParallelLayout(cp=3).resolved(2)
    with pytest.raises(ConfigError, match="cp=0 must be >= 1"):
        ParallelLayout(cp=0).resolved(2)
    assert ParallelLayout(cp=2).resolved(4).dp == 2


CONFIG = {
    "data": {"train_files": ["train.parquet"], "train_batch_size": 8, "max_prompt_length": 32,
             "max_response_length": 16},
    "model": {"hf_config": {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "num_hidden_layers": 4, "intermediate_size": 128,
                            "vocab_size": 64, "max_position_embeddings": 128}},
    "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2,
              "megatron": {"context_parallel_size": 2}},
    "rollout": {"n": 4},
    "resources": {"actor_pool": {"nnodes": 1, "devices_per_node": 4}},
}


# Micro-batches by tokens: CONFIG's sequence count goes (back to its default), as nothing reads it then.
DYNAMIC = ("actor.use_dynamic_bsz=true", "actor.ppo_micro_batch_size_per_gpu=4")


def _load(tmp_path: Path, *overrides: str) -> object:
    from megarl.config import load_config

    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return load_config(path, list(overrides))


def test_config_accepts_cp_and_checks_layout_and_budget(tmp_path: Path) -> None:
    cfg = _load(tmp_path)
    assert cfg.actor.megatron.context_parallel_size == 2  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="TP x PP x CP = 1 x 1 x 3 = 3 does not divide the 4 devices"):
        _load(tmp_path, "actor.megatron.context_parallel_size=3")
    # 32 + 16 = 48 tokens: 24 positions per rank at CP 2, 12 at CP 4.
    _load(tmp_path, *DYNAMIC, "actor.ppo_max_token_len_per_gpu=24")
    with pytest.raises(ConfigError, match="context_parallel_size = 2, 24 positions per rank\\); set it to at least 24"):
        _load(tmp_path, *DYNAMIC, "actor.ppo_max_token_len_per_gpu=20")
    _load(tmp_path, *DYNAMIC, "actor.ppo_max_token_len_per_gpu=12",
          "actor.megatron.context_parallel_size=4")
    # The reference's pass splits by the actor's budget, at the reference's own layout.
    ref = ("ref.enable=true", "ref.megatron.context_parallel_size=1", "resources.ref_pool.nnodes=1",
           "resources.ref_pool.devices_per_node=2")
    with pytest.raises(ConfigError, match="48 tokens in the reference's layout \(ref.megatron\)\); set it to at "
                                          "least 48"):
        _load(tmp_path, *DYNAMIC, "actor.ppo_max_token_len_per_gpu=24", *ref)
    _load(tmp_path, *DYNAMIC, "actor.ppo_max_token_len_per_gpu=48", *ref)


def _inputs(use_te: bool, cp_rank: int, cp: int = 2, seq_multiple: int = 4, packed: bool = True,
            rows: CompactRows | None = None) -> dict:
    """The engine's input builder for a micro-batch of two rows (3 and 5 tokens), packed or padded.
    It reads only the layout, the TE flag, the sequence multiple (2*cp, times tp under sequence
    parallelism) and the device from the engine."""
    from types import SimpleNamespace

    from megarl.megatron.engine import MegatronEngine

    if rows is None:
        rows = CompactRows(torch.tensor([[5, 6, 7, 0, 0], [1, 2, 3, 4, 9]]), torch.tensor([1, 2]),
                           torch.tensor([3, 5]), response_len=3)
    engine = SimpleNamespace(ranks=SimpleNamespace(cp_size=cp, cp_rank=cp_rank), use_te=use_te,
                             device=torch.device("cpu"), seq_multiple=seq_multiple)
    build = MegatronEngine._packed_inputs if packed else MegatronEngine._padded_inputs
    return build(engine, rows)  # type: ignore[arg-type]


def test_thd_inputs_for_transformer_engine_split_each_sequence() -> None:
    # Rows padded to 4 and 8: [5 6 7 0 | 1 2 3 4 9 0 0 0]; rank 1 keeps {1, 2} of the first and
    # positions {6, 7, 8, 9} of the packed row (chunks 1 and 2 of the second row, 2 tokens each).
    out = _inputs(use_te=True, cp_rank=1)
    assert out["tokens"].tolist() == [[6, 7, 3, 4, 9, 0]]
    assert out["positions"].tolist() == [[1, 2, 2, 3, 4, 5]]  # positions within each row
    assert out["targets"].tolist() == [[7, 0, 4, 9, 0, 0]]
    assert out["attention_mask"] is None
    params = out["packed_seq_params"]
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 4, 12]
    assert params.cu_seqlens_q_padded.tolist() == [0, 4, 12] and params.max_seqlen_q == 8


def test_local_packed_inputs_mask_gathered_keys_by_row_and_global_position() -> None:
    # Packed row [5 6 7 | 1 2 3 4 9] (width 8): rank 0 keeps positions 0, 1, 6, 7; keys arrive in
    # gathered order 0 1 6 7 2 3 4 5.
    out = _inputs(use_te=False, cp_rank=0)
    assert out["tokens"].tolist() == [[5, 6, 4, 9]] and "packed_seq_params" not in out
    mask = out["attention_mask"][0, 0]
    assert mask.shape == (4, 8)
    keys = [0, 1, 6, 7, 2, 3, 4, 5]
    row = [0, 0, 0, 1, 1, 1, 1, 1]
    for i, q in enumerate([0, 1, 6, 7]):
        for j, k in enumerate(keys):
            assert bool(mask[i, j]) == (not (row[q] == row[k] and k <= q)), (q, k)


def test_sequence_parallel_pads_at_the_end_to_the_sequence_multiple() -> None:
    # cp=1, tp=2 with sequence parallelism: the padded micro-batch (width 5) and the packed row
    # (8 tokens + 0) grow to even lengths; the padding is zeros after every real token.
    padded = _inputs(use_te=False, cp_rank=0, cp=1, seq_multiple=2, packed=False)
    assert padded["tokens"].tolist() == [[5, 6, 7, 0, 0, 0], [1, 2, 3, 4, 9, 0]]
    assert padded["positions"].tolist() == [list(range(6))] * 2
    packed = _inputs(use_te=False, cp_rank=0, cp=1, seq_multiple=2)
    assert packed["tokens"].tolist() == [[5, 6, 7, 1, 2, 3, 4, 9]]  # already even: no padding
    odd = CompactRows(torch.tensor([[5, 6, 7, 0, 0], [1, 2, 3, 4, 0]]), torch.tensor([1, 2]),
                      torch.tensor([3, 4]), response_len=2)
    out = _inputs(use_te=False, cp_rank=0, cp=1, seq_multiple=2, rows=odd)
    assert out["tokens"].tolist() == [[5, 6, 7, 1, 2, 3, 4, 0]]
    mask = out["attention_mask"][0, 0]
    # Real tokens never see the pad (it comes last and belongs to no row); the pad sees only itself.
    assert bool(mask[:7, 7].all()) and mask[7].tolist() == [True] * 7 + [False]
    # cp=2, tp=2: a multiple of 2*cp*tp = 8; each CP rank keeps 4 positions, 2 per TP rank.
    cp_sp = _inputs(use_te=False, cp_rank=1, cp=2, seq_multiple=8, packed=False)
    assert cp_sp["tokens"].shape == (2, 4) and cp_sp["cp_shard"].width == 8
