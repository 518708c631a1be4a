"""Generator weights in SGLang's TP layout, from a Hugging Face checkpoint.

The initial load of a generator worker (later versions arrive by weight sync,
which writes the same tensors). Each rank reads only its rows and columns,
one tensor at a time; fp8 weights are assembled in the serving dtype and then
block-quantised, exactly as a sync with ``fp8=True`` delivers them.
"""

from __future__ import annotations

import math
from typing import Dict

import torch

from megarl.models.hf_checkpoint import SafetensorsCheckpoint
from megarl.weight_sync import fp8 as fp8_format
from megarl.weight_sync.endpoints import allocate_generator_params
from megarl.weight_sync.layouts import sglang_rank_layout


def load_generator_params(
    hf: SafetensorsCheckpoint,
    tp: int,
    tp_rank: int,
    dtype: torch.dtype = torch.bfloat16,
    fp8: bool = False,
    device="cpu",
    ep: int = 1,
) -> Dict[str, torch.Tensor]:
    """``ep``: SGLang's --ep-size (experts split inside the TP group)."""
    spec = hf.spec
    params = allocate_generator_params(spec, tp, tp_rank, dtype, fp8, device, ep)
    for t in sglang_rank_layout(spec, tp, tp_rank, ep):
        rows = math.prod(t.shape[:-1])
        # the [rows, cols] view the blocks index: [n, 1] for vectors, [-1, h] for stacked experts
        local = torch.zeros((rows, t.shape[-1]) if len(t.shape) > 1 else (t.shape[0], 1), dtype=dtype, device=device)
        for b in t.blocks:
            full = hf.get(b.logical)
            full = full if full.dim() == 2 else full.view(-1, 1)
            local[b.local_row : b.local_row + b.num_rows] = full[b.rows[0] : b.rows[1], b.cols[0] : b.cols[1]].to(dtype)
        if fp8 and fp8_format.is_fp8_param(t.name):
            q, scale_inv = fp8_format.quantize(local.view(params[t.name].shape))
            params[t.name].copy_(q)
            params[fp8_format.scale_name(t.name)].copy_(scale_inv)
        else:
            params[t.name].copy_(local.view(params[t.name].shape))
    return params
