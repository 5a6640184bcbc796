"""vLLM tier: no stale shared memory of an earlier tensor-parallel engine.

vLLM's CPU build (0.32) names the shared-memory segments of a tensor-parallel group
`<ident>-<group>-[<ranks>]-cpushm_<rank>` under /dev/shm, and under the external launcher the
identifier is empty, so every TP=2 engine on the machine uses the same two names. A segment left by
an engine that was killed (a timed-out test) makes every later TP engine fail to start with
"create shm in SHMManager failed. errno: 17". Before each test, such segments that no live process
maps are removed; a segment in use is never touched.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

SHM_DIR = Path("/dev/shm")


def _mapped_shm_names() -> set[str]:
    """Names of /dev/shm files that some process has mapped (read from /proc/*/maps)."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or is not ours to read
            continue
        for line in text.splitlines():
            if "/dev/shm/" in line:
                names.add(line.split("/dev/shm/", 1)[1].removesuffix(" (deleted)"))
    return names


@pytest.fixture(autouse=True)
def no_stale_tensor_parallel_shm() -> Iterator[None]:
    stale = sorted(SHM_DIR.glob("*-cpushm_*")) if SHM_DIR.is_dir() else []
    if stale:
        in_use = _mapped_shm_names()
        for path in stale:
            if path.name not in in_use:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
    yield
