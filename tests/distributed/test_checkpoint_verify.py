"""`megarl checkpoint verify` and the trainer's check before it resumes, on real checkpoints: engine
checkpoints saved by two gloo ranks (dense at TP=2, MoE at DP=2, and dense with the plain optimizer,
use_distributed_optimizer=False, in fp32 and bf16), trainer step directories
committed by `CheckpointDirs` around them, and converted (mcore and HF) checkpoints. Each damage
(a shard file removed, truncated or changed, an expert never written, a truncated driver state)
must be named; good checkpoints must pass."""

from __future__ import annotations

import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _launch import run_distributed
from engine_helpers import make_batch, make_hf_model, make_moe_model, pg_loss_fn, save_hf_model
from megarl.algorithms.kl import make_kl_controller
from megarl.cli import main as megarl_main
from megarl.config import load_config, to_yaml
from megarl.convert.hf_to_mcore import convert_hf_to_mcore
from megarl.convert.mcore_to_hf import convert_mcore_to_hf
from megarl.data.sampler import StatefulSampler
from megarl.errors import CheckpointError, ConfigError
from megarl.trainer.checkpoint_dirs import STATE_FILE, CheckpointDirs, capture_rng_state
from megarl.trainer.checkpoint_verify import verify_checkpoint
from megarl.trainer.resume import select_resume

pytestmark = pytest.mark.distributed

CFG = dict(lr=1e-2, eps=1e-2, weight_decay=0.0, clip_grad=1.0, micro_batch_size=2, lr_schedule="constant",
           total_training_steps=4)


def _save_engines(rank: int, world: int, port: int, cases: list[tuple[str, dict, str, dict]]) -> None:
    from megarl.layout import ParallelLayout
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.optim import EngineConfig
    from megarl.megatron.parallel import init_distributed
    from megarl.models.spec import ModelSpec

    for hf_dir, layout_kw, out, engine_kw in cases:
        layout = init_distributed(rank, world, "127.0.0.1", port, ParallelLayout(**layout_kw))
        engine = MegatronEngine(ModelSpec.from_hf_config(hf_dir), layout,
                                EngineConfig(**CFG, **{"dtype": "fp32", **engine_kw}))
        engine.load_hf_weights(hf_dir)
        r = engine.ranks
        batch = {k: v.chunk(r.dp_size)[r.dp_rank] for k, v in make_batch(seed=1, batch=4).items()}
        engine.train_step(batch, pg_loss_fn, mini_batch_size=len(batch["responses"]), calculate_entropy=True)
        engine.save_checkpoint(out)


def _driver_state(step: int) -> dict[str, Any]:
    """What `RLTrainer.state_dict` saves, from the real components."""
    sampler = StatefulSampler(16, 4, shuffle=True, seed=3)
    for _ in range(step):
        sampler.next_batch()
    return {"global_step": step, "weights_version": step, "dataloader": {"sampler": sampler.state_dict()},
            "kl_ctrl": make_kl_controller("fixed", 0.001).state_dict(), "rng": capture_rng_state()}


