"""Build this rank's Megatron model at a layout and load a megarl checkpoint into it."""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch

from megarl.checkpointing.dist_checkpoint_reader import DistCheckpointReader
from megarl.checkpointing.megatron_checkpoint import load_model, read_spec, resolve_checkpoint_dir
from megarl.models.megatron_model import build_model_chunks, transformer_config
from megarl.models.spec import ModelSpec
from megarl.parallel_dims import ParallelDims


def load_megatron_model(
    path: os.PathLike, dims: ParallelDims, params_dtype: Optional[torch.dtype] = None, **config_overrides
) -> Tuple[ModelSpec, List[torch.nn.Module]]:
    """Megatron parallel state must already be initialised for ``dims`` (runtime.distributed.init_megatron)."""
    ckpt_dir = resolve_checkpoint_dir(path)
    spec = read_spec(ckpt_dir)
    if params_dtype is None:
        params_dtype = DistCheckpointReader(ckpt_dir).dtype("decoder.final_layernorm.weight")
    config = transformer_config(
        spec,
        dims.tp,
        dims.pp,
        dims.virtual_pipeline_model_parallel_size,
        params_dtype=params_dtype,
        ep=dims.ep,
        etp=dims.etp,
        perform_initialization=False,
        **config_overrides,
    )
    chunks = build_model_chunks(spec, config)
    load_model(chunks, ckpt_dir)
    return spec, chunks
