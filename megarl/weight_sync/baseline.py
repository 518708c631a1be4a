"""The baseline weight sync megarl's benchmark compares against: what slime does today.

slime (THUDM/slime, ``update_weight_from_distributed.py``), the strongest
widely used Megatron -> SGLang path, per pipeline stage:

1. every trainer rank all-gathers each TP-sharded parameter over its Megatron
   TP group (norms are replicated: no gather); every DP replica does it too;
2. the stage's first rank (TP rank 0, DP rank 0) converts the gathered
   tensors to full Hugging Face tensors (vocabulary padding dropped; with
   block fp8 it quantises each linear weight to e4m3 + 128x128 scales) and
   packs them into flattened buckets of ``bucket_bytes`` (SGLang's
   ``flattened_bucket`` load format: one flat tensor per dtype per bucket);
3. it broadcasts each flat tensor over a group made of itself and every
   generator worker (one group per stage, slime's ``slime-pp_{pp_rank}``);
4. each generator worker unflattens the bucket and cuts its own SGLang TP
   shard out of each full tensor, as SGLang's weight loaders do.

Stages broadcast one after another (SGLang applies one weight update at a time
per engine; slime holds a lock around each broadcast), while later stages
already gather and convert. Both ends derive the buckets from the model's
shapes (in SGLang the names, dtypes and shapes come over HTTP), so only
tensor bytes travel. A tied output layer on the last stage is not sent (SGLang
skips ``lm_head`` when embeddings are tied). Only for the benchmark and tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from megarl.errors import MegarlError
from megarl.models.megatron_model import DEFAULT_VOCAB_DIVISIBLE_BY
from megarl.models.spec import ModelSpec
from megarl.parallel_dims import ParallelDims
from megarl.weight_sync import fp8 as fp8_format
from megarl.weight_sync.layouts import LocalTensor, logical_shapes, megatron_rank_layout, sglang_rank_layout
from megarl.weight_sync.transport import DEFAULT_BUCKET_BYTES, as_2d

# Hugging Face weights a block-fp8 checkpoint stores as e4m3 + weight_scale_inv.
HF_FP8_LINEARS = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
)


@dataclass(frozen=True)
class Entry:
    """One tensor of a bucket: a full HF tensor (2-D; [n, 1] for 1-D), or an fp8 weight's
    e4m3 bytes (``uint8``) or its block scales (``<name>_scale_inv``, float32)."""

    name: str
    logical: str  # the HF tensor it belongs to
    shape: Tuple[int, int]
    dtype: torch.dtype
    kind: str = "full"  # full | fp8 | scale

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    params: Tuple[str, ...]  # the Megatron parameters whose HF tensors fill this bucket
    entries: Tuple[Entry, ...]

    def flats(self) -> List[Tuple[torch.dtype, List[Entry]]]:
        """The bucket's flat tensors: one per dtype, in order of first appearance."""
        groups: Dict[torch.dtype, List[Entry]] = {}
        for e in self.entries:
            groups.setdefault(e.dtype, []).append(e)
        return list(groups.items())


def _hf_names(t: LocalTensor) -> List[str]:
    return list(dict.fromkeys(b.logical for b in t.blocks))


def stage_buckets(
    spec: ModelSpec,
    pp: int,
    pp_rank: int,
    wire_dtype: torch.dtype,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    fp8: bool = False,
) -> List[Bucket]:
    """The buckets stage ``pp_rank`` broadcasts, in order (a function of shapes only).

    Parameters are taken in Megatron's order; like slime, a parameter's HF tensors go
    into the current bucket unless that would overflow it, which then goes out first.
    """
    shapes = logical_shapes(spec)
    layout = megatron_rank_layout(spec, 1, pp, 0, pp_rank)  # TP-independent: names and order
    buckets, params, entries, size = [], [], [], 0
    for t in layout:
        if spec.tie_embeddings and t.name == "output_layer.weight":
            continue  # the embedding's copy (stage 0 sends the embedding)
        new = []
        for name in _hf_names(t):
            shape = shapes[name] if len(shapes[name]) == 2 else (shapes[name][0], 1)
            if fp8 and name.endswith(HF_FP8_LINEARS):
                new.append(Entry(name, name, shape, torch.uint8, "fp8"))
                new.append(
                    Entry(fp8_format.scale_name(name), name, fp8_format.scale_shape(shape), torch.float32, "scale")
                )
            else:
                new.append(Entry(name, name, shape, wire_dtype))
        n = sum(e.nbytes for e in new)
        if entries and size + n > bucket_bytes:
            buckets.append(Bucket(tuple(params), tuple(entries)))
            params, entries, size = [], [], 0
        params.append(t.name)
        entries += new
        size += n
    if entries:
        buckets.append(Bucket(tuple(params), tuple(entries)))
    return buckets


