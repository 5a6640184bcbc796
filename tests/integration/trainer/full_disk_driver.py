"""`megarl train` with a disk that fills up during the checkpoint of one step (run as a script by
test_disk_full_save.py and benchmarks/reliability.py).

    python full_disk_driver.py STEP CONFIG [overrides...]

A stand-in for a full disk: the driver's write of the trainer state into the temporary directory of
step STEP's checkpoint writes a few bytes, then raises OSError(ENOSPC) as a full file system does.
The workers have written their engine shards by then, so a partial save really is on disk.
Everything else (Ray, the workers, the trainer, the CLI's error handling) is the real one.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

import torch

from megarl.cli import main
from megarl.trainer.checkpoint_dirs import STATE_FILE

_real_save = torch.save


def install(step: int) -> None:
    def save(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        path = Path(f) if isinstance(f, (str, os.PathLike)) else None
        if path is not None and path.name == STATE_FILE and path.parent.name.startswith(f".tmp-step_{step}-"):
            path.write_bytes(b"\x80" * 64)  # what fitted before the disk was full
            print(f"full-disk stand-in: ENOSPC at {time.time():.3f}", file=sys.stderr, flush=True)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return _real_save(obj, f, *args, **kwargs)

    torch.save = save


if __name__ == "__main__":
    install(int(sys.argv[1]))
    sys.exit(main(["train", *sys.argv[2:]]))
