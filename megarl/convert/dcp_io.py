"""Stream tensors into and out of a Megatron `torch_dist` checkpoint from one process.

Megatron's `dist_checkpointing.save` needs every tensor in memory at once. Here the checkpoint is
written with PyTorch distributed checkpointing (the format `torch_dist` is built on) through a
save planner that lists every chunk up front (key, offsets, sizes, dtype) and computes a chunk's
data only when the writer asks for it; the writer writes it and drops it. Reading works the same
way: one chunk (e.g. one decoder layer of a stacked key) per call. No process group is needed.

Files written: `__0_0.distcp` (data), `.metadata` (PyTorch's), `common.pt` (Megatron's common
state: non-tensor entries) and `metadata.json` (Megatron's format marker, written last).
"""

from __future__ import annotations

import json
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

from megarl.errors import CheckpointError

# What megatron.core.dist_checkpointing writes for the torch_dist backend (format version 1).
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}


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
    writer = FileSystemWriter(str(directory), single_file_per_rank=True, thread_count=1, sync_files=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: running without distributed" notices
        _unwrapped(lambda: dcp.save({}, storage_writer=writer, planner=planner, no_dist=True))
    planner.flush()
    torch.save(common, directory / "common.pt")
    (directory / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))


class CheckpointReader:
    """Read boxes of tensors from a `torch_dist` checkpoint directory (no process group)."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        marker = self.dir / "metadata.json"
        if not marker.is_file():
            raise CheckpointError(f"{self.dir}: not a complete Megatron distributed checkpoint (metadata.json missing)")
        backend = json.loads(marker.read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise CheckpointError(f"{self.dir}: sharded_backend={backend!r}, only 'torch_dist' is supported")
        self.metadata: Metadata = FileSystemReader(str(self.dir)).read_metadata()

    def common(self) -> dict[str, Any]:
        path = self.dir / "common.pt"
        if not path.is_file():
            raise CheckpointError(f"{self.dir}: common.pt missing")
        return torch.load(path, map_location="cpu", weights_only=False)

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
        out = torch.empty(sizes, dtype=md.properties.dtype)
        planner = _BoxLoadPlanner(key, md, offsets, out)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _unwrapped(lambda: dcp.load({}, storage_reader=FileSystemReader(str(self.dir)), planner=planner, no_dist=True))
        return out


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
