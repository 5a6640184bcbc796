"""A conversion's output survives a crash: every file and directory of it is flushed to disk before
it is renamed into place, and the parent directory after, before an old copy is deleted; what a
killed conversion leaves behind is cleared by the next conversion into the same place."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_hf import make_model, read_all, save_model

from megarl.convert.hf_to_mcore import convert_hf_to_mcore
from megarl.convert.mcore_to_hf import convert_mcore_to_hf
from megarl.convert.output_dir import staged_output_dir


class _Events:
    """os.fsync, os.replace and shutil.rmtree, recorded in order (each still does its work)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, object]] = []
        real_fsync, real_replace, real_rmtree = os.fsync, os.replace, shutil.rmtree

        def fsync(fd: int) -> None:
            st = os.fstat(fd)
            self.log.append(("fsync", (st.st_dev, st.st_ino)))
            real_fsync(fd)

        def replace(src: object, dst: object) -> None:
            self.log.append(("replace", (Path(src), Path(dst))))
            real_replace(src, dst)

        def rmtree(path: object, *args: object, **kwargs: object) -> None:
            self.log.append(("rmtree", Path(path)))
            real_rmtree(path, *args, **kwargs)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(shutil, "rmtree", rmtree)

    def index(self, kind: str, match: object) -> int:
        return next(i for i, (k, v) in enumerate(self.log) if k == kind and match(v))

    def fsynced_before(self, path: Path, end: int) -> bool:
        st = path.stat()
        return any(k == "fsync" and v == (st.st_dev, st.st_ino) for k, v in self.log[:end])


def _check_durable(events: _Events, out: Path, overwrote: bool) -> None:
    into_place = events.index("replace", lambda v: v[1] == out)
    tree = [Path(d) / n for d, dirs, files in os.walk(out) for n in files + dirs] + [out]
    assert len(tree) > 3
    unsynced = [str(p.relative_to(out.parent)) for p in tree if not events.fsynced_before(p, into_place)]
    assert not unsynced, f"not flushed before the rename into place: {unsynced}"
    parent = out.parent.stat()
    synced_after = [i for i, (k, v) in enumerate(events.log)
                    if k == "fsync" and v == (parent.st_dev, parent.st_ino) and i > into_place]
    assert synced_after, "the parent directory was not flushed after the rename"
    if overwrote:
        aside = events.index("replace", lambda v: v[0] == out)
        assert aside < into_place
        old = events.log[aside][1][1]  # type: ignore[index]
        assert synced_after[0] < events.index("rmtree", lambda v: v == old), "the old copy went before the renames were on disk"
        assert not old.exists()


def test_outputs_are_flushed_before_they_are_renamed_into_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = save_model(make_model("qwen2", seed=1), tmp_path / "hf")
    convert_hf_to_mcore(src, tmp_path / "mc", tp=2, progress=False)
    events = _Events(monkeypatch)
    convert_hf_to_mcore(src, tmp_path / "mc", tp=2, overwrite=True, progress=False)
    _check_durable(events, (tmp_path / "mc").absolute(), overwrote=True)

    events = _Events(monkeypatch)
    convert_mcore_to_hf(tmp_path / "mc", tmp_path / "back", max_shard_bytes=40_000, progress=False)
    back = (tmp_path / "back").absolute()
    assert (back / "model.safetensors.index.json").is_file()  # sharded, with an index
    _check_durable(events, back, overwrote=False)
    want, got = read_all(src), read_all(back)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


# Runs a conversion in a child process and kills it (SIGKILL) half-way through writing, or right
# after the old output was moved aside to be replaced.
_KILLED = """
import os, signal, sys
from megarl.convert.hf_files import HFCheckpoint
from megarl.convert.hf_to_mcore import convert_hf_to_mcore

src, out, when = sys.argv[1:]
if when == "writing":
    real_read, reads = HFCheckpoint.read, []
    def read(self, names):
        reads.append(1)
        if len(reads) == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_read(self, names)
    HFCheckpoint.read = read
else:
    real_replace = os.replace
    def replace(a, b):
        real_replace(a, b)
        if ".old-" in os.path.basename(b):
            os.kill(os.getpid(), signal.SIGKILL)
    os.replace = replace
convert_hf_to_mcore(src, out, overwrite=True, progress=False)
"""


def _killed_conversion(src: Path, out: Path, when: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _KILLED, str(src), str(out), when], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def test_what_a_killed_conversion_leaves_is_cleared_by_the_next(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = save_model(make_model("llama", seed=2), tmp_path / "hf")
    out = tmp_path / "mc"
    _killed_conversion(src, out, "writing")
    left = _leftovers(out)
    assert len(left) == 1 and left[0].startswith(".mc.partial-") and not out.exists()
    (tmp_path / ".mc.partial-1a2b3c4d").mkdir()  # as conversions of earlier versions named theirs
    with caplog.at_level(logging.WARNING):
        convert_hf_to_mcore(src, out, progress=False)
    assert _leftovers(out) == []
    assert f"removing {tmp_path / left[0]}, left by an interrupted conversion into {out}" in caplog.text

    # Killed between moving the old output aside and renaming the new one in: the old copy is the
    # only one left, and is kept (and named) until an output is in place again.
    _killed_conversion(src, out, "swapping")
    left = _leftovers(out)
    old = [name for name in left if name.startswith(".mc.old-")]
    assert not out.exists() and len(old) == 1 and len(left) == 2 and ".mc.partial-" in (set(left) - set(old)).pop()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        convert_hf_to_mcore(src, out, progress=False)
    assert _leftovers(out) == old and "holds the previous mc" in caplog.text
    convert_hf_to_mcore(src, out, overwrite=True, progress=False)
    assert _leftovers(out) == []
    back = convert_mcore_to_hf(out, tmp_path / "back", progress=False).out_dir
    want, got = read_all(src), read_all(back)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_the_staging_directory_of_a_running_conversion_is_left_to_it(tmp_path: Path) -> None:
    src = save_model(make_model("llama", seed=2), tmp_path / "hf")
    out = tmp_path / "mc"
    with pytest.raises(RuntimeError, match="end the outer conversion"):
        with staged_output_dir(out) as running:  # this process's: it still runs
            convert_hf_to_mcore(src, out, progress=False)
            assert running.is_dir()
            raise RuntimeError("end the outer conversion")
    assert _leftovers(out) == [] and (out / "metadata.json").is_file()
