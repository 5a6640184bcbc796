"""A tensor split into pieces that do not cover it: refused when converting (the Qwen2-MoE shared
expert at a TP that does not divide its width) and when reading (a checkpoint whose chunks leave a
gap), instead of writing an incomplete checkpoint or reading uninitialised memory back."""

from __future__ import annotations

import dataclasses
import pickle
import re
from pathlib import Path

import pytest
import torch
import transformers
from tiny_hf import read_all, save_model

from megarl.convert.dcp_io import CheckpointReader, Chunk, write_checkpoint
from megarl.convert.hf_files import HFCheckpoint, expected_hf_shapes, read_config
from megarl.convert.hf_to_mcore import _chunks_of, _FusedCache, convert_hf_to_mcore
from megarl.convert.layout import plan_checkpoint
from megarl.convert.mcore_to_hf import convert_mcore_to_hf
from megarl.errors import CheckpointError, ConfigError
from megarl.models.spec import ModelSpec


def _qwen2_moe(path: Path, shared: int) -> Path:
    """4 query and 4 key/value heads, experts of width 32, dense width 96: tp=4 divides all of them."""
    config = transformers.Qwen2MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=shared)
    torch.manual_seed(0)
    return save_model(transformers.Qwen2MoeForCausalLM(config).eval(), path)


def _no_output(out: Path) -> None:
    assert not out.exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_a_tp_that_does_not_divide_the_shared_expert_is_refused(tmp_path: Path) -> None:
    src = _qwen2_moe(tmp_path / "hf", shared=50)
    with pytest.raises(ConfigError, match=r"qwen2_moe: tp=4 must divide shared_expert_intermediate_size=50; "
                                          r"valid tp: 1, 2, 5, 10, 25, 50$"):
        convert_hf_to_mcore(src, tmp_path / "mc", tp=4, progress=False)
    _no_output(tmp_path / "mc")
    # tp=2 divides 50: the shared expert comes back bit-exact.
    convert_hf_to_mcore(src, tmp_path / "mc", tp=2, progress=False)
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "back", progress=False)
    want, got = read_all(src), read_all(tmp_path / "back")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_chunks_that_would_not_cover_a_tensor_are_refused(tmp_path: Path) -> None:
    """`_chunks_of` on its own (a caller that skipped the layout check): [64, 50] does not split in 4
    pieces, nor the fused gate/up [100, 64] in 8."""
    src = _qwen2_moe(tmp_path / "hf", shared=50)
    spec = ModelSpec.from_hf_config(src)
    plan = plan_checkpoint(spec, "policy", expected_hf_shapes(read_config(src)), tp=4)
    by_key = {t.key: t for t in plan}
    hf = HFCheckpoint(src)
    fc2 = by_key["decoder.layers.mlp.shared_experts.linear_fc2.weight"]
    with pytest.raises(ConfigError, match=r"shared_experts\.linear_fc2\.weight: dim 1 of its per-layer shape \[64, 50\] "
                                          r"does not split into 4 equal pieces \(tp=4\); valid tp: a divisor of 50"):
        _chunks_of(fc2, hf, spec, 4, None, _FusedCache())
    fc1 = by_key["decoder.layers.mlp.shared_experts.linear_fc1.weight"]
    with pytest.raises(ConfigError, match=r"linear_fc1\.weight: dim 0 of its per-layer shape \[100, 64\] does not "
                                          r"split into 8 equal pieces \(tp=4\); valid tp: a divisor of 50"):
        _chunks_of(fc1, hf, spec, 4, None, _FusedCache())
    # What does split is cut into equal pieces covering the tensor: 2 layers x 2 ranks x (gate, up).
    fc1_tp2 = plan_checkpoint(spec, "policy", expected_hf_shapes(read_config(src)), tp=2)
    chunks = _chunks_of(next(t for t in fc1_tp2 if t.key == fc1.key), hf, spec, 2, None, _FusedCache())
    assert [(c.offsets, c.sizes) for c in chunks] == [
        ((layer, row, 0), (1, 25, 64)) for layer in (0, 1) for row in (0, 25, 50, 75)]


def _hand_written(directory: Path) -> torch.Tensor:
    """A checkpoint holding rows 0-1 of a (4, 6) tensor `w` (rows 2-3 stored by no chunk) and a
    complete (2, 3) tensor `full`."""
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    directory.mkdir()
    write_checkpoint(directory, [
        Chunk("w", (4, 6), (0, 0), (2, 6), torch.float32, lambda: w[:2].clone()),
        Chunk("full", (2, 3), (0, 0), (2, 3), torch.float32, lambda: torch.ones(2, 3)),
    ], {})
    return w


def test_reading_a_box_the_chunks_do_not_cover_is_refused(tmp_path: Path) -> None:
    w = _hand_written(tmp_path / "ck")
    reader = CheckpointReader(tmp_path / "ck")
    assert torch.equal(reader.read("full"), torch.ones(2, 3))
    assert torch.equal(reader.read("w", (0, 0), (2, 6)), w[:2])  # what is stored still reads
    assert torch.equal(reader.read("w", (1, 2), (1, 3)), torch.tensor([[8.0, 9.0, 10.0]]))
    index = tmp_path / "ck" / ".metadata"
    with pytest.raises(CheckpointError) as err:
        reader.read("w")
    assert str(err.value).startswith(f"{index}: tensor w is stored incompletely: its chunks (in ['__0_0.distcp']) "
                                     "hold 12 of the 24 elements;")
    with pytest.raises(CheckpointError, match=r"hold 6 of the 12 elements in the box at \[1, 0\] of size \[2, 6\]"):
        reader.read("w", (1, 0), (2, 6))
    with pytest.raises(CheckpointError, match=r"hold 0 of the 6 elements in the box at \[3, 0\]"):
        reader.read("w", (3, 0), (1, 6))


def test_an_export_of_a_checkpoint_missing_a_chunk_is_refused(tmp_path: Path) -> None:
    """A converted checkpoint whose index lost one chunk (layer 1's second TP piece of linear_fc2)."""
    src = _qwen2_moe(tmp_path / "hf", shared=48)
    convert_hf_to_mcore(src, tmp_path / "mc", tp=2, progress=False)
    index = tmp_path / "mc" / ".metadata"
    metadata = pickle.loads(index.read_bytes())
    key = "decoder.layers.mlp.shared_experts.linear_fc2.weight"
    md = metadata.state_dict_metadata[key]
    assert [tuple(c.offsets) for c in md.chunks] == [(0, 0, 0), (0, 0, 24), (1, 0, 0), (1, 0, 24)]
    metadata.state_dict_metadata[key] = dataclasses.replace(md, chunks=md.chunks[:3])
    index.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=rf"\.metadata: tensor {re.escape(key)} is stored incompletely: .* hold "
                                              r"1536 of the 3072 elements in the box at \[1, 0, 0\] of size \[1, 64, 48\]"):
        convert_mcore_to_hf(tmp_path / "mc", tmp_path / "back", progress=False)
    _no_output(tmp_path / "back")
