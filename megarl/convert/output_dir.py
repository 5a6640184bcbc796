"""Write a directory under a temporary name and rename it into place only when it is complete."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

from megarl.errors import CheckpointError


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


@contextlib.contextmanager
def staged_output_dir(out_dir: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty sibling directory of `out_dir`; on success rename it to `out_dir`.

    On any error the staging directory is removed, so nothing half-written is left behind and
    `out_dir` is untouched. An existing `out_dir` is an error unless `overwrite`.
    """
    out = Path(out_dir).absolute()
    if out.exists() and not overwrite:
        raise CheckpointError(f"output directory {out} already exists (choose another --out, or pass --overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.with_name(f".{out.name}.partial-{uuid.uuid4().hex[:8]}")
    stage.mkdir()
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if out.exists():  # overwrite: move the old one aside first, so a crash never leaves neither
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out, old)
        os.replace(stage, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(stage, out)
