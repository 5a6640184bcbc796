"""A killed vLLM tensor-parallel job on CPU leaves its all-reduce segments in shared memory under
names every such job on the host uses; the next job's engine removes its own rank's stale ones
(unmapped by any live process) first, and nothing a running job maps or another rank owns."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from megarl.rollout.vllm_engine import remove_stale_cpu_shm

pytestmark = pytest.mark.unit


def _segment(folder: Path, name: str) -> Path:
    path = folder / name
    path.write_bytes(b"\0" * 4096)
    return path


def test_only_this_ranks_unmapped_segments_are_removed(tmp_path: Path) -> None:
    stale = _segment(tmp_path, "-tp:0-[0-1]-cpushm_0")
    other_rank = _segment(tmp_path, "-tp:0-[0-1]-cpushm_1")
    in_use = _segment(tmp_path, "-tp:1-[2-3]-cpushm_0")
    unrelated = _segment(tmp_path, "psm_0123abcd")
    with open(in_use, "r+b") as f, mmap.mmap(f.fileno(), 4096) as mapped:  # a running job's segment
        assert str(in_use) in Path("/proc/self/maps").read_text()
        assert remove_stale_cpu_shm(0, tmp_path) == [stale.name]
        assert mapped[:1] == b"\0"
    assert not stale.exists() and other_rank.exists() and in_use.exists() and unrelated.exists()
    assert remove_stale_cpu_shm(0, tmp_path) == [in_use.name]  # no longer mapped: stale now
    assert remove_stale_cpu_shm(1, tmp_path) == [other_rank.name]
    assert remove_stale_cpu_shm(1, tmp_path) == [] and unrelated.exists()