def _views(flat: torch.Tensor, entries: Sequence[Entry]) -> Dict[str, torch.Tensor]:
    out, offset = {}, 0
    for e in entries:
        n = e.shape[0] * e.shape[1]
        out[e.name] = flat[offset : offset + n].view(e.shape)
        offset += n
    return out


def _flat_numel(entries: Sequence[Entry]) -> int:
    return sum(e.shape[0] * e.shape[1] for e in entries)


def gather_broadcast_send(
    spec: ModelSpec,
    trainer: ParallelDims,
    sync_rank: int,
    params: Dict[str, torch.Tensor],
    tp_group,
    stage_group,
    wire_dtype: torch.dtype,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    fp8: bool = False,
    norm_names: str = "local",
    vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
) -> dict:
    """Trainer side, on every trainer rank. ``tp_group``: Megatron's TP group of this rank;
    ``stage_group``: the stage's broadcast group (stage source = its rank 0, generator
    worker w = rank 1 + w) on the stage source, None elsewhere. ``sync_rank`` numbers the
    trainer ranks in Megatron's order (ParallelDims.coords)."""
    start = time.perf_counter()
    coords = trainer.coords(sync_rank)
    tp_rank, pp_rank = coords["tp"], coords["pp"]
    source = tp_rank == 0 and coords["dp"] == 0 and coords["cp"] == 0
    if source != (stage_group is not None):
        raise MegarlError(f"trainer rank {sync_rank}: the stage broadcast group belongs to TP rank 0 of DP rank 0 only")
    layouts = [
        {
            t.name: t
            for t in megatron_rank_layout(spec, trainer.tp, trainer.pp, r, pp_rank, vocab_divisible_by, norm_names)
        }
        for r in range(trainer.tp)
    ]
    stats = {"gathered_bytes": 0, "all_gathers": 0, "broadcast_bytes": 0, "broadcasts": 0}
    for bucket in stage_buckets(spec, trainer.pp, pp_rank, wire_dtype, bucket_bytes, fp8):
        flats = {
            dtype: torch.empty(_flat_numel(es), dtype=dtype, device=_device(params)) for dtype, es in bucket.flats()
        }
        views = {}
        for dtype, es in bucket.flats():
            views.update(_views(flats[dtype], es))
        by_logical = {e.logical: [] for e in bucket.entries}
        for e in bucket.entries:
            by_logical[e.logical].append(e)
        for name in bucket.params:
            local = as_2d(params[name])
            sharded = trainer.tp > 1 and any(
                layouts[r][name].blocks != layouts[0][name].blocks for r in range(1, trainer.tp)
            )
            if sharded:
                shards = [torch.empty_like(local) for _ in range(trainer.tp)]
                dist.all_gather(shards, local.contiguous(), group=tp_group)
                stats["all_gathers"] += 1
                stats["gathered_bytes"] += (trainer.tp - 1) * local.numel() * local.element_size()
            else:
                shards = [local] * trainer.tp
            if not source:
                continue
            # Convert: place every shard's row blocks into the full HF tensors.
            names = (
                _hf_names(layouts[0][name])
                if not sharded
                else list(dict.fromkeys(b.logical for r in range(trainer.tp) for b in layouts[r][name].blocks))
            )
            full = {}
            for logical in names:
                kinds = {e.kind: e for e in by_logical[logical]}
                full[logical] = (
                    views[logical]
                    if "full" in kinds
                    else torch.empty(kinds["fp8"].shape, dtype=wire_dtype, device=local.device)
                )
            for r in range(trainer.tp if sharded else 1):
                for b in layouts[r][name].blocks:
                    full[b.logical][b.rows[0] : b.rows[1], b.cols[0] : b.cols[1]] = shards[r][
                        b.local_row : b.local_row + b.num_rows
                    ]
            for logical in names:
                if "fp8" in {e.kind for e in by_logical[logical]}:
                    q, scale_inv = fp8_format.quantize(full[logical])
                    views[logical].copy_(q.view(torch.uint8))
                    views[fp8_format.scale_name(logical)].copy_(scale_inv)
        if source:
            for flat in flats.values():
                dist.broadcast(flat, group=stage_group, group_src=0)
                stats["broadcasts"] += 1
                stats["broadcast_bytes"] += flat.numel() * flat.element_size()
    stats["seconds"] = time.perf_counter() - start
    return stats


