"""Sync mode's weight copy: Megatron TP shards -> a TP-1 SGLang-layout engine on the same ranks.

In the synchronous (colocated) baseline every rank trains and then generates
with its own copy of the policy. Each rank all-gathers its TP group's shards
(one collective per parameter, over the trainer's TP group) and writes them
into the engine's tensors by the same layouts the shard-to-shard sync plans
with (layouts.py) -- so both modes agree on what lands where, and a rank
never needs more than one full model copy.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist

from megarl.models.spec import LlamaSpec
from megarl.weight_sync import fp8 as fp8_format
from megarl.weight_sync.endpoints import megatron_params
from megarl.weight_sync.layouts import logical_shapes, megatron_rank_layout, sglang_rank_layout


@torch.no_grad()
def copy_colocated(spec: LlamaSpec, chunks: List[torch.nn.Module], engine_params: Dict[str, torch.Tensor],
                   norm_names: str = "local") -> None:
    from megatron.core import parallel_state as mpu

    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    if mpu.get_pipeline_model_parallel_world_size() != 1:
        raise NotImplementedError("colocated weight copy needs pipeline-parallel size 1")
    group = mpu.get_tensor_model_parallel_group()
    local = megatron_params(chunks)
    layouts = [megatron_rank_layout(spec, tp, 1, r, 0, norm_names=norm_names) for r in range(tp)]
    shapes = logical_shapes(spec)
    logical: Dict[str, torch.Tensor] = {}
    for i, mine in enumerate(layouts[tp_rank]):
        tensor = local[mine.name]
        parts = [torch.empty_like(tensor) for _ in range(tp)] if tp > 1 else [tensor]
        if tp > 1:
            dist.all_gather(parts, tensor.contiguous(), group=group)
        for r in range(tp):
            src = parts[r].reshape(layouts[r][i].shape)
            src = src.view(src.shape[0], -1)  # 1-D tensors as [n, 1], like the layouts
            for b in layouts[r][i].blocks:
                full = logical.get(b.logical)
                if full is None:
                    full = logical[b.logical] = torch.empty(shapes[b.logical], dtype=torch.float32)
                full2d = full.view(full.shape[0], -1)
                full2d[b.rows[0]:b.rows[1], b.cols[0]:b.cols[1]] = src[b.local_row:b.local_row + b.num_rows]
    for t in sglang_rank_layout(spec, 1, 0):
        dst = engine_params[t.name]
        values = torch.zeros(t.shape, dtype=torch.float32)
        values = values.view(values.shape[0], -1)
        for b in t.blocks:
            full = logical[b.logical]
            values[b.local_row:b.local_row + b.num_rows] = full.view(full.shape[0], -1)[b.rows[0]:b.rows[1], b.cols[0]:b.cols[1]]
        if dst.dtype == fp8_format.FP8_DTYPE:
            q, scale = fp8_format.quantize(values.view(dst.shape))
            dst.copy_(q)
            engine_params[fp8_format.scale_name(t.name)].copy_(scale)
        else:
            dst.copy_(values.view(dst.shape))

