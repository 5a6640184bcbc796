"""Trainer checkpoints: actor and critic engines (Megatron distributed checkpoints, any layout on
load), data-loader position, KL controller, RNG states and the config, written to a temporary
directory and renamed when complete (see `CheckpointDirs`)."""

from __future__ import annotations

import logging
import shutil
from typing import Any

import torch

from megarl.errors import CheckpointError
from megarl.trainer.checkpoint_dirs import CheckpointDirs, capture_rng_state, restore_rng_state

logger = logging.getLogger(__name__)
STATE_FILE = "trainer_state.pt"


class TrainerCheckpointer:
    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        cfg = trainer.cfg
        self.dirs = CheckpointDirs(trainer.run.run_dir / "checkpoints", cfg.trainer.max_ckpt_to_keep)

    def save(self, step: int) -> None:
        t = self.trainer
        tmp = self.dirs.begin(step)
        t.workers.actor.call_all("save_checkpoint", str(tmp / "actor"))
        if t.workers.critic is not None:
            t.workers.critic.call_all("save_checkpoint", str(tmp / "critic"))
        torch.save(
            {
                "global_step": step,
                "weights_version": t.weights_version,
                "dataloader": t.run.train_loader.state_dict(),
                "kl_ctrl": t.kl_ctrl.state_dict(),
                "rng": capture_rng_state(),
            },
            tmp / STATE_FILE,
        )
        shutil.copy(t.run.run_dir / "config.yaml", tmp / "config.yaml")
        path = self.dirs.commit(tmp, step)
        logger.info("checkpoint: step %d -> %s", step, path)

    def maybe_resume(self) -> None:
        t = self.trainer
        found = self.dirs.resolve_resume(t.cfg.trainer.resume_mode, t.cfg.trainer.resume_from_path)
        if found is None:
            return
        step, path = found
        state_file = path / STATE_FILE
        if not state_file.is_file():
            raise CheckpointError(f"{path}: {STATE_FILE} missing; the checkpoint is not a megarl trainer checkpoint")
        state = torch.load(state_file, weights_only=False)
        t.workers.actor.call_all("load_checkpoint", str(path / "actor"))
        if t.workers.critic is not None:
            if not (path / "critic").is_dir():
                raise CheckpointError(f"{path}: the run has a critic but the checkpoint holds none")
            t.workers.critic.call_all("load_checkpoint", str(path / "critic"))
        t.run.train_loader.load_state_dict(state["dataloader"])
        t.kl_ctrl.load_state_dict(state["kl_ctrl"])
        restore_rng_state(state["rng"])
        t.global_step = int(state["global_step"])
        t.weights_version = int(state["weights_version"])
        t.rollout_version = -1  # the rollout engines must take the restored weights
        logger.info("resumed from %s (step %d)", path, step)
