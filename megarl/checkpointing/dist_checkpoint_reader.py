"""Read single global tensors (or one layer of them) from a torch_dist checkpoint.

Megatron's torch_dist format is a torch.distributed.checkpoint (DCP) directory
whose tensor names are Megatron's sharded keys. Exporting a model needs none
of Megatron's machinery, only "give me layer i of key k", in one process with
no process group. Megatron's own loader cannot do that in a world of one
(megatron-core 0.16.1 builds the torch ShardedTensor placements of the other
fragments as ``rank (rank + 1) % world_size``, i.e. itself), so this reads the
DCP storage directly through DCP's public reader/planner interfaces.

Each storage chunk (one saving rank's shard of one key) is read once and kept
until no layer still to be read needs it, so reading a model layer by layer
reads every byte once and holds at most the chunks of one pipeline stage.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from megarl.errors import CheckpointError


class _IntoBuffers(LoadPlanner):
    """The smallest LoadPlanner: each read item lands in a preallocated buffer."""

    def __init__(self, buffers: Dict[MetadataIndex, torch.Tensor]):
        self.buffers = buffers

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        pass

    def create_local_plan(self):
        raise NotImplementedError

    def create_global_plan(self, global_plan):
        raise NotImplementedError

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value):
        raise CheckpointError(f"unexpected non-tensor item {read_item.storage_index.fqn!r}")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.buffers[read_item.storage_index]

    def commit_tensor(self, read_item, tensor):
        pass


class DistCheckpointReader:
    def __init__(self, ckpt_dir: os.PathLike):
        self.path = Path(ckpt_dir)
        self.reader = FileSystemReader(str(self.path))
        self.metadata = self.reader.read_metadata()
        self.reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        self._chunks: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}

    def _tensor_metadata(self, key: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{self.path}: tensor {key!r} is not in the checkpoint")
        return md

    def has(self, key: str) -> bool:
        return isinstance(self.metadata.state_dict_metadata.get(key), TensorStorageMetadata)

    def shape(self, key: str) -> Tuple[int, ...]:
        return tuple(self._tensor_metadata(key).size)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensor_metadata(key).properties.dtype

    def read(self, key: str, layer: Optional[int] = None) -> torch.Tensor:
        """The whole global tensor, or its slice ``[layer]`` for a layer-stacked key."""
        md = self._tensor_metadata(key)
        size = tuple(md.size)
        out = torch.empty(size if layer is None else size[1:], dtype=md.properties.dtype)
        for chunk in md.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if layer is not None and not offsets[0] <= layer < offsets[0] + sizes[0]:
                continue
            data = self._chunk(key, offsets, sizes)
            if layer is not None:
                data, offsets, sizes = data[layer - offsets[0]], offsets[1:], sizes[1:]
            out[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))] = data
        return out

    def release_layers_before(self, layer: int) -> None:
        """Drop cached chunks that hold only layers < ``layer``."""
        for (key, offsets), data in list(self._chunks.items()):
            if offsets[0] + data.shape[0] <= layer:
                del self._chunks[(key, offsets)]

    @staticmethod
    def _is_layer_stacked(key: str) -> bool:
        # Only layer-stacked chunks are worth keeping: the next layers reuse them. A model keyed
        # per layer (one with experts: decoder.layers.<i>.<rest>) reads each chunk for one layer.
        return key.startswith("decoder.layers.") and not key.split(".")[2].isdigit()

    def _chunk(self, key: str, offsets: Tuple[int, ...], sizes: Tuple[int, ...]) -> torch.Tensor:
        cached = self._chunks.get((key, offsets))
        if cached is not None:
            return cached
        md = self._tensor_metadata(key)
        index = MetadataIndex(key, torch.Size(offsets))
        buffer = torch.empty(sizes, dtype=md.properties.dtype)
        item = ReadItem(
            type=LoadItemType.TENSOR,
            dest_index=index,
            dest_offsets=torch.Size([0] * len(sizes)),
            storage_index=index,
            storage_offsets=torch.Size([0] * len(sizes)),
            lengths=torch.Size(sizes),
        )
        self.reader.read_data(LoadPlan([item]), _IntoBuffers({index: buffer})).wait()
        if self._is_layer_stacked(key):
            self._chunks[(key, offsets)] = buffer
        return buffer
