"""Trainer checkpoints: the trained engines (Megatron distributed checkpoints, any layout on load)
and the driver's own state (`RLTrainer.state_dict`: step, data-loader position, KL controller, RNG),
written to a temporary directory and renamed when complete (see `CheckpointDirs`)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from megarl.cluster.worker_group import RoleView
from megarl.errors import CheckpointError
from megarl.trainer.checkpoint_dirs import STATE_FILE, CheckpointDirs
from megarl.workers.roles import EngineRole

logger = logging.getLogger(__name__)


DRIVER_STATE_CHECKED = ("global_step", "weights_version", "dataloader", "kl_ctrl")


def check_driver_state_restored(saved: dict[str, Any], restored: dict[str, Any], checkpoint: Optional[Path]) -> None:
    """Raise `CheckpointError` naming each part of the driver state (step counters, data-loader
    position, KL controller) that `restored` (the trainer's state right after loading) does not
    hold as `saved` had it. The RNG state is left out: restoring it is exact by construction."""
    differ = [f"{key}: saved {saved.get(key)!r}, after the load {restored.get(key)!r}"
              for key in DRIVER_STATE_CHECKED if saved.get(key) != restored.get(key)]
    if differ:
        where = checkpoint / STATE_FILE if checkpoint is not None else STATE_FILE
        raise CheckpointError(f"{where}: the resume did not restore the driver state: "
                              + "; ".join(differ))


class TrainerCheckpointer:
    """Saves and restores `engines` ({name: role view}, e.g. actor and critic) and a driver state dict.

    `config_file`: the run's resolved config, copied into each checkpoint.
    """

    def __init__(self, dirs: CheckpointDirs, engines: dict[str, RoleView], config_file: Path) -> None:
        self.dirs = dirs
        self.engines = engines
        self.config_file = config_file

    def save(self, step: int, state: dict[str, Any]) -> Path:
        tmp = self.dirs.begin(step)
        for name, view in self.engines.items():
            view.call_all(EngineRole.save_checkpoint, str(tmp / name))
        torch.save(state, tmp / STATE_FILE)
        shutil.copy(self.config_file, tmp / "config.yaml")
        path = self.dirs.commit(tmp, step)
        logger.info("checkpoint: step %d -> %s", step, path)
        return path

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
