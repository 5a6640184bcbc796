"""The EOS ids a run ends responses on: the tokenizer's EOS and the `eos_token_id`s of the model's
`generation_config.json` (chat models list their end-of-turn tokens there: Llama-3.1-Instruct
[128001, 128008, 128009], Qwen2.5-Instruct [151645, 151643]), on a real tiny HF model directory."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from rollout_helpers import PAD, PROMPTS, VOCAB, prompt_batch, tiny_model

from megarl.rollout.base import EngineOptions, SamplingParams
from megarl.rollout.hf_engine import HFRolloutEngine
from megarl.trainer import cli, run_spec, setup
from megarl.trainer.cli import eos_token_ids, generation_eos_token_ids

pytestmark = pytest.mark.unit

R = 6


class Tokenizer:
    """What the driver reads of a tokenizer: its EOS, its pad and its vocabulary size."""

    def __init__(self, eos: int) -> None:
        self.eos_token_id, self.pad_token_id = eos, PAD

    def __len__(self) -> int:
        return VOCAB


def load(path: Path, eos: tuple[int, ...]) -> HFRolloutEngine:
    return HFRolloutEngine.from_pretrained(path, EngineOptions(pad_token_id=PAD, eos_token_ids=eos), device="cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int, list[int]]:
    """A tiny model saved with a generation_config.json naming the tokenizer's EOS and an
    end-of-turn id, the token greedy decoding of prompt 0 produces at a step >= 1 for the first
    time; the tokenizer's EOS is a token no greedy response holds."""
    out = tmp_path_factory.mktemp("tiny_eot")
    tiny_model(seed=3).save_pretrained(out, safe_serialization=True)
    free = load(out, ()).generate(prompt_batch(PROMPTS), SamplingParams.make_greedy(R))["responses"].tolist()
    step = next(k for k in range(1, R) if free[0][k] not in free[0][:k])
    end_of_turn = free[0][step]
    tokenizer_eos = next(t for t in range(VOCAB - 1, 0, -1) if all(t not in row for row in free))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [end_of_turn, tokenizer_eos]}))
    return out, tokenizer_eos, end_of_turn, free[0][:step + 1]


def test_generation_config_ids_follow_the_tokenizers_eos(model_dir, tmp_path: Path) -> None:
    path, tokenizer_eos, end_of_turn, _ = model_dir
    assert generation_eos_token_ids(path) == [end_of_turn, tokenizer_eos]
    assert eos_token_ids(tokenizer_eos, [path]) == [tokenizer_eos, end_of_turn]  # tokenizer first, no repeat
    # an int; no file; a file without the key; another tokenizer's ids
    (tmp_path / "int").mkdir()
    (tmp_path / "int" / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    assert eos_token_ids(3, [tmp_path / "int", tmp_path / "missing", tmp_path / "bare"]) == [3, 11]
    assert eos_token_ids(3, [tmp_path / "int"], vocab_size=11) == [3]
    assert eos_token_ids(None, [tmp_path / "int", path]) == [11, end_of_turn, tokenizer_eos]


def test_train_gives_the_run_spec_every_eos_id(model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """`megarl train` hands the run spec the tokenizer's EOS and the model directory's end-of-turn
    ids (stopped at the spec, before Ray starts)."""
    path, tokenizer_eos, end_of_turn, _ = model_dir
    run = SimpleNamespace(tokenizer=Tokenizer(tokenizer_eos), model_dir=path, total_steps=1, resume=None)
    seen = {}

    class Stop(Exception):
        pass

    def resolve(cfg, model_dir, **kwargs):
        seen.update(kwargs, model_dir=model_dir)
        raise Stop

    monkeypatch.setattr(setup, "prepare_run", lambda cfg: run)
    monkeypatch.setattr(run_spec, "resolve_run_spec", resolve)
    with pytest.raises(Stop):
        cli.train(OmegaConf.create({"model": {"path": str(path)}}))
    assert seen["eos_token_ids"] == [tokenizer_eos, end_of_turn] and seen["pad_token_id"] == PAD
    assert seen["model_dir"] == str(path)


def test_the_engine_stops_on_the_end_of_turn_id(model_dir) -> None:
    """The HF engine loaded from the directory ends prompt 0's response on the end-of-turn id with
    the run's EOS ids; with the tokenizer's EOS alone it runs past it."""
    path, tokenizer_eos, end_of_turn, until_eot = model_dir
    greedy = SamplingParams.make_greedy(R)
    ids = tuple(eos_token_ids(tokenizer_eos, [path]))
    engine = load(path, ids)
    out = engine.generate(prompt_batch(PROMPTS), greedy)
    k = len(until_eot)
    assert out["responses"][0].tolist() == until_eot + [PAD] * (R - k)
    assert out["response_mask"][0].tolist() == [1] * k + [0] * (R - k)
    assert engine.generate_tokens([PROMPTS[0]], greedy)[0].stopped
    past = load(path, (tokenizer_eos,)).generate(prompt_batch(PROMPTS), greedy)
    assert past["response_mask"][0].tolist() == [1] * R and past["responses"][0].tolist()[:k] == until_eot
    assert torch.equal(past["responses"][0, :k], out["responses"][0, :k])
