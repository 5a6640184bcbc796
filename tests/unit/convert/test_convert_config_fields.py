"""What an export's config.json says: the dtype of the tensors written (--dtype, or a checkpoint
converted with one), and conversion of a model_type transformers does not know, named by --spec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_hf import make_model, read_all, save_model

from megarl.convert.cli import main as convert_main
from megarl.convert.hf_files import expected_hf_shapes
from megarl.convert.hf_to_mcore import convert_hf_to_mcore
from megarl.convert.mcore_to_hf import convert_mcore_to_hf
from megarl.errors import ConfigError

pytestmark = pytest.mark.unit


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_export_with_dtype_names_it_in_config_and_loads_in_it(tmp_path: Path) -> None:
    import transformers

    src = save_model(make_model("qwen2", seed=2), tmp_path / "hf")
    assert _config(src)["dtype"] == "float32"
    convert_hf_to_mcore(src, tmp_path / "mcore", progress=False)
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "bf16", dtype="bf16", progress=False)
    assert _config(tmp_path / "bf16")["dtype"] == "bfloat16"
    assert {t.dtype for t in read_all(tmp_path / "bf16").values()} == {torch.bfloat16}
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # Without --dtype a policy keeps its source's config.json byte for byte.
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "same", progress=False)
    assert (tmp_path / "same" / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_export_of_a_checkpoint_converted_with_dtype_says_its_dtype(tmp_path: Path) -> None:
    src = save_model(make_model("llama", seed=3), tmp_path / "hf")
    convert_hf_to_mcore(src, tmp_path / "mcore", dtype="bf16", progress=False)
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)  # keeps the checkpoint's bf16
    assert _config(tmp_path / "back")["dtype"] == "bfloat16"


def test_legacy_torch_dtype_key_is_set(tmp_path: Path) -> None:
    src = save_model(make_model("llama", seed=3), tmp_path / "hf")
    config = _config(src)
    config["torch_dtype"] = config.pop("dtype")  # as written by transformers 4
    (src / "config.json").write_text(json.dumps(config))
    convert_hf_to_mcore(src, tmp_path / "mcore", progress=False)
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", dtype="fp16", progress=False)
    out = _config(tmp_path / "back")
    assert out["torch_dtype"] == "float16" and "dtype" not in out


def _renamed_model_type(tmp_path: Path) -> Path:
    src = save_model(make_model("qwen2", seed=5), tmp_path / "hf")
    config = _config(src)
    config["model_type"] = "my_qwen"  # no transformers config and no model_specs family lists it
    (src / "config.json").write_text(json.dumps(config))
    return src


def test_unknown_model_type_converts_with_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _renamed_model_type(tmp_path)
    assert convert_main(["hf-to-mcore", "--hf", str(src), "--out", str(tmp_path / "mc"), "--spec", "qwen2",
                         "--quiet"]) == 0, capsys.readouterr().err
    assert convert_main(["mcore-to-hf", "--ckpt", str(tmp_path / "mc"), "--out", str(tmp_path / "back"),
                         "--quiet"]) == 0, capsys.readouterr().err
    want, got = read_all(src), read_all(tmp_path / "back")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert _config(tmp_path / "back")["model_type"] == "my_qwen"


def test_unknown_model_type_without_a_config_class_is_a_clean_error(tmp_path: Path) -> None:
    config = _config(_renamed_model_type(tmp_path))
    config["architectures"] = ["PreTrainedModel"]  # a transformers class that reads no config
    with pytest.raises(ConfigError, match="config.json: model_type 'my_qwen' is not one transformers .* knows"):
        expected_hf_shapes(config)
