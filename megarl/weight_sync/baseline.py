"""The baseline weight sync megarl's benchmark compares against: what slime does today.

slime (THUDM/slime, ``update_weight_from_distributed.py``), the strongest
widely used Megatron -> SGLang path, per pipeline stage:

1. every trainer rank all-gathers each TP-sharded parameter over its Megatron
   TP group (norms are replicated: no gather), and each expert parameter over
   its expert-tensor x expert-model-parallel group (``local_experts.j`` of
   every EP rank, each ETP shard: slime gathers experts over ETP, then EP);
   every DP replica does it too;
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
from megarl.weight_sync.layouts import (
    ExpertShard,
    LocalTensor,
    MegatronShard,
    logical_shapes,
    megatron_rank_layout,
    sglang_rank_layout,
)
from megarl.weight_sync.settings import DEFAULT_BUCKET_BYTES, SyncSettings
from megarl.weight_sync.transport import as_2d

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


def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in name


@dataclass(frozen=True)
class StageLayouts:
    """Stage ``pp_rank``'s parameters as every rank of it holds them: by TP rank (the dense part) and
    by (EP rank, ETP rank) (the experts); ``of(name, holder)`` is one holder's layout of a parameter."""

    dense: Tuple[Dict[str, LocalTensor], ...]  # [tp_rank] -> name -> layout
    experts: Dict[Tuple[int, int], Dict[str, LocalTensor]]  # (ep_rank, etp_rank) -> name -> layout

    def of(self, name: str, holder) -> LocalTensor:
        return self.experts[holder][name] if is_expert_param(name) else self.dense[holder][name]

    def hf_names(self, name: str, holders) -> List[str]:
        return list(dict.fromkeys(b.logical for h in holders for b in self.of(name, h).blocks))


def stage_layouts(
    spec: ModelSpec,
    trainer: ParallelDims,
    pp_rank: int,
    vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
    norm_names: str = "local",
) -> StageLayouts:
    def layout(tp_rank, ep_rank=0, etp_rank=0):
        experts = ExpertShard(trainer.ep, ep_rank, trainer.expert_tp, etp_rank)
        shard = MegatronShard(trainer.tp, trainer.pp, tp_rank, pp_rank, experts=experts)
        tensors = megatron_rank_layout(spec, shard, vocab_divisible_by, norm_names)
        return {t.name: t for t in tensors}

    dense = tuple(layout(r) for r in range(trainer.tp))
    experts = {
        (e, t): layout(0, e, t) if (e, t) != (0, 0) else dense[0]
        for e in range(trainer.ep)
        for t in range(trainer.expert_tp)
    }
    return StageLayouts(dense, experts)


def _all_holders(trainer: ParallelDims, name: str) -> List:
    if is_expert_param(name):
        return [(e, t) for e in range(trainer.ep) for t in range(trainer.expert_tp)]
    return list(range(trainer.tp))


