"""Trainer checkpoints: the trained engines (Megatron distributed checkpoints, any layout on load)
and the driver's own state (`RLTrainer.state_dict`: step, data-loader position, KL controller, RNG),
written to a temporary directory and renamed when complete (see `CheckpointDirs`)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from megarl.algorithms.kl import kl_state_keys
from megarl.cluster.worker_group import RoleView
from megarl.errors import CheckpointError
from megarl.trainer.checkpoint_dirs import STATE_FILE, CheckpointDirs
from megarl.trainer.checkpoint_verify import verify_checkpoint
from megarl.workers.roles import EngineRole

logger = logging.getLogger(__name__)


DRIVER_STATE_CHECKED = ("global_step", "weights_version", "dataloader", "kl_ctrl")


def _restored_part(key: str, state: dict[str, Any], restored: dict[str, Any]) -> Any:
    """What of `state[key]` a load restores: all of it, but of the KL controller only its state
    (the adaptive coefficient), not its settings, which are this run's config's (`kl_state_keys`)."""
    value = state.get(key)
    if key == "kl_ctrl" and isinstance(value, dict) and isinstance(restored.get(key), dict):
        return {k: value.get(k) for k in kl_state_keys(restored[key])}
    return value


def check_driver_state_restored(saved: dict[str, Any], restored: dict[str, Any], checkpoint: Optional[Path]) -> None:
    """Raise `CheckpointError` naming each part of the driver state (step counters, data-loader
    position, KL controller) that `restored` (the trainer's state right after loading) does not
    hold as `saved` had it. The RNG state is left out: restoring it is exact by construction."""
    differ = [f"{key}: saved {saved.get(key)!r}, after the load {restored.get(key)!r}"
              for key in DRIVER_STATE_CHECKED
              if _restored_part(key, saved, restored) != _restored_part(key, restored, restored)]
    if differ:
        where = checkpoint / STATE_FILE if checkpoint is not None else STATE_FILE
        raise CheckpointError(f"{where}: the resume did not restore the driver state: "
                              + "; ".join(differ))


def is_disk_full(error: BaseException) -> bool:
    """True when `error` or anything it wraps is ENOSPC ("No space left on device"), also when it
    happened in a worker: a remote error carries the original exception as `.cause`, or at least
    its text (exception chains do not survive pickling)."""
    seen: set[int] = set()
    pending: list[Optional[BaseException]] = [error]
    while pending:
        err = pending.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        cause = getattr(err, "cause", None)  # ray.exceptions.RayTaskError: the worker's exception
        pending += [err.__cause__, err.__context__, cause if isinstance(cause, BaseException) else None]
    return any(text in str(error) for text in (_ENOSPC_TEXT, f"[Errno {errno.ENOSPC}]"))


_ENOSPC_TEXT = os.strerror(errno.ENOSPC)  # "No space left on device"


def disk_full_message(target: Path, previous: Optional[tuple[int, Path]], error: BaseException) -> str:
    """First line: the save that failed and the state of the previous checkpoint, the one a resume
    continues from (checked again, sizes and CRC-32 of its files, before saying it is intact); then
    the original error."""
    head = f"{_ENOSPC_TEXT} while saving checkpoint {target}; the partial save was removed"
    if previous is None:
        head += "; there is no earlier checkpoint to resume from"
    else:
        report = verify_checkpoint(previous[1])
        if report.ok:
            head += f"; the previous checkpoint {previous[1]} is intact (step {previous[0]}, verified)"
        else:
            head += f"; the previous checkpoint {previous[1]} did NOT verify:\n{report.message()}"
    first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return f"{head}\nFree space on that disk (or point trainer.default_local_dir elsewhere) and resume. Error: {first}"


class TrainerCheckpointer:
    """Saves and restores `engines` ({name: role view}, e.g. actor and critic) and a driver state dict.

    `config_file`: the run's resolved config, copied into each checkpoint.
    """

    def __init__(self, dirs: CheckpointDirs, engines: dict[str, RoleView], config_file: Path) -> None:
        self.dirs = dirs
        self.engines = engines
        self.config_file = config_file

    def save(self, step: int, state: dict[str, Any], before_commit: Optional[Callable[[], None]] = None) -> Path:
        """Write the checkpoint of `step`; on any failure the partial save is removed. A full disk
        (on the driver or any worker) raises `CheckpointError` saying so and whether the previous
        checkpoint is intact. `before_commit` is called once everything is written, right before the
        rename that commits it (`CheckpointDirs.commit`)."""
        previous = self._previous()
        tmp: Optional[Path] = None
        try:
            tmp = self.dirs.begin(step)
            for name, view in self.engines.items():
                view.call_all(EngineRole.save_checkpoint, str(tmp / name))
            torch.save(state, tmp / STATE_FILE)
            shutil.copy(self.config_file, tmp / "config.yaml")
            path = self.dirs.commit(tmp, step, before_rename=before_commit)
        except BaseException as err:
            if tmp is not None:
                self.dirs.discard(tmp)
            if is_disk_full(err):
                raise CheckpointError(disk_full_message(self.dirs.step_dir(step), previous, err)) from err
            raise
        logger.info("checkpoint: step %d -> %s", step, path)
        return path

    def _previous(self) -> Optional[tuple[int, Path]]:
        """The checkpoint a resume after a failed save continues from (the one the latest file names,
        not the highest step: see `CheckpointDirs.auto_candidate`), for the disk-full message."""
        try:
            return self.dirs.auto_candidate(warn=False)
        except CheckpointError as err:  # an unreadable latest file must not stop the save; commit rewrites it
            logger.warning("checkpoint: %s", err)
            return self.dirs.latest()

    def resume(self, mode: str, path: Optional[str]) -> Optional[dict[str, Any]]:
        """Load the engines of the checkpoint `mode`/`path` name (see `CheckpointDirs.resolve_resume`)
        and return the driver state saved with them; None when there is nothing to resume."""
        return self.load(self.dirs.resolve_resume(mode, path))

    def load(self, found: Optional[tuple[int, Path]]) -> Optional[dict[str, Any]]:
        """Load the engines of checkpoint `found` = (step, dir) and return the driver state saved
        with them; None (nothing loaded) when `found` is None."""
        if found is None:
            return None
        step, ckpt = found
        state_file = ckpt / STATE_FILE
        if not state_file.is_file():
            raise CheckpointError(f"{ckpt}: {STATE_FILE} missing; the checkpoint is not a megarl trainer checkpoint")
        missing = [name for name in self.engines if not (ckpt / name).is_dir()]
        if missing:
            raise CheckpointError(f"{ckpt}: the run has {missing} but the checkpoint holds none "
                                  f"(it has {sorted(p.name for p in ckpt.iterdir() if p.is_dir())})")
        state = torch.load(state_file, weights_only=False)
        for name, view in self.engines.items():
            view.call_all(EngineRole.load_checkpoint, str(ckpt / name))
        logger.info("resumed from %s (step %d)", ckpt, step)
        return state
