"""Bad input gives a clear error naming the file/tensor, and leaves no output directory behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_hf import make_model, save_model

from megarl.convert.hf_files import HFCheckpoint
from megarl.convert.hf_to_mcore import convert_hf_to_mcore
from megarl.convert.mcore_to_hf import convert_mcore_to_hf
from megarl.errors import CheckpointError, ConfigError


def _no_output(out: Path) -> None:
    assert not out.exists(), f"{out} exists after a failed conversion"
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert not leftovers, f"staging directories left behind: {leftovers}"


@pytest.fixture(scope="module")
def sharded_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_model(make_model("qwen2", seed=0), tmp_path_factory.mktemp("src") / "hf", max_shard_size="60KB")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_shard_file(sharded_hf: Path, tmp_path: Path) -> None:
    hf = _copy(sharded_hf, tmp_path / "hf")
    shard = sorted(hf.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"shard file\(s\) \['{shard.name}'\].*missing"):
        convert_hf_to_mcore(hf, tmp_path / "out", progress=False)
    _no_output(tmp_path / "out")


def test_partial_shard_lacking_a_tensor(sharded_hf: Path, tmp_path: Path) -> None:
    hf = _copy(sharded_hf, tmp_path / "hf")
    shard = sorted(hf.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=dropped.replace(".", r"\.")):
        convert_hf_to_mcore(hf, tmp_path / "out", progress=False)
    _no_output(tmp_path / "out")


def test_truncated_safetensors(tmp_path: Path) -> None:
    hf = save_model(make_model("llama", seed=0), tmp_path / "hf")
    data = (hf / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated safetensors file"):
        convert_hf_to_mcore(hf, tmp_path / "out", progress=False)
    (hf / "model.safetensors").write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        HFCheckpoint(hf)
    _no_output(tmp_path / "out")


def test_tensor_with_wrong_shape(tmp_path: Path) -> None:
    hf = save_model(make_model("llama", seed=0), tmp_path / "hf")
    tensors = load_file(hf / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = torch.zeros(16, 64)  # the config needs 2 kv heads x 16 = 32 rows
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', r'[.]')} has shape \[16, 64\], the model config needs \[32, 64\]"):
        convert_hf_to_mcore(hf, tmp_path / "out", progress=False)
    _no_output(tmp_path / "out")


def test_unknown_architecture(tmp_path: Path) -> None:
    hf = save_model(make_model("llama", seed=0), tmp_path / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"unsupported architecture model_type='gpt2'.*supported families: .*llama"):
        convert_hf_to_mcore(hf, tmp_path / "out", progress=False)
    _no_output(tmp_path / "out")


def test_missing_config_and_bad_layouts(tmp_path: Path) -> None:
    hf = save_model(make_model("llama", seed=0), tmp_path / "hf")
    with pytest.raises(ConfigError, match="tp=3 must divide num_attention_heads=4"):
        convert_hf_to_mcore(hf, tmp_path / "out", tp=3, progress=False)
    with pytest.raises(ConfigError, match="pp=4 must divide num_hidden_layers=2"):
        convert_hf_to_mcore(hf, tmp_path / "out", pp=4, progress=False)
    with pytest.raises(ConfigError, match="--ep 2: the llama family has no experts"):
        convert_hf_to_mcore(hf, tmp_path / "out", ep=2, progress=False)
    with pytest.raises(ConfigError, match="--dtype = 'int8': must be one of"):
        convert_hf_to_mcore(hf, tmp_path / "out", dtype="int8", progress=False)
    (hf / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        convert_hf_to_mcore(hf, tmp_path / "out", progress=False)
    _no_output(tmp_path / "out")


def test_existing_output_directory(tmp_path: Path) -> None:
    hf = save_model(make_model("llama", seed=0), tmp_path / "hf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists"):
        convert_hf_to_mcore(hf, out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    convert_hf_to_mcore(hf, out, overwrite=True, progress=False)
    assert (out / "metadata.json").exists() and not (out / "keep.txt").exists()
    with pytest.raises(CheckpointError, match="already exists"):
        convert_mcore_to_hf(out, hf, progress=False)


def test_failure_while_writing_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read error half-way through the write (e.g. the disk goes away) removes the partial output."""
    hf = save_model(make_model("llama", seed=0), tmp_path / "hf")
    calls = {"n": 0}
    real_read = HFCheckpoint.read

    def failing_read(self: HFCheckpoint, names: object) -> dict:
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("injected read failure")
        return real_read(self, names)  # type: ignore[arg-type]

    monkeypatch.setattr(HFCheckpoint, "read", failing_read)
    with pytest.raises(OSError, match="injected"):
        convert_hf_to_mcore(hf, tmp_path / "out", progress=False)
    assert calls["n"] == 5
    _no_output(tmp_path / "out")


def test_mcore_side_errors(tmp_path: Path) -> None:
    hf = save_model(make_model("llama", seed=0), tmp_path / "hf")
    convert_hf_to_mcore(hf, tmp_path / "mcore", progress=False)
    # A config of another size is not the stored one: the field and both values are named.
    other = save_model(make_model("llama", seed=0, layers=3), tmp_path / "other")
    with pytest.raises(ConfigError, match=r"other/config\.json describes another model .*num_hidden_layers=3, stored 2"):
        convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", hf_config=other, progress=False)
    _no_output(tmp_path / "back")
    # Without a stored config to compare with, the shapes do not fit: the key and both shapes are named.
    common = torch.load(tmp_path / "mcore" / "common.pt", weights_only=False)
    del common["megarl"]["hf_config"]
    torch.save(common, tmp_path / "mcore" / "common.pt")
    with pytest.raises(CheckpointError, match=r"tensor decoder\.layers\.\S+ has shape \[2, 64\], the model config needs \[3, 64\]"):
        convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", hf_config=other, progress=False)
    _no_output(tmp_path / "back")
    # Incomplete checkpoint: Megatron writes metadata.json last.
    (tmp_path / "mcore" / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete Megatron distributed checkpoint"):
        convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)
    with pytest.raises(CheckpointError, match="nowhere: no such directory"):
        convert_mcore_to_hf(tmp_path / "nowhere", tmp_path / "back", progress=False)
    _no_output(tmp_path / "back")
