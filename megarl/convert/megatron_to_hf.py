"""Megatron dist checkpoint (any TP/PP it was saved at) -> Hugging Face directory.

One process, no process group. The output appears only when complete. It never builds the model: it reads one
layer's global tensors at a time straight from the checkpoint's storage
(reassembled from whatever shards were saved), turns them into HF tensors and
streams them into safetensors files of bounded size. Each stored chunk is read
once; peak memory is the stored chunks of one pipeline stage (1/PP of the model
as saved) plus one output file.

``fp8``: the linear layers' weights are written as block fp8 (float8_e4m3fn
plus a float32 ``weight_scale_inv`` per 128x128 block) and config.json gets
the ``quantization_config`` SGLang's block-fp8 Llama loads; embeddings, norms
and lm_head keep ``dtype`` (bf16 by default then). This is the checkpoint
megarl's SGLang servers start from.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

from megarl.checkpointing.dist_checkpoint_reader import DistCheckpointReader
from megarl.checkpointing.megatron_checkpoint import TOKENIZER_DIR, read_spec, resolve_checkpoint_dir
from megarl.convert.dtypes import parse_dtype
from megarl.errors import CheckpointError
from megarl.models.hf_checkpoint import write_config
from megarl.models.hf_mapping import TensorMapping, layer_key, tensor_mappings, to_hf
from megarl.models.spec import ModelSpec
from megarl.weight_sync import fp8 as fp8_format
from megarl.weight_sync.fp8 import BLOCK_FP8_QUANT_CONFIG

# safetensors and tqdm are imported where they are used: only an export needs them, and the GPU
# check's torch-and-Megatron-only machine has neither (tests/multiprocess/test_gpu_check.py).


@dataclass(frozen=True)
class MegatronToHf:
    megatron: str
    output: str
    dtype: str = "auto"  # auto: the checkpoint's dtype (bf16 with fp8)
    max_shard_gb: float = 5.0
    fp8: bool = False  # block-fp8 linears (SGLang's format)
    progress: bool = True


# HF names of the weights SGLang serves in block fp8 (it fuses q/k/v and gate/up on load)
FP8_HF_LINEARS = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


def _add_tensor(
    writer: "ShardedSafetensorsWriter", name: str, tensor: torch.Tensor, dtype: torch.dtype, fp8: bool
) -> None:
    if fp8 and name.startswith("model.layers.") and name.endswith(FP8_HF_LINEARS):
        q, scale_inv = fp8_format.quantize(tensor)
        writer.add(name, q)
        writer.add(name + fp8_format.SCALE_SUFFIX, scale_inv)
    else:
        writer.add(name, tensor.to(dtype))


class ShardedSafetensorsWriter:
    """Writes HF's model-0000i-of-0000n.safetensors files plus the index."""

    def __init__(self, out_dir: Path, max_shard_bytes: int):
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self.pending: Dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list = []  # (temporary name, tensor names)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        tmp_name = f".part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.out_dir / tmp_name), metadata={"format": "pt"})
        self.files.append((tmp_name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        self.flush()
        n = len(self.files)
        if n == 1:
            os.replace(self.out_dir / self.files[0][0], self.out_dir / "model.safetensors")
            return
        weight_map = {}
        for i, (tmp_name, names) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out_dir / tmp_name, self.out_dir / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def hf_tensors(
    reader: DistCheckpointReader, spec: ModelSpec, layer: Optional[int], mappings: Optional[List[TensorMapping]] = None
) -> Dict[str, torch.Tensor]:
    """The Hugging Face tensors of one layer (``None``: the tensors outside the layers), read from
    a checkpoint whose layer tensors are stacked (dense models) or keyed per layer (with experts)."""
    out: Dict[str, torch.Tensor] = {}
    for m in mappings or tensor_mappings(spec):
        if (layer is None) == m.per_layer or (layer is not None and not m.on_layer(spec, layer)):
            continue
        if layer is None or reader.has(m.megatron_key):
            tensor = reader.read(m.megatron_key, layer)
        else:
            tensor = reader.read(layer_key(m.megatron_key, layer))
        out.update(to_hf(m, spec, tensor, layer))
    return out


def from_args(a: argparse.Namespace) -> MegatronToHf:
    """The settings from convert/cli.py's arguments."""
    return MegatronToHf(a.megatron, a.output, a.dtype, a.max_shard_gb, fp8=a.fp8)


def convert(args: MegatronToHf) -> None:
    start = time.perf_counter()
    # every file against the manifest first: a damaged checkpoint is named, not half-exported
    ckpt_dir = resolve_checkpoint_dir(args.megatron, verify="checksums")
    spec = read_spec(ckpt_dir)
    dtype: Optional[torch.dtype] = parse_dtype(args.dtype) or (torch.bfloat16 if args.fp8 else None)
    out = Path(args.output)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"--output {out}: directory is not empty; refusing to overwrite it")
    # Written beside the destination and renamed into place when complete.
    staging = out.parent / f".{out.name}.incomplete"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    reader = DistCheckpointReader(ckpt_dir)
    writer = ShardedSafetensorsWriter(staging, int(args.max_shard_gb * 2**30))
    mappings = tensor_mappings(spec)
    steps = [None] + list(range(spec.num_layers))
    if args.progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc="export", unit="layer")
    for layer in steps:
        for name, tensor in hf_tensors(reader, spec, layer, mappings).items():
            dtype = dtype or tensor.dtype
            _add_tensor(writer, name, tensor, dtype, args.fp8)
        if layer is not None:
            reader.release_layers_before(layer + 1)
    writer.close()
    write_config(spec, staging, dtype, quantization_config=BLOCK_FP8_QUANT_CONFIG if args.fp8 else None)
    if (ckpt_dir / TOKENIZER_DIR).is_dir():
        shutil.copytree(ckpt_dir / TOKENIZER_DIR, staging, dirs_exist_ok=True)
    if out.exists():
        out.rmdir()  # empty, checked above
    os.replace(staging, out)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(
        f"exported {ckpt_dir} -> {out} ({writer.total_bytes / 2**30:.2f} GiB, {dtype}{', fp8 linears' if args.fp8 else ''}) in "
        f"{time.perf_counter() - start:.1f} s; peak RSS {peak:.2f} GiB",
        flush=True,
    )
