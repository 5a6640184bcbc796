"""A resume whose training data (or data settings) no longer gives the checkpoint's sampler layout is
refused by `prepare_run`, before anything of the run directory is written and before Ray starts (the
check in `RLTrainer.fit` comes only after config.yaml was rewritten and the workers started).

The checkpoint is real: an engine directory converted from the run's HF model, the driver state that
`RLTrainer.state_dict` saves (from the first run's own loader), committed by `CheckpointDirs`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from megarl.algorithms.kl import make_kl_controller
from megarl.config import load_config
from megarl.convert.hf_to_mcore import convert_hf_to_mcore
from megarl.data.parquet_io import write_parquet
from megarl.data.tokenizer import build_char_tokenizer
from megarl.errors import ConfigError
from megarl.trainer.checkpoint_dirs import STATE_FILE, CheckpointDirs, capture_rng_state
from megarl.trainer.resume import METRICS_FILE
from megarl.trainer.setup import prepare_run

pytestmark = pytest.mark.unit

HF = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def write_train(path: Path, n_rows: int) -> None:
    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": f"{i}+1="}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}} for i in range(n_rows)]
    write_parquet(rows, path)


def experiment(root: Path) -> Path:
    """A run on 8 prompts in batches of 4, with its tokenizer and a small HF model."""
    write_train(root / "train.parquet", 8)
    build_char_tokenizer("0123456789+=", root / "tok")
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**HF)).save_pretrained(root / "model")
    exp = {
        "data": {"train_files": [str(root / "train.parquet")], "tokenizer": str(root / "tok"), "train_batch_size": 4,
                 "max_prompt_length": 16, "max_response_length": 8, "apply_chat_template": "false"},
        "model": {"path": str(root / "model")},
        "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 2},
        "rollout": {"n": 2},
        "trainer": {"default_local_dir": str(root / "run"), "total_training_steps": 4},
        "resources": {"actor_pool": {"nnodes": 1, "devices_per_node": 1}},
    }
    path = root / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def run_one_step_and_save(exp: Path) -> Path:
    """The first run: prepared, one batch handed out, its checkpoint of step 1 committed, a metrics line."""
    run = prepare_run(load_config(exp))
    run.train_loader.next_batch()
    state = {"global_step": 1, "weights_version": 1, "dataloader": run.train_loader.state_dict(),
             "kl_ctrl": make_kl_controller("fixed", 0.001).state_dict(), "rng": capture_rng_state()}
    dirs = CheckpointDirs(run.run_dir / "checkpoints")
    tmp = dirs.begin(1)
    convert_hf_to_mcore(run.model_dir, tmp / "actor", progress=False)
    torch.save(state, tmp / STATE_FILE)
    shutil.copy(run.run_dir / "config.yaml", tmp / "config.yaml")
    (run.run_dir / METRICS_FILE).write_text('{"step": 1, "critic/score/mean": 0.5}\n')
    return dirs.commit(tmp, 1, fsync_files=False)


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("change", "named"), [
    ("rows", "num_rows: 8 in the checkpoint, 12 now (the usable prompts of data.train_files"),
    ("seed", "seed: {seed} in the checkpoint, 1234 now (data.seed)"),
], ids=["more-rows", "data-seed"])
def test_resume_with_other_data_is_refused_before_anything_is_written(tmp_path: Path, change: str,
                                                                      named: str) -> None:
    exp = experiment(tmp_path)
    checkpoint = run_one_step_and_save(exp)
    run_dir = tmp_path / "run"
    before = snapshot(run_dir)
    assert {"config.yaml", METRICS_FILE} <= set(before)
    overrides = []
    if change == "rows":
        write_train(tmp_path / "train.parquet", 12)
    else:
        overrides = ["data.seed=1234"]
    with pytest.raises(ConfigError) as error:
        prepare_run(load_config(exp, overrides))
    message = str(error.value)
    named = named.format(seed=load_config(exp).data.seed)
    assert message.startswith(f"cannot resume {checkpoint}: this run's training data would not continue its "
                              "sequence of batches")
    assert named in message and str(checkpoint / STATE_FILE) in message
    assert "nothing was written" in message and "trainer.resume_mode=disable" in message
    assert snapshot(run_dir) == before  # config.yaml, metrics and checkpoint: same bytes, same mtimes


def test_resume_with_the_same_data_goes_on(tmp_path: Path) -> None:
    exp = experiment(tmp_path)
    checkpoint = run_one_step_and_save(exp)
    run = prepare_run(load_config(exp))
    assert run.resume == (1, checkpoint)
