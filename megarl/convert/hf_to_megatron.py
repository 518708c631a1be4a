"""Hugging Face Llama (safetensors or GGUF) -> Megatron dist checkpoint.

Runs as a world of TP x PP ranks (spawned locally, or under torchrun). Every
rank builds its own shard of Megatron's GPTModel, then, one layer at a time,
reads that layer's HF tensors, forms Megatron's global tensor (fused QKV
grouped per KV group, [gate; up], padded vocabulary) and copies out only its
own slice, using the offsets Megatron's own sharded_state_dict reports. So the
slicing is Megatron's, not a re-implementation, and no rank ever holds more
than its shard plus one layer of HF tensors: peak memory across all ranks is
one copy of the model plus one layer per rank (plus ~0.5 GB of torch and
Megatron per process). GGUF input is first dequantised by transformers (one
full fp32 copy on rank 0, released before the Megatron model is built).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shutil
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megarl.checkpointing.megatron_checkpoint import iter_sharded_tensors, model_sharded_state_dict, save_model
from megarl.convert.dtypes import parse_dtype
from megarl.errors import CheckpointError, ConfigError
from megarl.models.hf_checkpoint import SafetensorsCheckpoint, gguf_spec, materialize_gguf
from megarl.models.hf_mapping import mapping_by_key, split_layer_key, to_megatron
from megarl.models.megatron_model import DEFAULT_VOCAB_DIVISIBLE_BY, build_model_chunks, transformer_config
from megarl.models.spec import ModelSpec
from megarl.parallel_dims import ParallelDims
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown
from megarl.runtime.launch import run_world, running_under_torchrun

GGUF_STAGING = ".hf_from_gguf"


@dataclass(frozen=True)
class HfToMegatron:
    hf_model: str
    output: str
    tp: int = 1
    pp: int = 1
    gguf_file: Optional[str] = None
    dtype: str = "auto"  # auto: the HF checkpoint's dtype
    vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY
    ep: int = 1
    etp: Optional[int] = None  # None: tp

    @property
    def dims(self) -> ParallelDims:
        """The conversion's world: TP x PP, times the data-parallel ranks expert parallelism is carved
        out of (the fewest that hold EP x ETP). The checkpoint is layout independent; EP spreads the
        experts' memory over more ranks."""
        expert = self.ep * (self.tp if self.etp is None else self.etp)
        dp = math.lcm(self.tp, expert) // self.tp
        return ParallelDims(tp=self.tp, pp=self.pp, dp=dp, ep=self.ep, etp=self.etp, section="convert")


def from_args(a: argparse.Namespace) -> HfToMegatron:
    """The settings from convert/cli.py's arguments."""
    return HfToMegatron(a.hf_model, a.output, a.tp, a.pp, a.gguf_file, a.dtype, a.vocab_divisible_by, a.ep, a.etp)


def convert(args: HfToMegatron) -> None:
    """Entry point: validate cheaply here, then run the ranks."""
    hf = Path(args.hf_model)
    if not hf.exists():
        raise CheckpointError(f"--hf-model {hf}: no such file or directory")
    parse_dtype(args.dtype)
    out = Path(args.output)
    # Hidden entries are this tool's own staging (an interrupted run's leftovers).
    if out.exists() and any(not p.name.startswith(".") for p in out.iterdir()):
        raise CheckpointError(f"--output {out}: directory is not empty; refusing to overwrite it")
    spec = gguf_spec(hf, args.gguf_file) if args.gguf_file or hf.suffix == ".gguf" else SafetensorsCheckpoint(hf).spec
    spec.check_parallelism(args.tp, args.pp, ep=args.ep, etp=args.etp)
    world = args.dims.world_size
    if running_under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ConfigError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {args.dims.describe()} is {world} ranks")
        convert_rank(args)
    else:
        run_world(convert_rank, world, args)


