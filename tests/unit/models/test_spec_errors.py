"""`ModelSpec.from_hf_config` names the config.json an unsupported architecture was read from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from megarl.cli import main as megarl_main
from megarl.errors import ConfigError
from megarl.models.spec import ModelSpec

pytestmark = pytest.mark.unit


def _gpt2_config(directory: Path) -> Path:
    transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, bos_token_id=0, eos_token_id=0,
                            architectures=["GPT2LMHeadModel"]).save_pretrained(directory)
    return directory / "config.json"


def test_an_unsupported_architecture_names_its_config_file(tmp_path: Path) -> None:
    path = _gpt2_config(tmp_path / "gpt2")
    for given in (path.parent, path, str(path)):
        with pytest.raises(ConfigError) as err:
            ModelSpec.from_hf_config(given)
        assert str(err.value).startswith(f"{path}: unsupported architecture model_type='gpt2' "
                                         "architectures=['GPT2LMHeadModel']; supported families: ")
    # A config given as a dict has no file to name: the message is unchanged.
    with pytest.raises(ConfigError, match=r"^unsupported architecture model_type='gpt2'.*supported families: .*llama"):
        ModelSpec.from_hf_config(json.loads(path.read_text()))


def test_hf_to_mcore_names_the_config_file_of_an_unsupported_architecture(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _gpt2_config(tmp_path / "gpt2")
    rc = megarl_main(["convert", "hf-to-mcore", "--hf", str(path.parent), "--out", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    assert err.startswith(f"error: {path}: unsupported architecture model_type='gpt2'")
    assert not (tmp_path / "out").exists()
