"""Which bytes go from which trainer rank to which generator rank.

The planner intersects the trainer's layout (Megatron TP x PP, replicated over
DP) with the generators' layout (SGLang TP, one or more replicas), logical
tensor by logical tensor, and emits for every (source rank, destination rank)
pair the rectangles to move: rows and columns in the source's local tensor
and where they land in the destination's. Where several trainer ranks hold the
same bytes (DP replicas, TP-replicated norms, the tied output layer of the last
stage) the least-loaded one is chosen -- once per destination parameter, so
one destination weight's pieces of a shard come from one rank -- and sending
is spread over all of them.
Every destination receives exactly its own elements; the only duplication is
SGLang's replicated KV heads, which each replica rank needs for itself.

Ranks are numbered in the sync group: trainer ranks first, in Megatron's
order (tp fastest, then cp, dp, pp), then generator replica 0's TP ranks,
replica 1's, and so on (megarl.parallel_dims: ``ParallelDims.rank`` and
``generator_rank``). Context-parallel ranks hold the same weights as their
data-parallel peers: both are extra copies to send from. Built from shapes only.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megarl.models.megatron_model import DEFAULT_VOCAB_DIVISIBLE_BY
from megarl.models.spec import ModelSpec
from megarl.parallel_dims import GeneratorDims, ParallelDims, generator_rank
from megarl.weight_sync.layouts import (
    Block,
    ExpertShard,
    LocalTensor,
    MegatronShard,
    Range,
    megatron_rank_layout,
    sglang_rank_layout,
)


@dataclass(frozen=True)
class Transfer:
    src_param: str
    src_rows: Range  # in the source's local tensor
    src_cols: Range
    dst_param: str
    dst_rows: Range  # in the destination's local tensor
    dst_cols: Range

    @property
    def numel(self) -> int:
        return (self.src_rows[1] - self.src_rows[0]) * (self.src_cols[1] - self.src_cols[0])


@dataclass
class SyncPlan:
    trainer: ParallelDims
    generator: GeneratorDims
    # (source rank, destination rank) -> transfers, in a fixed order both sides agree on
    transfers: Dict[Tuple[int, int], List[Transfer]] = field(default_factory=dict)
    dst_layouts: Dict[int, List[LocalTensor]] = field(default_factory=dict)  # sync rank -> params

    def sends_of(self, rank: int) -> Dict[int, List[Transfer]]:
        return {dst: t for (src, dst), t in self.transfers.items() if src == rank}

    def recvs_of(self, rank: int) -> Dict[int, List[Transfer]]:
        return {src: t for (src, dst), t in self.transfers.items() if dst == rank}

    def elements_received(self) -> Dict[int, int]:
        out: Dict[int, int] = defaultdict(int)
        for (_, dst), ts in self.transfers.items():
            out[dst] += sum(t.numel for t in ts)
        return dict(out)

    def elements_sent(self) -> Dict[int, int]:
        out: Dict[int, int] = defaultdict(int)
        for (src, _), ts in self.transfers.items():
            out[src] += sum(t.numel for t in ts)
        return dict(out)


def _overlap(a: Range, b: Range) -> Optional[Range]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def build_plan(
    spec: ModelSpec,
    trainer: ParallelDims,
    generator: GeneratorDims,
    norm_names: str = "local",
    vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
) -> SyncPlan:
    """Plan one weight sync from the trainer's shards to every generator replica. ``norm_names``:
    "te" for Transformer Engine layer specs (norms fused into the linears), else "local"."""
    vp = trainer.virtual_pipeline_model_parallel_size
    spec.check_parallelism(trainer.tp, trainer.pp, vp, trainer.ep, trainer.etp)
    # Source copies by logical tensor and region: every (rank, local tensor, block) holding
    # those same elements -- DP replicas, TP-replicated norms, a tied last-stage output layer.
    sources: Dict[str, Dict[Tuple[Range, Range], List[Tuple[int, LocalTensor, Block]]]] = defaultdict(dict)
    layouts_by_coords: Dict[Tuple[int, int, int, int], List[LocalTensor]] = {}
    for rank in range(trainer.world_size):
        # a rank's dense shard is set by (tp, pp), its experts' by (ep, etp); the rest are replicas
        dense, expert = trainer.coords(rank), trainer.expert_coords(rank)
        key = (dense["tp"], dense["pp"], expert["ep"], expert["etp"])
        if key not in layouts_by_coords:
            experts = ExpertShard(trainer.ep, expert["ep"], trainer.expert_tp, expert["etp"])
            shard = MegatronShard(trainer.tp, trainer.pp, dense["tp"], dense["pp"], vp, experts)
            layouts_by_coords[key] = megatron_rank_layout(spec, shard, vocab_divisible_by, norm_names)
        for tensor in layouts_by_coords[key]:
            for block in tensor.blocks:
                copies = sources[block.logical].setdefault((block.rows, block.cols), [])
                copies.append((rank, tensor, block))

    # Per region: its copies by rank, and an id of its set of holders (q, k and v of one
    # Megatron shard share holders, so they share a sender choice below).
    holder_ids: Dict[frozenset, int] = {}
    regions = {}
    for logical, by_region in sources.items():
        regions[logical] = []
        for (rows, cols), copies in by_region.items():
            holders = holder_ids.setdefault(frozenset(c[0] for c in copies), len(holder_ids))
            regions[logical].append((rows, cols, holders, copies, {c[0]: c for c in copies}))

    # The intersections depend only on the generator TP rank, not on the replica.
    layouts = [sglang_rank_layout(spec, generator.tp, r, generator.ep) for r in range(generator.tp)]
    overlaps = []
    for layout in layouts:
        found = []
        for tensor in layout:
            for block in tensor.blocks:
                for src_rows, src_cols, holders, copies, by_rank in regions[block.logical]:
                    rows, cols = _overlap(block.rows, src_rows), _overlap(block.cols, src_cols)
                    if rows is not None and cols is not None:
                        found.append((tensor, block, rows, cols, holders, copies, by_rank))
        overlaps.append(found)

    plan = SyncPlan(trainer, generator)
    load: Dict[int, int] = defaultdict(int)  # elements assigned per source rank
    for replica in range(generator.replicas):
        for tp_rank in range(generator.tp):
            dst_rank = generator_rank(trainer, generator, replica, tp_rank)
            plan.dst_layouts[dst_rank] = layouts[tp_rank]
            # One source copy per (destination parameter, holder set): all pieces a destination
            # weight needs from one trainer shard come from the same rank, so the sender can
            # assemble (and fp8-quantise) whole destination blocks.
            chosen: Dict[Tuple[str, int], int] = {}
            for tensor, block, rows, cols, holders, copies, by_rank in overlaps[tp_rank]:
                key = (tensor.name, holders)
                if key not in chosen:
                    chosen[key] = min(copies, key=lambda c: (load[c[0]], c[0]))[0]
                src_rank = chosen[key]
                _, src_tensor, src_block = by_rank[src_rank]
                load[src_rank] += (rows[1] - rows[0]) * (cols[1] - cols[0])
                plan.transfers.setdefault((src_rank, dst_rank), []).append(
                    Transfer(
                        src_param=src_tensor.name,
                        src_rows=_local(rows, src_block.rows[0], src_block.local_row),
                        src_cols=(cols[0] - src_block.cols[0], cols[1] - src_block.cols[0]),
                        dst_param=tensor.name,
                        dst_rows=_local(rows, block.rows[0], block.local_row),
                        dst_cols=(cols[0] - block.cols[0], cols[1] - block.cols[0]),
                    )
                )
    return plan


def _local(rows: Range, logical_start: int, local_start: int) -> Range:
    return (rows[0] - logical_start + local_start, rows[1] - logical_start + local_start)