def convert_rank(args: HfToMegatron) -> None:
    start = time.perf_counter()
    rank = init_distributed()
    out = Path(args.output)
    hf_dir = Path(args.hf_model)
    staged = None
    if args.gguf_file or hf_dir.suffix == ".gguf":
        staged = out / GGUF_STAGING
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            if not (staged / "config.json").exists():
                materialize_gguf(hf_dir, args.gguf_file, staged)
        dist.barrier()
        hf_dir = staged
    hf = SafetensorsCheckpoint(hf_dir)
    spec = hf.spec
    spec.check_parallelism(args.tp, args.pp, ep=args.ep, etp=args.etp)
    dtype = parse_dtype(args.dtype) or hf.dtype()
    init_megatron(args.dims)
    config = transformer_config(
        spec, args.tp, args.pp, params_dtype=dtype, ep=args.ep, etp=args.etp, perform_initialization=False
    )
    chunks = build_model_chunks(spec, config, vocab_divisible_by=args.vocab_divisible_by)
    fill_from_hf(chunks, spec, hf.get, show_progress=rank == 0)
    ckpt_dir = save_model(chunks, out, spec, tokenizer_files=hf.side_files())
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    if rank == 0 and staged is not None:
        shutil.rmtree(staged, ignore_errors=True)
        print(
            f"converted {args.hf_model} -> {ckpt_dir} ({args.dims.describe()}, {dtype}, "
            f"{spec.num_parameters() / 1e6:.1f}M parameters) in {time.perf_counter() - start:.1f} s; "
            f"peak RSS per rank GiB: {', '.join(f'{p:.2f}' for p in peaks)}",
            flush=True,
        )
    shutdown()


def fill_from_hf(chunks, spec: ModelSpec, read_hf: Callable[[str], torch.Tensor], show_progress: bool = False) -> None:
    """Copy each rank's slice of every Megatron global tensor from the HF weights.

    The tensors are grouped by (key, layer, expert) so that a rank reads only the experts it holds
    (a Qwen3-235B layer's experts are ~5 GB in bf16)."""
    by_key = mapping_by_key(spec)
    groups = defaultdict(list)
    for shard in iter_sharded_tensors(model_sharded_state_dict(chunks)):
        key, layer = split_layer_key(shard.key)  # a model with experts: keyed per layer
        if key not in by_key:
            raise CheckpointError(f"no Hugging Face source known for Megatron tensor {shard.key!r}")
        axes = list(shard.global_offset[: shard.prepend_axis_num])  # [layer] if stacked, then [expert]
        if layer is None and key.startswith("decoder.layers."):
            layer = axes.pop(0)
        expert = axes.pop(0) if by_key[key].per_expert else None
        if axes:
            raise CheckpointError(f"{shard.key}: unexpected leading axes {shard.global_offset}")
        groups[(key, layer, expert)].append(shard)
    with torch.no_grad():
        # NaN sentinel: afterwards every element of every parameter must have been written.
        for chunk in chunks:
            for param in chunk.parameters():
                param.fill_(float("nan"))
        order = sorted(groups, key=lambda g: (-1 if g[1] is None else g[1], g[0], -1 if g[2] is None else g[2]))
        if show_progress:
            # lazily: the GPU check converts its random model through this module (model_source.py)
            # where tqdm is not installed (tests/multiprocess/test_gpu_check.py)
            from tqdm import tqdm

            order = tqdm(order, desc="convert", unit="tensor")
        for key, layer, expert in order:
            shards = groups[(key, layer, expert)]
            lead = shards[0].prepend_axis_num
            full = to_megatron(by_key[key], spec, read_hf, layer, shards[0].global_shape[lead], expert)
            if tuple(full.shape) != tuple(shards[0].global_shape[lead:]):
                raise CheckpointError(
                    f"{key} (layer {layer}{'' if expert is None else f', expert {expert}'}): Hugging Face weights "
                    f"give shape {tuple(full.shape)}, the model expects {tuple(shards[0].global_shape[lead:])}"
                )
            for shard in shards:
                index = tuple(slice(o, o + n) for o, n in zip(shard.global_offset[lead:], shard.local_shape))
                shard.data.copy_(full[index])
            del full
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                if torch.isnan(param).any():
                    raise CheckpointError(
                        f"parameter {name} holds NaN after conversion: not fully written, or NaN in the source"
                    )
