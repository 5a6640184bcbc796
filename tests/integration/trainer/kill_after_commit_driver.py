"""`megarl train` killed (SIGKILL of its whole process group: the driver, Ray, the workers) right
after the checkpoint of one step is committed, the earliest moment a resume continues after that
step (run as a script by test_kill_after_commit.py).

    python kill_after_commit_driver.py STEP CONFIG [overrides...]

Everything else (Ray, the workers, the trainer, the CLI) is the real one.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from megarl.cli import main
from megarl.trainer.checkpoint_dirs import CheckpointDirs


def install(step: int) -> None:
    real_commit = CheckpointDirs.commit

    def commit(self: CheckpointDirs, tmp: Any, at_step: int, *args: Any, **kwargs: Any) -> Any:
        path = real_commit(self, tmp, at_step, *args, **kwargs)
        if at_step == step:
            print(f"kill-after-commit: checkpoint of step {step} committed, killing the run", file=sys.stderr,
                  flush=True)
            os.killpg(os.getpgid(0), signal.SIGKILL)
        return path

    CheckpointDirs.commit = commit  # type: ignore[method-assign]


if __name__ == "__main__":
    install(int(sys.argv[1]))
    sys.exit(main(["train", *sys.argv[2:]]))
