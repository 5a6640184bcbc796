"""Which checkpoint a run resumes from, decided and verified before anything of the run is written
and before Ray and the workers start.

- `trainer.resume_mode=auto`: the checkpoint `latest_checkpointed_iteration.txt` names (the one
  committed last when that file is absent; not the highest step, see `CheckpointDirs`);
  `resume_path`: `trainer.resume_from_path`; `disable`: none, and a directory that already holds
  a run (metrics or checkpoints) is refused rather than overwritten.
- The chosen checkpoint is verified (`checkpoint_verify.verify_trainer_checkpoint`). When it is not
  usable the error names the file and what is wrong, and the newest earlier checkpoint that passes;
  the run resumes from that one only when `trainer.resume_fallback` is true (and never for a
  checkpoint named by path).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from megarl.errors import CheckpointError, ConfigError
from megarl.trainer.checkpoint_dirs import CheckpointDirs
from megarl.trainer.checkpoint_verify import verified_steps, verify_trainer_checkpoint

logger = logging.getLogger(__name__)
METRICS_FILE = "metrics.jsonl"
# The model keys that decide the shapes of the trained weights (the rest may change on resume).
MODEL_SHAPE_KEYS = ("path", "hf_config", "spec", "init_from_scratch", "override_config")


def _leaves(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_leaves(item, f"{prefix}.{key}"))
        return out or {prefix: {}}
    return {prefix: value}


def check_same_model(checkpoint: Path, model: dict[str, Any]) -> None:
    """Refuse to resume `checkpoint` with a run whose `model` section (resolved) would build other
    weights than the checkpoint's run did (its `config.yaml`): names each differing key."""
    saved_cfg = OmegaConf.to_container(OmegaConf.load(checkpoint / "config.yaml"), resolve=True)
    saved = saved_cfg.get("model") or {}
    before = {k: v for key in MODEL_SHAPE_KEYS for k, v in _leaves(saved.get(key), f"model.{key}").items()}
    now = {k: v for key in MODEL_SHAPE_KEYS for k, v in _leaves(model.get(key), f"model.{key}").items()}
    differ = [f"{k}: {before.get(k)!r} in the checkpoint's run, {now.get(k)!r} now"
              for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
    if differ:
        raise ConfigError(
            f"cannot resume {checkpoint}: this run's model differs from the one the checkpoint was trained with "
            f"({'; '.join(differ[:6])}{' ...' if len(differ) > 6 else ''}); nothing was written. Resume with the "
            "checkpoint's model keys, or start the new model in another trainer.default_local_dir"
        )


def refuse_reused_run_dir(run_dir: Path, dirs: CheckpointDirs) -> None:
    """`resume_mode=disable` starts a new run: refused where an earlier run left metrics or checkpoints."""
    metrics = run_dir / METRICS_FILE
    held = []
    if metrics.is_file() and metrics.stat().st_size > 0:
        held.append(str(metrics))
    held += [str(p) for _, p in dirs.complete_checkpoints()]
    if held:
        raise ConfigError(
            f"trainer.resume_mode=disable starts a new run, but trainer.default_local_dir={str(run_dir)!r} holds an "
            f"earlier run ({', '.join(held[:3])}{' ...' if len(held) > 3 else ''}); nothing was written. Choose "
            "another trainer.default_local_dir, resume it (trainer.resume_mode=auto), or remove the directory"
        )


def select_resume(dirs: CheckpointDirs, run_dir: Path, mode: str, path: Optional[str], fallback: bool,
                  checksums: bool = True, model: Optional[dict[str, Any]] = None) -> Optional[tuple[int, Path]]:
    """The verified checkpoint `(step, path)` to resume from, or None for a fresh start.
    `model`: the run's resolved `model` section; when given, the checkpoint must be of the same model.

    Raises `CheckpointError` naming the damaged file, and the earlier complete checkpoint if any,
    when the chosen checkpoint is not usable and `fallback` is false.
    """
    if mode == "disable":
        dirs.resolve_resume(mode, path)  # checks the mode's value
        refuse_reused_run_dir(run_dir, dirs)
        return None
    chosen = dirs.resolve_resume(mode, path) if mode != "auto" else dirs.auto_candidate()
    if chosen is None:
        return None
    step, ckpt = chosen
    report = verify_trainer_checkpoint(ckpt, checksums)
    if report.ok:
        if model is not None:
            check_same_model(ckpt, model)
        logger.info("resuming from %s (step %d, verified)", ckpt, step)
        return step, ckpt
    earlier = sorted((s for s, _ in dirs.complete_checkpoints() if s < step), reverse=True)
    good = next(((s, r) for s, r in verified_steps(dirs.root, earlier, checksums) if r.ok), None)
    if good is not None and fallback and mode == "auto":
        logger.warning("%s\ncheckpoint: trainer.resume_fallback=true: resuming from %s (step %d) instead",
                       report.message(), good[1].path, good[0])
        if model is not None:
            check_same_model(good[1].path, model)
        return good[0], good[1].path
    if good is None:
        hint = f"no earlier complete checkpoint under {dirs.root} passes the check"
    elif mode == "auto":
        hint = (f"the earlier checkpoint {good[1].path} (step {good[0]}) is complete: set trainer.resume_fallback=true "
                f"to resume from it, or trainer.resume_mode=resume_path trainer.resume_from_path={good[1].path}")
    else:
        hint = f"the earlier checkpoint {good[1].path} (step {good[0]}) is complete: name it in trainer.resume_from_path"
    raise CheckpointError(f"cannot resume: {report.message()}\n{hint}")