def _device(params: Dict[str, torch.Tensor]):
    return next(iter(params.values())).device


def _cut_index(spec: ModelSpec, tp: int, tp_rank: int):
    """HF tensor -> [(SGLang parameter, block)] of this TP rank."""
    index: Dict[str, List] = {}
    for t in sglang_rank_layout(spec, tp, tp_rank):
        for b in t.blocks:
            index.setdefault(b.logical, []).append((t.name, b))
    return index


def fp8_supported(spec: ModelSpec, tp: int) -> bool:
    """Whether every SGLang TP shard of every fp8 weight is whole 128x128 blocks of the HF
    weights (head_dim and shard sizes multiples of 128, as in real Llamas): what cutting
    block-fp8 tensors and their scales needs."""
    shapes = logical_shapes(spec)

    def ok(lo, hi, size):
        return lo % fp8_format.BLOCK == 0 and (hi % fp8_format.BLOCK == 0 or hi == size)

    return all(
        ok(b.rows[0], b.rows[1], shapes[b.logical][0])
        and ok(b.cols[0], b.cols[1], shapes[b.logical][1])
        and ok(b.local_row, b.local_row + b.num_rows, t.shape[0])
        for r in range(tp)
        for t in sglang_rank_layout(spec, tp, r)
        if fp8_format.is_fp8_param(t.name)
        for b in t.blocks
    )


def _block_range(lo: int, hi: int, size: int, what: str) -> Tuple[int, int]:
    if lo % fp8_format.BLOCK or (hi % fp8_format.BLOCK and hi != size):
        raise MegarlError(
            f"baseline fp8: {what} [{lo}, {hi}) is not 128-aligned; SGLang's block-fp8 loader "
            f"needs head_dim and shard sizes that are multiples of 128"
        )
    return lo // fp8_format.BLOCK, -(-hi // fp8_format.BLOCK)


def gather_broadcast_receive(
    spec: ModelSpec,
    trainer: ParallelDims,
    tp: int,
    tp_rank: int,
    params: Dict[str, torch.Tensor],
    stage_groups: Sequence,
    wire_dtype: torch.dtype,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    fp8: bool = False,
) -> dict:
    """Generator side: receive every stage's buckets in stage order (``stage_groups[s]``:
    stage s's broadcast group), keep this rank's SGLang shard of each full tensor."""
    start = time.perf_counter()
    index = _cut_index(spec, tp, tp_rank)
    shapes = logical_shapes(spec)
    device = _device(params)
    stats = {"received_bytes": 0, "broadcasts": 0}
    for pp_rank, group in enumerate(stage_groups):
        for bucket in stage_buckets(spec, trainer.pp, pp_rank, wire_dtype, bucket_bytes, fp8):
            views = {}
            for dtype, es in bucket.flats():
                flat = torch.empty(_flat_numel(es), dtype=dtype, device=device)
                dist.broadcast(flat, group=group, group_src=0)
                stats["broadcasts"] += 1
                stats["received_bytes"] += flat.numel() * flat.element_size()
                views.update(_views(flat, es))
            for e in bucket.entries:
                full = views[e.name]
                for pname, b in index.get(e.logical, ()):
                    if e.kind == "full":
                        as_2d(params[pname])[b.local_row : b.local_row + b.num_rows] = full[
                            b.rows[0] : b.rows[1], b.cols[0] : b.cols[1]
                        ]
                    elif e.kind == "fp8":
                        params[pname].view(torch.uint8)[b.local_row : b.local_row + b.num_rows] = full[
                            b.rows[0] : b.rows[1], b.cols[0] : b.cols[1]
                        ]
                    else:  # this shard's block scales; blocks never straddle shards
                        rows, cols = shapes[e.logical]
                        r0, r1 = _block_range(b.rows[0], b.rows[1], rows, e.logical)
                        c0, c1 = _block_range(b.cols[0], b.cols[1], cols, e.logical)
                        l0, _ = _block_range(b.local_row, b.local_row + b.num_rows, params[pname].shape[0], pname)
                        params[fp8_format.scale_name(pname)][l0 : l0 + r1 - r0] = full[r0:r1, c0:c1]
    stats["seconds"] = time.perf_counter() - start
    return stats
