"""The baseline weight sync that megarl's benchmark compares against.

What slime, verl and OpenRLHF do today: for each layer in turn, the trainer
gathers the layer's shards onto one rank, which assembles every full Hugging
Face tensor and broadcasts it to all generator workers; each worker then cuts
its own shard out of the full tensor, as SGLang's weight loaders do. Memory on
the gathering rank stays at one layer; the traffic all funnels through it.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megarl.models.spec import LlamaSpec
from megarl.weight_sync.layouts import LocalTensor, logical_shapes, megatron_rank_layout, sglang_rank_layout
from megarl.weight_sync.planner import TrainerTopology
from megarl.weight_sync.transport import as_2d


def _step_of(name: str) -> Optional[int]:
    """The layer a logical tensor belongs to (None for embeddings, final norm, lm_head)."""
    return int(name.split(".")[2]) if name.startswith("model.layers.") else None


def _steps(spec: LlamaSpec) -> List[Optional[int]]:
    return [None] + list(range(spec.num_layers))


def _local_in_step(t: LocalTensor, step: Optional[int]) -> bool:
    return bool(t.blocks) and _step_of(t.blocks[0].logical) == step


def gather_broadcast_send(spec: LlamaSpec, trainer: TrainerTopology, sync_rank: int, params: Dict[str, torch.Tensor],
                          sync_group, broadcast_group, wire_dtype: torch.dtype) -> dict:
    """Trainer side. Sync rank 0 gathers and broadcasts; DP replica 0 of every shard sends to it."""
    start = time.perf_counter()
    shapes = logical_shapes(spec)
    layouts = {(tp, pp): megatron_rank_layout(spec, trainer.tp, trainer.pp, tp, pp, trainer.vocab_divisible_by,
                                              trainer.norm_names)
               for tp in range(trainer.tp) for pp in range(trainer.pp)}
    owner = {key: trainer.rank(key[0], 0, key[1]) for key in layouts}
    # A tied last-stage output layer is a copy of the embedding: gather the embedding only.
    skip = {"output_layer.weight"} if spec.tie_embeddings else set()
    gathered = 0
    for step in _steps(spec):
        if sync_rank == 0:
            ops, pieces = [], []
            for key, layout in layouts.items():
                for t in layout:
                    if t.name in skip or not _local_in_step(t, step):
                        continue
                    if owner[key] == 0:
                        buf = as_2d(params[t.name]).to(wire_dtype)
                    else:
                        buf = torch.empty(as_2d(torch.empty(t.shape)).shape, dtype=wire_dtype)
                        ops.append(dist.P2POp(dist.irecv, buf, group=sync_group, group_peer=owner[key]))
                        gathered += buf.numel() * buf.element_size()
                    pieces.append((t, buf))
            for req in dist.batch_isend_irecv(ops) if ops else []:
                req.wait()
            full = {name: torch.empty(shape if len(shape) == 2 else (shape[0], 1), dtype=wire_dtype)
                    for name, shape in shapes.items() if _step_of(name) == step}
            for t, buf in pieces:
                for b in t.blocks:
                    full[b.logical][b.rows[0] : b.rows[1], b.cols[0] : b.cols[1]] = buf[b.local_row : b.local_row + b.num_rows]
            for name in sorted(full):
                dist.broadcast(full[name], group=broadcast_group, group_src=0)
        else:
            mine = [key for key, rank in owner.items() if rank == sync_rank]
            ops = []
            for key in mine:
                for t in layouts[key]:
                    if t.name not in skip and _local_in_step(t, step):
                        ops.append(dist.P2POp(dist.isend, as_2d(params[t.name]).to(wire_dtype).contiguous(),
                                              group=sync_group, group_peer=0))
            for req in dist.batch_isend_irecv(ops) if ops else []:
                req.wait()
    return {"seconds": time.perf_counter() - start, "gathered_bytes": gathered}


def gather_broadcast_receive(spec: LlamaSpec, tp: int, tp_rank: int, params: Dict[str, torch.Tensor],
                             broadcast_group, wire_dtype: torch.dtype) -> dict:
    """Generator side: receive every full tensor, keep this rank's SGLang shard of it."""
    start = time.perf_counter()
    shapes = logical_shapes(spec)
    layout = sglang_rank_layout(spec, tp, tp_rank)
    received = 0
    for step in _steps(spec):
        for name in sorted(n for n in shapes if _step_of(n) == step):
            shape = shapes[name]
            full = torch.empty(shape if len(shape) == 2 else (shape[0], 1), dtype=wire_dtype)
            dist.broadcast(full, group=broadcast_group, group_src=0)
            received += full.numel() * full.element_size()
            for t in layout:
                for b in t.blocks:
                    if b.logical == name:
                        as_2d(params[t.name])[b.local_row : b.local_row + b.num_rows] = \
                            full[b.rows[0] : b.rows[1], b.cols[0] : b.cols[1]]
    return {"seconds": time.perf_counter() - start, "received_bytes": received}