def stage_buckets(
    spec: ModelSpec,
    trainer: ParallelDims,
    pp_rank: int,
    wire_dtype: torch.dtype,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    fp8: bool = False,
) -> List[Bucket]:
    """The buckets stage ``pp_rank`` broadcasts, in order (a function of shapes only).

    Parameters are taken in Megatron's order (a rank's own names: with EP, ``local_experts.j``
    stands for expert j of every EP rank, all of which its gather collects); like slime, a
    parameter's HF tensors go into the current bucket unless that would overflow it, which
    then goes out first.
    """
    shapes = logical_shapes(spec)
    layouts = stage_layouts(spec, trainer, pp_rank)
    buckets, params, entries, size = [], [], [], 0
    for name in layouts.dense[0]:
        if spec.tie_embeddings and name == "output_layer.weight":
            continue  # the embedding's copy (stage 0 sends the embedding)
        new = []
        for logical in layouts.hf_names(name, _all_holders(trainer, name)):
            shape = shapes[logical] if len(shapes[logical]) == 2 else (shapes[logical][0], 1)
            if fp8 and logical.endswith(HF_FP8_LINEARS):
                new.append(Entry(logical, logical, shape, torch.uint8, "fp8"))
                new.append(
                    Entry(
                        fp8_format.scale_name(logical), logical, fp8_format.scale_shape(shape), torch.float32, "scale"
                    )
                )
            else:
                new.append(Entry(logical, logical, shape, wire_dtype))
        n = sum(e.nbytes for e in new)
        if entries and size + n > bucket_bytes:
            buckets.append(Bucket(tuple(params), tuple(entries)))
            params, entries, size = [], [], 0
        params.append(name)
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
    settings: SyncSettings, sync_rank: int, params: Dict[str, torch.Tensor], tp_group, stage_group, expert_group=None
) -> dict:
    """Trainer side, on every trainer rank. ``tp_group``: Megatron's TP group of this rank;
    ``expert_group``: its expert-tensor x expert-model-parallel group (Megatron's
    ``get_expert_tensor_and_model_parallel_group``; needed when EP x ETP > 1); ``stage_group``:
    the stage's broadcast group (stage source = its rank 0, generator worker w = rank 1 + w) on
    the stage source, None elsewhere. ``sync_rank`` numbers the trainer ranks in Megatron's order
    (ParallelDims.coords), as the default process group does. Of ``settings.wire`` the baseline
    reads fp8, dtype and bucket_bytes (slime's path has no checksums and no packing)."""
    start = time.perf_counter()
    spec, trainer = settings.geometry.spec, settings.geometry.trainer
    vocab_divisible_by, norm_names = settings.geometry.vocab_divisible_by, settings.geometry.norm_names
    wire_dtype, bucket_bytes, fp8 = settings.wire.dtype, settings.wire.bucket_bytes, settings.wire.fp8
    coords = trainer.coords(sync_rank)
    pp_rank = coords["pp"]
    source = coords["tp"] == 0 and coords["dp"] == 0 and coords["cp"] == 0
    if source != (stage_group is not None):
        raise MegarlError(f"trainer rank {sync_rank}: the stage broadcast group belongs to TP rank 0 of DP rank 0 only")
    layouts = stage_layouts(spec, trainer, pp_rank, vocab_divisible_by, norm_names)
    expert_holders = [(0, 0)]
    if trainer.ep * trainer.expert_tp > 1:
        if expert_group is None:
            raise MegarlError(f"trainer rank {sync_rank}: experts at EP x ETP > 1 are gathered over an expert group")
        expert_holders = [
            (c["ep"], c["etp"]) for c in map(trainer.expert_coords, dist.get_process_group_ranks(expert_group))
        ]
    stats = {"gathered_bytes": 0, "all_gathers": 0, "broadcast_bytes": 0, "broadcasts": 0}
    for bucket in stage_buckets(spec, trainer, pp_rank, wire_dtype, bucket_bytes, fp8):
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
            if is_expert_param(name):
                holders, group = expert_holders, expert_group
            else:
                holders, group = list(range(trainer.tp)), tp_group
                if all(layouts.dense[r][name].blocks == layouts.dense[0][name].blocks for r in holders):
                    holders = [0]  # replicated over TP (norms, the router): nothing to gather
            if len(holders) > 1:
                shards = [torch.empty_like(local) for _ in holders]
                dist.all_gather(shards, local.contiguous(), group=group)
                stats["all_gathers"] += 1
                stats["gathered_bytes"] += (len(holders) - 1) * local.numel() * local.element_size()
            else:
                shards = [local]
            if not source:
                continue
            # Convert: place every shard's row blocks into the full HF tensors.
            names = layouts.hf_names(name, holders)
            full = {}
            for logical in names:
                kinds = {e.kind: e for e in by_logical[logical]}
                full[logical] = (
                    views[logical]
                    if "full" in kinds
                    else torch.empty(kinds["fp8"].shape, dtype=wire_dtype, device=local.device)
                )
            for holder, shard in zip(holders, shards):
                for b in layouts.of(name, holder).blocks:
                    full[b.logical][b.rows[0] : b.rows[1], b.cols[0] : b.cols[1]] = shard[
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


def _cut_index(spec: ModelSpec, tp: int, tp_rank: int, ep: int = 1):
    """HF tensor -> [(SGLang parameter, block)] of this TP rank (``ep``: its --ep-size)."""
    index: Dict[str, List] = {}
    for t in sglang_rank_layout(spec, tp, tp_rank, ep):
        for b in t.blocks:
            index.setdefault(b.logical, []).append((t.name, b))
    return index


def fp8_supported(spec: ModelSpec, tp: int, ep: int = 1) -> bool:
    """Whether every SGLang TP shard of every fp8 weight is whole 128x128 blocks of the HF
    weights (head_dim and shard sizes multiples of 128, as in real Llamas; each expert's shard,
    rows of the stacked [experts x rows, cols] view): what cutting block-fp8 tensors and their
    scales needs."""
    shapes = logical_shapes(spec)

    def ok(lo, hi, size):
        return lo % fp8_format.BLOCK == 0 and (hi % fp8_format.BLOCK == 0 or hi == size)

    return all(
        ok(b.rows[0], b.rows[1], shapes[b.logical][0])
        and ok(b.cols[0], b.cols[1], shapes[b.logical][1])
        and ok(b.local_row, b.local_row + b.num_rows, fp8_format.matrix_shape(t.shape)[0])
        for r in range(tp)
        for t in sglang_rank_layout(spec, tp, r, ep)
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
    settings: SyncSettings, tp_rank: int, params: Dict[str, torch.Tensor], stage_groups: Sequence
) -> dict:
    """Generator side: receive every stage's buckets in stage order (``stage_groups[s]``:
    stage s's broadcast group), keep this rank's SGLang shard of each full tensor (TP rank
    ``tp_rank`` of a replica at ``settings.geometry.generator``'s tp and --ep-size)."""
    start = time.perf_counter()
    spec, trainer = settings.geometry.spec, settings.geometry.trainer
    tp, ep = settings.geometry.generator.tp, settings.geometry.generator.ep
    wire_dtype, bucket_bytes, fp8 = settings.wire.dtype, settings.wire.bucket_bytes, settings.wire.fp8
    index = _cut_index(spec, tp, tp_rank, ep)
    shapes = logical_shapes(spec)
    device = _device(params)
    stats = {"received_bytes": 0, "broadcasts": 0}
    for pp_rank, group in enumerate(stage_groups):
        for bucket in stage_buckets(spec, trainer, pp_rank, wire_dtype, bucket_bytes, fp8):
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
                        as_2d(params[pname]).view(torch.uint8)[b.local_row : b.local_row + b.num_rows] = full[
                            b.rows[0] : b.rows[1], b.cols[0] : b.cols[1]
                        ]
                    else:  # this shard's block scales; blocks never straddle shards (nor experts)
                        rows, cols = shapes[e.logical]
                        r0, r1 = _block_range(b.rows[0], b.rows[1], rows, e.logical)
                        c0, c1 = _block_range(b.cols[0], b.cols[1], cols, e.logical)
                        local_rows = as_2d(params[pname]).shape[0]
                        l0, _ = _block_range(b.local_row, b.local_row + b.num_rows, local_rows, pname)
                        as_2d(params[fp8_format.scale_name(pname)])[l0 : l0 + r1 - r0] = full[r0:r1, c0:c1]
    stats["seconds"] = time.perf_counter() - start
    return stats
