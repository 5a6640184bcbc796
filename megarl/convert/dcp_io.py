"""Stream tensors into and out of a Megatron `torch_dist` checkpoint from one process.

Megatron's `dist_checkpointing.save` needs every tensor in memory at once. Here the checkpoint is
written with PyTorch distributed checkpointing (the format `torch_dist` is built on) through a
save planner that lists every chunk up front (key, offsets, sizes, dtype) and computes a chunk's
data only when the writer asks for it; the writer writes it and drops it. Reading works the same
way: one chunk (e.g. one decoder layer of a stacked key) per call. No process group is needed.

Files written: `__0_0.distcp` (data), `.metadata` (PyTorch's), `common.pt` (Megatron's common
state: non-tensor entries) and `metadata.json` (Megatron's format marker, written last); each is
flushed to disk (fsync) before the next, so that the marker never outlives the data in a crash.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megarl.convert import MEGATRON_MARKER
from megarl.convert.output_dir import fsync_path
from megarl.errors import CheckpointError
from megarl.trainer.checkpoint_dirs import LATEST_FILE, STEP_DIR_PREFIX

# What megatron.core.dist_checkpointing writes for the torch_dist backend (format version 1).
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}
MARKER_NAME = MEGATRON_MARKER  # Megatron's format marker
DCP_METADATA_NAME = ".metadata"  # PyTorch's index: every tensor's chunks and where their bytes are
ENGINE_DIRS = ("actor", "critic")  # the engine checkpoints of a trainer step directory


@dataclass(frozen=True)
class Chunk:
    """A box of a checkpoint tensor: `make()` returns its data, shape `sizes`, dtype `dtype`."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]