def _commit(root: Path, step: int, engine_dir: Path) -> Path:
    dirs = CheckpointDirs(root)
    tmp = dirs.begin(step)
    shutil.copytree(engine_dir, tmp / "actor")
    torch.save(_driver_state(step), tmp / STATE_FILE)
    (tmp / "config.yaml").write_text(to_yaml(load_config(None, [], validate=False)))  # the resolved default config
    return dirs.commit(tmp, step, fsync_files=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("verify")
    dense_hf, moe_hf = save_hf_model(make_hf_model("qwen3")), save_hf_model(make_moe_model("qwen3_moe"))
    plain = dict(use_distributed_optimizer=False)
    cases = [(dense_hf, dict(tp=2), str(base / "dense"), {}), (moe_hf, dict(dp=2), str(base / "moe"), {}),
             (dense_hf, dict(tp=2), str(base / "plain"), plain),
             (dense_hf, dict(dp=2), str(base / "plain_bf16"), {**plain, "dtype": "bf16"})]
    run_distributed(_save_engines, 2, cases)
    return {"dense": base / "dense", "moe": base / "moe", "plain": base / "plain", "plain_bf16": base / "plain_bf16",
            "dense_hf": Path(dense_hf), "moe_hf": Path(moe_hf)}


def _run_with(tmp_path: Path, saved: dict[str, Path], kind: str = "dense", steps: tuple[int, ...] = (1, 2)) -> Path:
    root = tmp_path / "run" / "checkpoints"
    for s in steps:
        _commit(root, s, saved[kind])
    return root


def _verify_cli(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    rc = megarl_main(["checkpoint", "verify", str(path), *extra])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize("kind", ["dense", "moe", "plain", "plain_bf16"])
def test_good_trainer_checkpoints_pass(tmp_path: Path, saved: dict[str, Path], kind: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    root = _run_with(tmp_path, saved, kind)
    rc, out = _verify_cli(root / "global_step_2", capsys, "-v")
    assert rc == 0, out
    # The expected tensors come from the model spec (HF config stored with the engine checkpoint).
    n_model = 12 if kind == "moe" else 11
    assert f"{n_model} of {n_model} model tensors complete" in out and "is complete" in out
    optimizer = {"plain": "the plain fp32 optimizer", "plain_bf16": "the plain bf16 optimizer"}.get(
        kind, "the distributed optimizer")
    assert f"optimizer state of {optimizer}" in out and f"for {n_model} parameters, Adam step 1" in out, out
    rc, out = _verify_cli(root, capsys)  # the root: the step the tracker file names
    assert rc == 0 and "global_step_2" in out, out
    # What the trainer runs before it resumes.
    assert select_resume(CheckpointDirs(root), root.parent, "auto", None, fallback=False) == (2, root / "global_step_2")


def _drop_from_index(engine: Path, key: str, chunk: int | None = None) -> None:
    """As if the save never wrote tensor `key` (chunk None) or its `chunk`-th chunk: the index lists
    every chunk that was saved."""
    md_path = engine / ".metadata"
    metadata = pickle.loads(md_path.read_bytes())
    if chunk is None:
        del metadata.state_dict_metadata[key]
    else:
        del metadata.state_dict_metadata[key].chunks[chunk]
    md_path.write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("kind,state", [("plain", "exp_avg_sq"), ("plain_bf16", "fp32_param"),
                                        ("plain_bf16", "exp_avg")])
def test_plain_optimizer_state_missing_is_named(tmp_path: Path, saved: dict[str, Path], kind: str, state: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    root = _run_with(tmp_path, saved, kind, steps=(1,))
    engine = root / "global_step_1" / "actor"
    key = f"optimizer.state.{state}.decoder.layers.self_attention.linear_qkv.weight"
    _drop_from_index(engine, key, chunk=None if state == "fp32_param" else 0)
    rc, out = _verify_cli(engine, capsys)  # the index alone (the manifest would see the changed file)
    assert rc == 1, out
    if state == "fp32_param":
        assert f"optimizer state {key} is missing" in out, out
    else:  # one chunk (a layer or a TP shard) never written
        assert f"optimizer state {key} stores" in out, out
    with pytest.raises(CheckpointError, match="optimizer state"):
        select_resume(CheckpointDirs(root), root.parent, "auto", None, fallback=False)


def test_good_converted_checkpoints_pass(tmp_path: Path, saved: dict[str, Path],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    for kind in ("dense_hf", "moe_hf"):
        mcore = tmp_path / f"{kind}_mcore"
        convert_hf_to_mcore(saved[kind], mcore, tp=1, progress=False)
        rc, out = _verify_cli(mcore, capsys, "-v")
        assert rc == 0 and "converted engine checkpoint is complete" in out, out
        hf = tmp_path / f"{kind}_back"
        convert_mcore_to_hf(mcore, hf, progress=False)
        rc, out = _verify_cli(hf, capsys)
        assert rc == 0 and "HF checkpoint is complete" in out, out


def test_removed_shard_file_is_named_with_its_tensors(tmp_path: Path, saved: dict[str, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    root = _run_with(tmp_path, saved, steps=(1,))
    shard = root / "global_step_1" / "actor" / "__1_0.distcp"
    shard.unlink()
    rc, out = _verify_cli(root / "global_step_1", capsys)
    assert rc == 1
    assert f"{shard}: shard file missing; it holds" in out
    assert "decoder.layers.self_attention.linear_qkv.weight" in out  # a tensor rank 1 stored there


def test_truncated_shard_names_file_and_tensors(tmp_path: Path, saved: dict[str, Path],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    root = _run_with(tmp_path, saved, steps=(1,))
    shard = root / "global_step_1" / "actor" / "__0_1.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    rc, out = _verify_cli(root / "global_step_1", capsys)
    assert rc == 1
    assert f"{shard}: truncated shard file ({len(data) // 2} bytes" in out
    assert f"{shard}: {len(data) // 2} bytes, {len(data)} when saved" in out  # the manifest agrees
    assert "unreadable tensors: ['" in out


def test_changed_bytes_fail_the_checksum(tmp_path: Path, saved: dict[str, Path],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    root = _run_with(tmp_path, saved, steps=(1,))
    shard = root / "global_step_1" / "actor" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit of a weight
    shard.write_bytes(bytes(data))
    rc, out = _verify_cli(root / "global_step_1", capsys)
    assert rc == 1 and f"{shard}: contents changed since the save (CRC-32 differs; corrupted)" in out, out
    rc, out = _verify_cli(root / "global_step_1", capsys, "--no-checksums")
    assert rc == 0, out  # sizes alone cannot see it


def test_expert_never_written_is_named(tmp_path: Path, saved: dict[str, Path],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    engine = tmp_path / "moe"
    shutil.copytree(saved["moe"], engine)
    # As if the rank holding it never wrote it: the index lists every chunk that was saved.
    md_path = engine / ".metadata"
    metadata = pickle.loads(md_path.read_bytes())
    key = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    chunks = metadata.state_dict_metadata[key].chunks
    dropped = next(c for c in chunks if list(c.offsets[:2]) == [1, 3])
    chunks.remove(dropped)
    md_path.write_bytes(pickle.dumps(metadata))
    rc, out = _verify_cli(engine, capsys)
    assert rc == 1
    assert f"tensor {key} stores" in out and "(missing layer 1 expert 3)" in out, out


def test_truncated_driver_state_is_named(tmp_path: Path, saved: dict[str, Path],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    root = _run_with(tmp_path, saved, steps=(1,))
    state = root / "global_step_1" / STATE_FILE
    state.write_bytes(state.read_bytes()[:100])
    rc, out = _verify_cli(root / "global_step_1", capsys, "--no-checksums")
    assert rc == 1 and f"{state}: unreadable" in out, out


def test_resume_refuses_a_damaged_latest_and_names_the_earlier_one(tmp_path: Path, saved: dict[str, Path]) -> None:
    root = _run_with(tmp_path, saved, steps=(1, 2))
    shard = root / "global_step_2" / "actor" / "__1_1.distcp"
    shard.write_bytes(shard.read_bytes()[:10])
    dirs = CheckpointDirs(root)
    with pytest.raises(CheckpointError) as err:
        select_resume(dirs, root.parent, "auto", None, fallback=False)
    text = str(err.value)
    assert str(shard) in text and "truncated" in text
    assert f"the earlier checkpoint {root / 'global_step_1'} (step 1) is complete" in text
    assert "trainer.resume_fallback=true" in text
    assert select_resume(dirs, root.parent, "auto", None, fallback=True) == (1, root / "global_step_1")
    with pytest.raises(CheckpointError):  # a checkpoint named by path never falls back
        select_resume(dirs, root.parent, "resume_path", str(root / "global_step_2"), fallback=True)


def test_resume_follows_the_tracker_file(tmp_path: Path, saved: dict[str, Path]) -> None:
    root = _run_with(tmp_path, saved, steps=(1, 2))
    (root / "latest_checkpointed_iteration.txt").write_text("1")
    assert select_resume(CheckpointDirs(root), root.parent, "auto", None, fallback=False) == (1, root / "global_step_1")


def test_root_without_tracker_file_checks_the_checkpoint_committed_last(
        tmp_path: Path, saved: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    # A run saved steps 1 and 3, resumed step 1 by path and saved step 2: step 3 is left from the abandoned
    # continuation. Without the latest file the root check must take step 2 (what a resume takes), not step 3.
    root = _run_with(tmp_path, saved, steps=(1, 3, 2))
    (root / "latest_checkpointed_iteration.txt").unlink()
    (root / "global_step_3" / "actor" / "__0_0.distcp").unlink()  # the abandoned step is damaged
    rc, out = _verify_cli(root, capsys)
    assert rc == 0 and "step 2, the complete one committed last" in out, out
    assert select_resume(CheckpointDirs(root), root.parent, "auto", None, fallback=False) == (2, root / "global_step_2")


def test_disable_refuses_a_directory_that_holds_a_run(tmp_path: Path, saved: dict[str, Path]) -> None:
    root = _run_with(tmp_path, saved, steps=(1,))
    metrics = root.parent / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="trainer.resume_mode=disable starts a new run") as err:
        select_resume(CheckpointDirs(root), root.parent, "disable", None, fallback=False)
    assert str(metrics) in str(err.value)
    assert metrics.read_text() == '{"step": 1}\n' and (root / "global_step_1").is_dir()  # nothing lost
    fresh = tmp_path / "fresh"
    assert select_resume(CheckpointDirs(fresh / "checkpoints"), fresh, "disable", None, fallback=False) is None


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
