"""Checkpoint directories that survive a kill at any moment: write to a temporary dir, mark, rename.

Layout under ``root`` (verl's names, so verl users and tools find their way)::

    root/
      global_step_20/               a complete checkpoint: holds the marker file COMPLETE
      global_step_30/
      latest_checkpointed_iteration.txt   "30": the step of the checkpoint committed last
      .tmp-step_40-<pid>/           being written (or left by a killed run: removed on start)

A save is ``tmp = dirs.begin(step)``; every writer (all ranks) writes into ``tmp``; then the driver
calls ``dirs.commit(tmp, step)``: it fsyncs the files, writes ``COMPLETE`` (step and time), renames
``tmp`` to ``global_step_<step>`` in one atomic ``os.rename``, rewrites the latest-iteration file
atomically and prunes old checkpoints. A kill before the rename leaves only a ``.tmp-*`` dir; only
dirs with the marker are ever resumed from. One writer (the driver) per ``root``.

"Newest" means committed last, not the highest step: a run resumed from an older checkpoint by path
saves lower steps than the ``global_step_*`` dirs its abandoned continuation left. The latest file
names the last commit, and each marker holds a commit sequence number (``seq``) that pruning ranks by.

Also here: ``capture_rng_state`` / ``restore_rng_state`` for the RNG part of a checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from megarl.convert.output_dir import fsync_path
from megarl.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "COMPLETE"
LATEST_FILE = "latest_checkpointed_iteration.txt"
STATE_FILE = "trainer_state.pt"  # the driver's state (step, data-loader position, KL controller, RNG)
STEP_DIR_PREFIX = "global_step_"
TMP_PREFIX = ".tmp-"
RESUME_MODES = ("auto", "disable", "resume_path")
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def read_marker(checkpoint: Union[str, Path]) -> dict[str, Any]:
    """The ``COMPLETE`` marker of a checkpoint dir: ``{"step": int, "time": str, "unix_time": float,
    "seq": int, "files": {...}}`` (``seq``, the commit order, is absent in markers of older versions).

    Raises ``CheckpointError`` naming what is missing when the dir or marker is absent or unreadable.
    """
    path = Path(checkpoint)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a directory)")
    marker = path / COMPLETE_MARKER
    if not marker.is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: it has no {COMPLETE_MARKER} marker file (the save did not "
            "finish, e.g. the run was killed while writing it); resume from an earlier checkpoint"
        )
    try:
        record = json.loads(marker.read_text(encoding="utf-8"))
        record["step"] = int(record["step"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(
            f"checkpoint {path}: marker {marker} is unreadable ({err}); expected JSON with 'step'"
        ) from err
    return record


def _commit_order(marker: dict[str, Any]) -> tuple[int, float, int]:
    """Sort key: commit order. Markers written before ``seq`` existed rank before every newer commit,
    among themselves by write time."""
    return int(marker.get("seq", 0)), float(marker.get("unix_time", 0.0)), int(marker["step"])


class CheckpointDirs:
    """Manages the checkpoint directories under ``root`` and keeps the ``max_to_keep`` committed last.

    ``max_to_keep`` <= 0 or None keeps every checkpoint. Creating the object removes ``.tmp-*``
    dirs left by an earlier process (interrupted saves).
    """

    def __init__(self, root: Union[str, Path], max_to_keep: Optional[int] = None) -> None:
        self.root = Path(root)
        self.max_to_keep = max_to_keep if max_to_keep and max_to_keep > 0 else None
        self.root.mkdir(parents=True, exist_ok=True)
        self._reported: set[Path] = set()
        for stale in sorted(self.root.glob(TMP_PREFIX + "*")):
            logger.warning("checkpoint: removing %s, left by an interrupted save", stale)
            _remove(stale)

    def step_dir(self, step: int) -> Path:
        return self.root / f"{STEP_DIR_PREFIX}{step}"

    def begin(self, step: int) -> Path:
        """Create and return the temporary dir to write the checkpoint of ``step`` into."""
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0, got {step}")
        tmp = self.root / f"{TMP_PREFIX}step_{step}-{os.getpid()}"
        if tmp.exists():
            _remove(tmp)
        tmp.mkdir()
        return tmp

    def discard(self, tmp: Union[str, Path]) -> None:
        """Remove a temporary dir `begin` returned, after a save that failed (logged)."""
        tmp = Path(tmp)
        if tmp.parent.resolve() != self.root.resolve() or not tmp.name.startswith(TMP_PREFIX):
            raise CheckpointError(f"discard({tmp}): not a temporary checkpoint dir under {self.root}")
        if tmp.exists():
            logger.warning("checkpoint: removing the partial save %s", tmp)
            _remove(tmp)

    def commit(self, tmp: Union[str, Path], step: int, fsync_files: bool = True,
               before_rename: Optional[Callable[[], None]] = None) -> Path:
        """Mark ``tmp`` complete, rename it to ``global_step_<step>``, update the latest file, prune.

        The marker lists every file with its size and CRC-32 (what `megarl checkpoint verify` and a
        resume check against). Returns the final path. ``fsync_files`` flushes every file in ``tmp`` to disk first, so that
        the checkpoint is also complete after a power loss (not only after a process kill).
        ``before_rename`` is called once the marker is written, right before the rename that makes
        the checkpoint the one a resume finds (the trainer logs the step's metrics there); if it
        raises, nothing is renamed.
        """
        tmp = Path(tmp)
        expected = self.root / f"{TMP_PREFIX}step_{step}-{os.getpid()}"
        if tmp.resolve() != expected.resolve() or not tmp.is_dir():
            raise CheckpointError(f"commit({tmp}, step={step}): not the dir begin({step}) returned ({expected})")
        files: dict[str, dict[str, int]] = {}
        for dirpath, _, filenames in os.walk(tmp):
            for name in filenames:
                path = Path(dirpath) / name
                if fsync_files:
                    fsync_path(path)
                files[str(path.relative_to(tmp))] = {"size": path.stat().st_size, "crc32": crc32_of_file(path)}
        # The commit order, for pruning: step numbers are not it once a run resumed an older checkpoint.
        seq = 1 + max((int(m.get("seq", 0)) for _, _, m in self._scan_markers()[0]), default=0)
        marker = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "unix_time": time.time(),
                  "seq": seq, "files": files}
        with open(tmp / COMPLETE_MARKER, "w", encoding="utf-8") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        if before_rename is not None:
            before_rename()
        final = self.step_dir(step)
        replaced: Optional[Path] = None
        if final.exists():  # saving a step again (e.g. resumed from an older checkpoint by path)
            replaced = self.root / f"{TMP_PREFIX}replaced-step_{step}-{os.getpid()}"
            os.rename(final, replaced)
        os.rename(tmp, final)
        fsync_path(self.root)
        # The latest file first: a kill while removing the replaced copy (slow) must not leave it
        # naming an older commit; the leftover ``.tmp-replaced-*`` dir is removed on the next start.
        self._write_latest(step)
        if replaced is not None:
            _remove(replaced)
        self.prune(current=step)
        return final

    def _write_latest(self, step: int) -> None:
        latest = self.root / LATEST_FILE
        tmp = self.root / f"{TMP_PREFIX}{LATEST_FILE}-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, latest)
        fsync_path(self.root)

    def _scan_markers(self) -> tuple[list[tuple[int, Path, dict[str, Any]]], list[Path]]:
        """``(step, path, marker)`` of the complete checkpoints (by step) and the incomplete dirs."""
        complete: list[tuple[int, Path, dict[str, Any]]] = []
        incomplete: list[Path] = []
        for path in self.root.iterdir():
            match = _STEP_DIR.match(path.name)
            if not match or not path.is_dir():
                continue
            try:
                marker = read_marker(path)
            except CheckpointError:
                incomplete.append(path)
                continue
            if marker["step"] != int(match.group(1)):
                incomplete.append(path)
                continue
            complete.append((marker["step"], path, marker))
        return sorted(complete, key=lambda item: item[0]), sorted(incomplete)

    def _scan(self) -> tuple[list[tuple[int, Path]], list[Path]]:
        complete, incomplete = self._scan_markers()
        return [(step, path) for step, path, _ in complete], incomplete

    def tracked_step(self) -> Optional[int]:
        """The step the latest file names (the last commit), or None without that file.

        Raises ``CheckpointError`` naming the file when it does not hold a step number.
        """
        latest = self.root / LATEST_FILE
        if not latest.is_file():
            return None
        text = latest.read_text(encoding="utf-8").strip()
        if not text.isdigit():
            raise CheckpointError(f"{latest}: {text!r} is not a step number (it names the step of the last saved "
                                  "checkpoint); fix or remove it, or resume a checkpoint by path")
        return int(text)

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every complete checkpoint, oldest first."""
        return self._scan()[0]

    def incomplete_checkpoints(self) -> list[Path]:
        """``global_step_*`` dirs without a valid marker (not written by a finished save)."""
        return self._scan()[1]

    def latest(self) -> Optional[tuple[int, Path]]:
        """The complete checkpoint committed last ``(step, path)``, or None. Incomplete dirs are logged and skipped.

        That is the one the latest file names when it is complete; otherwise (no or unreadable file,
        or it names a dir that is not a complete checkpoint) the complete one with the newest marker.
        Not the highest step: after a resume from an older checkpoint, higher steps of the abandoned
        continuation may remain.
        """
        complete, incomplete = self._scan_markers()
        for path in incomplete:
            if path not in self._reported:
                self._reported.add(path)
                logger.warning("checkpoint: ignoring %s: no valid %s marker (incomplete save)", path, COMPLETE_MARKER)
        if not complete:
            return None
        try:
            tracked = self.tracked_step()
        except CheckpointError as err:
            logger.warning("checkpoint: %s; taking the complete checkpoint committed last instead", err)
            tracked = None
        named = [(step, path) for step, path, _ in complete if step == tracked]
        if named:
            return named[0]
        step, path, _ = max(complete, key=lambda item: _commit_order(item[2]))
        return step, path

    def prune(self, current: Optional[int] = None) -> list[Path]:
        """Delete complete checkpoints beyond ``max_to_keep``; returns the removed paths.

        ``current``: the step just committed (default: the one the latest file names); it is never
        removed. Checkpoints with a higher step are left from a continuation the run abandoned (it
        resumed an older checkpoint): they go first, then the others oldest commit first.
        """
        if self.max_to_keep is None:
            return []
        if current is None:
            try:
                current = self.tracked_step()
            except CheckpointError as err:
                logger.warning("checkpoint: %s; pruning by commit order only", err)
        complete = self._scan_markers()[0]
        candidates = [(step, path, marker) for step, path, marker in complete if step != current]
        keep_others = self.max_to_keep - (len(complete) - len(candidates))
        # Abandoned (step > current) rank before the current lineage; within each, commit order.
        candidates.sort(key=lambda item: (current is None or item[0] <= current, _commit_order(item[2])))
        removed = [path for _, path, _ in candidates[: max(len(candidates) - keep_others, 0)]]
        for path in removed:
            # Rename first: a kill during the (slow) delete must not leave a marked but partial checkpoint.
            doomed = self.root / f"{TMP_PREFIX}prune-{path.name}-{os.getpid()}"
            os.rename(path, doomed)
            _remove(doomed)
        return removed

    def auto_candidate(self, warn: bool = True) -> Optional[tuple[int, Path]]:
        """What ``trainer.resume_mode=auto`` resumes from, not yet checked: the step the latest file
        names (its dir may be missing or damaged: the caller verifies it), or, without that file,
        the complete checkpoint committed last; None when there is neither.

        Raises ``CheckpointError`` when the latest file does not hold a step number. ``warn``: log the
        higher-step dirs that are passed over (a resume wants to say so; a save does not, every time).
        """
        step = self.tracked_step()
        if step is None:
            return self.latest()
        newer = [path.name for s, path in self.complete_checkpoints() if s > step] if warn else []
        if newer:
            logger.warning("checkpoint: %s names step %d; the higher-step checkpoint dirs %s (left by a continuation "
                           "that was abandoned for an older checkpoint) are not resumed from",
                           self.root / LATEST_FILE, step, newer)
        return step, self.step_dir(step)

    def resolve_resume(self, mode: str, path: Optional[Union[str, Path]] = None) -> Optional[tuple[int, Path]]:
        """Which checkpoint to resume from: ``(step, path)``, or None to start fresh.

        ``mode`` (``trainer.resume_mode``): ``auto`` = the checkpoint the latest file names (the last
        commit; without that file the complete checkpoint committed last; None if there is none),
        which must be complete; ``disable`` = None; ``resume_path`` = ``path``
        (``trainer.resume_from_path``), which must be a complete checkpoint.
        """
        if mode not in RESUME_MODES:
            raise ConfigError(f"trainer.resume_mode={mode!r} is not valid; valid: {list(RESUME_MODES)}")
        if mode == "disable":
            return None
        if mode == "auto":
            found = self.auto_candidate()
            if found is not None and found[1] not in {path for _, path in self.complete_checkpoints()}:
                raise CheckpointError(
                    f"trainer.resume_mode=auto: {self.root / LATEST_FILE} names step {found[0]}, but {found[1]} is "
                    f"not a complete checkpoint{self._available_hint()}; resume one of them with "
                    "trainer.resume_mode=resume_path trainer.resume_from_path=<its dir>"
                )
            return found
        if path is None or str(path) == "":
            raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path (a global_step_N dir)")
        ckpt = Path(path)
        if not ckpt.exists():
            raise CheckpointError(f"trainer.resume_from_path={str(ckpt)!r} does not exist{self._available_hint()}")
        if ckpt.is_dir() and not (ckpt / COMPLETE_MARKER).exists() and any(ckpt.glob(STEP_DIR_PREFIX + "*")):
            raise CheckpointError(
                f"trainer.resume_from_path={str(ckpt)!r} is a checkpoint root, not a checkpoint: name one of its "
                f"{STEP_DIR_PREFIX}N dirs, or use trainer.resume_mode=auto"
            )
        try:
            return read_marker(ckpt)["step"], ckpt
        except CheckpointError as err:
            raise CheckpointError(f"trainer.resume_from_path: {err}{self._available_hint()}") from err

    def _available_hint(self) -> str:
        complete = self.complete_checkpoints()
        if not complete:
            return f" (no complete checkpoint under {self.root})"
        return f" (complete checkpoints under {self.root}: {', '.join(p.name for _, p in complete)})"


def crc32_of_file(path: Path) -> int:
    """CRC-32 of a file's bytes, read in 16 MiB pieces."""
    crc = 0
    with open(path, "rb") as f:
        while piece := f.read(16 * 2**20):
            crc = zlib.crc32(piece, crc)
    return crc


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def capture_rng_state() -> dict[str, Any]:
    """RNG states of python ``random``, numpy's global generator, torch CPU and every CUDA device.

    Only plain types and tensors, so ``torch.load(..., weights_only=True)`` reads it back.
    """
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore states captured by ``capture_rng_state`` (CUDA only when both sides have it)."""
    try:
        py = state["python"]
        random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
        npy = state["numpy"]
        np.random.set_state(
            (npy["kind"], np.asarray(npy["keys"], dtype=np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
        )
        torch.set_rng_state(state["torch_cpu"])
    except KeyError as err:
        raise CheckpointError(f"RNG state in checkpoint lacks {err}; expected keys python, numpy, torch_cpu") from err
    if "torch_cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["torch_cuda"])
        else:
            logger.warning("checkpoint: CUDA RNG state not restored (no CUDA on this machine)")
