"""Write a directory under a temporary name and rename it into place only when it is complete.

Durable as well as atomic: every file and directory of the staged output is flushed to disk
(fsync) before the rename, and the parent directory after it, before an old copy is deleted; a
crash or power loss then leaves the old output or the new one, each complete. Staging directories
left by a killed conversion are removed by the next one into the same place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

from megarl.errors import CheckpointError

logger = logging.getLogger(__name__)


def check_not_overlapping(out_dir: str | Path, source: str | Path, source_flag: str) -> None:
    """Refuse an output directory that is the source, lies inside it or holds it: replacing it
    (`--overwrite`) would destroy the source the conversion reads."""
    out, src = Path(out_dir).resolve(), Path(source).resolve()
    if out == src or out in src.parents or src in out.parents:
        relation = "is" if out == src else ("holds" if out in src.parents else "lies inside")
        raise CheckpointError(
            f"--out {out_dir} {relation} the source {source_flag} {source}: writing there would destroy the "
            "source; choose an --out outside it"
        )


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (so that a file created or renamed in it stays). Here, in a module
    that imports nothing heavy (`megarl convert --help` loads it), for the trainer's checkpoints too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first, `root` last."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def _staging_name(out: Path, kind: str) -> Path:
    """A sibling of `out` named after it, the kind (partial, old) and this process, so that the next
    conversion into `out` can tell whether the process that made it still runs."""
    return out.with_name(f".{out.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _writer_pid(stage: Path, kind: str, out: Path) -> int | None:
    """The process id in a staging directory's name (None in a name without one, as conversions of
    earlier versions wrote)."""
    parts = stage.name[len(f".{out.name}.{kind}-"):].split("-")
    return int(parts[0]) if len(parts) == 2 and parts[0].isdigit() else None


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user
        return True
    return True


def remove_stale_stages(out: Path) -> None:
    """Remove the staging directories of `out` that a killed conversion left (`.<name>.partial-*`, and
    `.<name>.old-*` once `out` exists again). One whose process still runs is left to it; an old
    copy while `out` is missing is the only copy left of it, and is kept. Each is reported."""
    for kind in ("partial", "old"):
        prefix = f".{out.name}.{kind}-"
        for stage in sorted(p for p in out.parent.iterdir() if p.name.startswith(prefix) and p.is_dir()):
            pid = _writer_pid(stage, kind, out)
            if pid is not None and _running(pid):
                logger.warning("leaving %s in place: process %d, which made it, still runs", stage, pid)
            elif kind == "old" and not out.exists():
                logger.warning("%s holds the previous %s, left by a conversion killed while replacing it; rename it "
                               "back to %s or remove it", stage, out.name, out.name)
            else:
                logger.warning("removing %s, left by an interrupted conversion into %s", stage, out)
                shutil.rmtree(stage, ignore_errors=True)


@contextlib.contextmanager
def staged_output_dir(out_dir: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty sibling directory of `out_dir`; on success make it durable and rename it to
    `out_dir`.

    On any error the staging directory is removed, so nothing half-written is left behind and
    `out_dir` is untouched. An existing `out_dir` is an error unless `overwrite`.
    """
    out = Path(out_dir).absolute()
    if out.exists() and not overwrite:
        raise CheckpointError(f"output directory {out} already exists (choose another --out, or pass --overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_stages(out)
    stage = _staging_name(out, "partial")
    stage.mkdir()
    try:
        yield stage
        fsync_tree(stage)  # before the rename: a crash must not leave `out` naming unwritten files
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if out.exists():  # overwrite: move the old one aside first, so a crash never leaves neither
        old = _staging_name(out, "old")
        os.replace(out, old)
        os.replace(stage, out)
        fsync_path(out.parent)  # both renames on disk before the old copy goes
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(stage, out)
        fsync_path(out.parent)