def _unwrapped(call: Callable[[], Any]) -> Any:
    """Run a DCP save/load; re-raise the first rank's original error instead of DCP's wrapper
    (which is a BaseException, so that a plain `except Exception` would not see it)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return call()
    except CheckpointException as err:
        for failure in err.failures.values():
            original = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(original, BaseException):
                raise original from None
        raise


class _StreamingSavePlanner(DefaultSavePlanner):
    """A save planner whose write items are given, and whose data is made on request."""

    def __init__(self, chunks: list[Chunk], on_written: Callable[[Chunk], None] | None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {(c.key, c.offsets): c for c in chunks}
        self._order = chunks
        self._on_written = on_written
        self._pending: Chunk | None = None

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(c.key, torch.Size(c.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                    properties=TensorProperties(dtype=c.dtype),
                    size=torch.Size(c.global_shape),
                ),
            )
            for c in self._order
        ]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        # The writer asks for one item, writes it, then asks for the next: report the previous.
        if self._pending is not None and self._on_written is not None:
            self._on_written(self._pending)
        chunk = self._chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        data = chunk.make()
        if tuple(data.shape) != chunk.sizes or data.dtype != chunk.dtype:
            raise CheckpointError(
                f"{chunk.key} at {list(chunk.offsets)}: made {list(data.shape)} {data.dtype}, "
                f"planned {list(chunk.sizes)} {chunk.dtype}"
            )
        self._pending = chunk
        return data.contiguous()

    def flush(self) -> None:
        if self._pending is not None and self._on_written is not None:
            self._on_written(self._pending)
        self._pending = None


def write_checkpoint(directory: str | Path, chunks: list[Chunk], common: dict[str, Any],
                     on_written: Callable[[Chunk], None] | None = None) -> None:
    """Write `chunks` (covering each tensor exactly once) and `common` into an empty directory."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    planner = _StreamingSavePlanner(chunks, on_written)
    # sync_files: the data and `.metadata` are fsynced before dcp.save returns.
    writer = FileSystemWriter(str(directory), single_file_per_rank=True, thread_count=1, sync_files=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: running without distributed" notices
        _unwrapped(lambda: dcp.save({}, storage_writer=writer, planner=planner, no_dist=True))
    planner.flush()
    torch.save(common, directory / "common.pt")
    fsync_path(directory / "common.pt")
    (directory / MARKER_NAME).write_text(json.dumps(MEGATRON_METADATA))
    fsync_path(directory / MARKER_NAME)
    fsync_path(directory)


def _step_numbers(root: Path) -> list[int]:
    """The N of the `global_step_N` directories under `root`, in order."""
    names = (p.name[len(STEP_DIR_PREFIX):] for p in root.glob(STEP_DIR_PREFIX + "*") if p.is_dir())
    return sorted(int(n) for n in names if n.isdigit())


def not_a_checkpoint(path: Path) -> str:
    """Why `path`, which has no `metadata.json`, is not a Megatron distributed checkpoint: missing,
    another kind of directory (a trainer step or root, a HF model), or an unfinished save."""
    if not path.exists():
        return f"{path}: no such directory (a Megatron distributed checkpoint is expected)"
    if not path.is_dir():
        return f"{path}: not a directory (a Megatron distributed checkpoint is a directory)"
    engines = [str(path / name) for name in ENGINE_DIRS if (path / name / MARKER_NAME).is_file()]
    if engines:
        return f"{path} is a trainer step directory: pass one of {engines}"
    steps = _step_numbers(path)
    if steps or (path / LATEST_FILE).is_file():
        example = path / f"{STEP_DIR_PREFIX}{steps[-1] if steps else 'N'}" / ENGINE_DIRS[0]
        return (f"{path} is a trainer checkpoint root (it holds {STEP_DIR_PREFIX}* step directories): pass the "
                f"engine checkpoint of one step, {STEP_DIR_PREFIX}N/{ENGINE_DIRS[0]} (or /{ENGINE_DIRS[1]}), "
                f"e.g. {example}")
    if (path / "config.json").is_file() and any(path.glob("*.safetensors*")):
        return (f"{path} is a HF model directory (config.json and safetensors weights), not a Megatron distributed "
                f"checkpoint ({MARKER_NAME}, {DCP_METADATA_NAME}, *.distcp)")
    if (path / DCP_METADATA_NAME).is_file() or any(path.glob("*.distcp")):
        return (f"{path}: not a complete Megatron distributed checkpoint: {MARKER_NAME} is missing (it is written "
                "last, so the save did not finish)")
    return f"{path}: not a Megatron distributed checkpoint (no {MARKER_NAME}, {DCP_METADATA_NAME} or *.distcp files)"


class CheckpointReader:
    """Read boxes of tensors from a `torch_dist` checkpoint directory (no process group)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        marker = self.dir / MARKER_NAME
        if not marker.is_file():
            raise CheckpointError(not_a_checkpoint(self.dir))
        try:
            backend = json.loads(marker.read_text()).get("sharded_backend")
        except (ValueError, AttributeError) as err:
            raise CheckpointError(f"{marker}: not Megatron's format marker (a JSON object with "
                                  f"'sharded_backend'): {err}") from err
        if backend != "torch_dist":
            raise CheckpointError(f"{self.dir}: sharded_backend={backend!r}, only 'torch_dist' is supported")
        index = self.dir / DCP_METADATA_NAME
        if not index.is_file():
            raise CheckpointError(f"{index} is missing: the checkpoint has no index of its tensors (PyTorch's "
                                  "distributed checkpoint metadata, written with the data); it is damaged")
        try:
            self.metadata: Metadata = FileSystemReader(str(self.dir)).read_metadata()
        except Exception as err:  # whatever unpickling a damaged file raises
            raise CheckpointError(f"{index}: unreadable ({type(err).__name__}: {err}); the checkpoint is "
                                  "damaged") from err

    def common(self) -> dict[str, Any]:
        path = self.dir / "common.pt"
        if not path.is_file():
            raise CheckpointError(f"{self.dir}: common.pt missing")
        try:
            return torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:  # whatever unpickling a damaged file raises
            raise CheckpointError(f"{path}: unreadable ({type(err).__name__}: {err}); the checkpoint is "
                                  "damaged") from err

    def tensor_meta(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{self.dir}: checkpoint has no tensor {key!r}")
        return md

    def read(self, key: str, offsets: tuple[int, ...] | None = None, sizes: tuple[int, ...] | None = None) -> torch.Tensor:
        """The box [offsets, offsets + sizes) of tensor `key` (the whole tensor by default)."""
        import torch.distributed.checkpoint as dcp

        md = self.tensor_meta(key)
        offsets = tuple(offsets) if offsets is not None else (0,) * len(md.size)
        sizes = tuple(sizes) if sizes is not None else tuple(md.size)
        if len(offsets) != len(md.size) or any(o < 0 or o + n > d for o, n, d in zip(offsets, sizes, md.size)):
            raise CheckpointError(f"{self.dir}: box at {list(offsets)} of size {list(sizes)} is outside tensor {key} "
                                  f"of shape {list(md.size)}")
        files = self._check_stored(key, md, offsets, sizes)
        out = torch.empty(sizes, dtype=md.properties.dtype)
        planner = _BoxLoadPlanner(key, md, offsets, out)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _unwrapped(lambda: dcp.load({}, storage_reader=FileSystemReader(str(self.dir)), planner=planner,
                                            no_dist=True))
        except CheckpointError:
            raise
        except Exception as err:  # a damaged data file: whatever the zip/unpickle layers raise
            raise CheckpointError(f"{self.dir}: cannot read tensor {key} from {', '.join(files)} "
                                  f"({type(err).__name__}: {err}); the checkpoint is damaged") from err
        return out

    def _check_stored(self, key: str, md: TensorStorageMetadata, offsets: tuple[int, ...],
                      sizes: tuple[int, ...]) -> list[str]:
        """Raise unless the stored chunks cover the box and their files hold their bytes (the buffer
        `read` fills starts uninitialised: a gap would come back as garbage). Returns the files read."""
        files: dict[str, int] = {}  # file -> bytes it must hold
        covered = 0
        for c in md.chunks:
            overlap = math.prod(max(0, min(o + n, co + cn) - max(o, co))
                                for o, n, co, cn in zip(offsets, sizes, c.offsets, c.sizes))
            if not overlap:
                continue
            covered += overlap
            where = (self.metadata.storage_data or {}).get(MetadataIndex(key, c.offsets))
            if where is None:
                raise CheckpointError(f"{self.dir / DCP_METADATA_NAME}: tensor {key} chunk at {list(c.offsets)} has "
                                      "no storage entry; the checkpoint is damaged")
            files[where.relative_path] = max(files.get(where.relative_path, 0), where.offset + where.length)
        total = math.prod(sizes)
        if covered < total:
            whole = tuple(sizes) == tuple(md.size)
            box = "" if whole else f" in the box at {list(offsets)} of size {list(sizes)}"
            raise CheckpointError(
                f"{self.dir / DCP_METADATA_NAME}: tensor {key} is stored incompletely: its chunks (in "
                f"{sorted(files) or 'no file'}) hold {covered} of the {total} elements{box}; the checkpoint is "
                "incomplete (e.g. written split into pieces that do not cover the tensor)"
            )
        for name, need in sorted(files.items()):
            path = self.dir / name
            size = path.stat().st_size if path.is_file() else None
            if size is None or size < need:
                state = "missing" if size is None else f"truncated ({size} bytes)"
                raise CheckpointError(f"{path}: {state}, tensor {key} needs its bytes up to {need}; the checkpoint "
                                      "is damaged")
        return [str(self.dir / name) for name in sorted(files)]


class _BoxLoadPlanner(LoadPlanner):
    """Reads one box of one tensor into a given buffer."""

    def __init__(self, key: str, md: TensorStorageMetadata, offsets: tuple[int, ...], out: torch.Tensor) -> None:
        self.key, self.md, self.offsets, self.out = key, md, offsets, out

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        box = ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.out.shape)
        return LoadPlan(create_read_items_for_chunk_list(self.key, self.md, [box]))

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointError(f"unexpected bytes item {read_item.storage_index.fqn}")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self.out
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # `resolve_tensor` returned a view of the output buffer: already in place
