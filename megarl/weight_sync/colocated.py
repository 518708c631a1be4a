"""Sync mode's weight copy: Megatron TP x PP shards -> a TP-1 SGLang-layout engine on every rank.

In the synchronous (colocated) baseline every trainer rank also generates with
its own TP-1 copy of the policy. After each optimizer step, on the device that
holds the parameters, every rank walks the same list of steps, one per
Megatron parameter of the whole model (all pipeline stages):

1. the stage that owns the parameter broadcasts each TP rank's shard over its
   pipeline-parallel group (PP group t carries TP shard t), straight into its
   slot of a gathered buffer on the other stages;
2. every stage all-gathers the shards within its TP group (in place);
3. the rectangles the layouts give (layouts.py: Megatron rank layouts against
   SGLang's TP-1 layout, shapes only) are copied into the engine's tensors;
   an fp8 engine weight, complete after its step (each SGLang linear comes
   from one Megatron parameter), is assembled and quantised in place in fp32
   bands of whole 128-row blocks.

Shard-then-gather rather than gather-then-broadcast: the cross-stage link
(usually the inter-node one) carries each parameter once in total, 1/tp of it
per PP group, instead of the full parameter in each of the tp PP groups; the
TP all-gathers (NVLink) then run on all stages at once.

Duplicates are never moved: TP-replicated norms come from the rank's own copy
(broadcast over PP only), and with tied embeddings the last stage's output
layer is skipped (the first stage's embedding, which Megatron keeps equal,
fills the engine's embed_tokens). Megatron's and SGLang's vocabulary padding
rows have no source and stay as allocated (zeros).

Temporary memory: one gathered Megatron parameter (its tp shards; nothing for
a rank's own shard at TP1, which is read in place) plus, for fp8 engines, one
fp32 band of one destination weight. No host copies, no full-model temporary.
``copy_colocated`` counts its live temporaries and returns the peak.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megarl.models.megatron_model import DEFAULT_VOCAB_DIVISIBLE_BY
from megarl.models.spec import ModelSpec
from megarl.weight_sync import fp8 as fp8_format
from megarl.weight_sync.endpoints import megatron_params
from megarl.weight_sync.layouts import (
    MEGATRON_NORM_NAMES,
    MegatronShard,
    Range,
    logical_shapes,
    megatron_rank_layout,
    sglang_rank_layout,
)

# An fp8 destination weight is quantised in fp32 bands of whole 128-row blocks of about this
# many bytes (at least one block row).
DEFAULT_FP8_BAND_BYTES = 16 << 20


@dataclass(frozen=True)
class Rect:
    """``engine[dst][dst_rows, dst_cols] = shard[part][src_rows, src_cols]`` (1-D tensors as [n, 1])."""

    part: int  # TP rank whose shard holds it (0 for TP-replicated parameters: the rank's own copy)
    src_rows: Range
    src_cols: Range
    dst: str
    dst_rows: Range
    dst_cols: Range


@dataclass(frozen=True)
class Step:
    """One Megatron parameter of the whole model and what it writes into the engine."""

    stage: int  # pipeline stage that owns it
    name: str  # its name on that stage's ranks
    shape: Tuple[int, ...]  # per-TP-rank shard shape
    replicated: bool  # every TP rank of the stage holds the same bytes: no TP gather
    rects: Tuple[Rect, ...]


@dataclass(frozen=True)
class CopyProgram:
    steps: Tuple[Step, ...]
    dst_steps: Dict[str, int]  # engine tensor -> number of steps writing it
    model_numel: int  # elements of one logical (HF) copy of the model


@dataclass
class ColocatedCopyStats:
    seconds: float = 0.0
    peak_temp_bytes: int = 0  # most bytes of temporaries alive at once on this rank
    model_bytes: int = 0  # one full copy of the model in the trainer's parameter dtype
    engine_bytes: int = 0  # the engine's tensors (fp8 scales and vocabulary padding included)
    bytes_copied: int = 0  # bytes written into them (fp8 weights and their scales)
    pp_bytes_received: int = 0
    tp_bytes_received: int = 0
    steps: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def _overlap(a: Range, b: Range) -> Optional[Range]:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@functools.lru_cache(maxsize=8)
def build_copy_program(
    spec: ModelSpec, tp: int, pp: int, norm_names: str = "local", vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY
) -> CopyProgram:
    """The steps of a colocated copy from Megatron TP x PP into SGLang's TP-1 layout (shapes only)."""
    spec.check_parallelism(tp, pp)
    dst_blocks = defaultdict(list)  # logical -> (engine tensor, block)
    dst_numel = {}
    for t in sglang_rank_layout(spec, 1, 0):
        dst_numel[t.name] = t.covered_numel
        for b in t.blocks:
            dst_blocks[b.logical].append((t, b))
    seen = set()  # (logical, rows, cols) regions already taken from some step
    steps: List[Step] = []
    for stage in range(pp):
        layouts = [
            megatron_rank_layout(spec, MegatronShard(tp, pp, t, stage), vocab_divisible_by, norm_names)
            for t in range(tp)
        ]
        for i, first in enumerate(layouts[0]):
            shards = [layout[i] for layout in layouts]
            assert all(s.name == first.name and s.shape == first.shape for s in shards)
            replicated = all(s.blocks == first.blocks for s in shards)
            rects = []
            for part, shard in enumerate(shards[:1] if replicated else shards):
                for sb in shard.blocks:
                    key = (sb.logical, sb.rows, sb.cols)
                    if key in seen:  # a tied output layer: the embedding already brings it
                        continue
                    seen.add(key)
                    for dt, db in dst_blocks[sb.logical]:
                        rows, cols = _overlap(sb.rows, db.rows), _overlap(sb.cols, db.cols)
                        if rows is None or cols is None:
                            continue
                        rects.append(
                            Rect(
                                part,
                                (rows[0] - sb.rows[0] + sb.local_row, rows[1] - sb.rows[0] + sb.local_row),
                                (cols[0] - sb.cols[0], cols[1] - sb.cols[0]),
                                dt.name,
                                (rows[0] - db.rows[0] + db.local_row, rows[1] - db.rows[0] + db.local_row),
                                (cols[0] - db.cols[0], cols[1] - db.cols[0]),
                            )
                        )
            if rects:
                steps.append(Step(stage, first.name, first.shape, replicated, tuple(rects)))
    written = defaultdict(int)
    dst_steps = defaultdict(int)
    for step in steps:
        for dst in {r.dst for r in step.rects}:
            dst_steps[dst] += 1
        for r in step.rects:
            written[r.dst] += (r.dst_rows[1] - r.dst_rows[0]) * (r.dst_cols[1] - r.dst_cols[0])
    wrong = {n: (written[n], want) for n, want in dst_numel.items() if written[n] != want}
    if wrong:  # a layout bug, not a user error
        raise AssertionError(f"colocated copy program does not cover the engine exactly: {wrong}")
    numel = sum(torch.Size(s).numel() for s in logical_shapes(spec).values())
    return CopyProgram(tuple(steps), dict(dst_steps), numel)


class _Temps:
    """Temporaries of one copy, on one device, with the peak of their live bytes."""

    def __init__(self, device: torch.device):
        self.device, self.live, self.peak = device, 0, 0

    def new(self, shape, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        self.add(t.numel() * t.element_size())
        return t

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def free(self, nbytes: int) -> None:
        self.live -= nbytes


def _detect_norm_names(local: Dict[str, torch.Tensor]) -> str:
    te_attn_norm = MEGATRON_NORM_NAMES["te"][0]
    return "te" if any(n.endswith(te_attn_norm) for n in local) else "local"


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0], -1)


def _block_regions(rows: int, cols: int):
    """[rows, cols] as at most four regions of equal blocks: whole 128 x 128 blocks, the
    partial last block row, the partial last block column and their corner, each as
    (row0, block rows, block height, col0, block cols, block width)."""
    b = fp8_format.BLOCK
    for r0, nr, hr in ((0, rows // b, b), (rows // b * b, 1, rows % b)):
        for c0, nc, hc in ((0, cols // b, b), (cols // b * b, 1, cols % b)):
            if nr and hr and nc and hc:
                yield r0, nr, hr, c0, nc, hc


def _quantise_band(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Block-fp8 of ``w``, an fp32 band of whole block rows (overwritten), into ``q`` and its
    ``scale`` rows.

    fp8.quantize's numbers exactly (amax per 128 x 128 block, clamped to MIN_AMAX, / FP8_MAX
    in fp32; w / scale_inv in fp32, clamped, cast to e4m3), computed in place, region by
    region, instead of on copies padded to whole blocks.
    """
    b = fp8_format.BLOCK
    for r0, nr, hr, c0, nc, hc in _block_regions(*w.shape):

        def blocks(t):
            return t[r0 : r0 + nr * hr, c0 : c0 + nc * hc].unflatten(0, (nr, hr)).unflatten(2, (nc, hc))

        region = blocks(w)
        amax = torch.maximum(region.amax(dim=(1, 3)), -region.amin(dim=(1, 3)))  # |w| without a copy
        scale_inv = amax.clamp(min=fp8_format.MIN_AMAX) / fp8_format.FP8_MAX
        scale[r0 // b : r0 // b + nr, c0 // b : c0 // b + nc] = scale_inv
        region.div_(scale_inv[:, None, :, None]).clamp_(-fp8_format.FP8_MAX, fp8_format.FP8_MAX)
        blocks(q).copy_(region)  # the cast to e4m3


def _quantise_into(
    rects: List[Rect], shards, dst: torch.Tensor, scale: torch.Tensor, temps: "_Temps", band_bytes: int
) -> None:
    """Quantise a complete fp8 destination weight band by band: each band (whole 128-row
    blocks, about ``band_bytes``) is assembled in fp32 from its rectangles and quantised in place."""
    rows, cols = dst.shape
    block = fp8_format.BLOCK
    band = max(1, band_bytes // (4 * block * max(cols, 1))) * block
    for r0 in range(0, rows, band):
        r1 = min(rows, r0 + band)
        w = temps.new((r1 - r0, cols), torch.float32)
        for r in rects:
            lo, hi = max(r0, r.dst_rows[0]), min(r1, r.dst_rows[1])
            if lo < hi:
                s0 = r.src_rows[0] + lo - r.dst_rows[0]
                w[lo - r0 : hi - r0, r.dst_cols[0] : r.dst_cols[1]] = shards[r.part][
                    s0 : s0 + hi - lo, r.src_cols[0] : r.src_cols[1]
                ]
        _quantise_band(w, dst[r0:r1], scale[r0 // block :])
        del w
        temps.free((r1 - r0) * cols * 4)


@dataclass(frozen=True)
class _Place:
    """This rank among Megatron's TP and PP groups (parallel_state's)."""

    tp: int
    tp_rank: int
    tp_group: object
    pp: int
    pp_rank: int
    pp_group: object


def _shards_of(step: Step, local, place: _Place, dtype, temps: _Temps, stats: ColocatedCopyStats):
    """The shards of ``step``'s parameter this rank needs, as [rows, cols] views, and the
    bytes of the temporary buffer behind them."""
    tp, tp_rank, pp, pp_rank = place.tp, place.tp_rank, place.pp, place.pp_rank
    tp_group, pp_group = place.tp_group, place.pp_group
    n = torch.Size(step.shape).numel()
    owner = step.stage == pp_rank
    mine = None
    if owner:
        mine = local.get(step.name)
        if mine is None or mine.numel() != n:
            got = None if mine is None else tuple(mine.shape)
            raise ValueError(
                f"Megatron parameter {step.name} of stage {step.stage}: expected shard shape "
                f"{step.shape}, found {got} (norm_names / vocab_divisible_by?)"
            )
        mine = mine.reshape(-1)
    if step.replicated or tp == 1:
        # One shard is enough, the rank's own: over PP from the owner stage's rank of its TP rank.
        own = mine if owner else temps.new(n, dtype)
        if pp > 1:
            dist.broadcast(own, src=dist.get_global_rank(pp_group, step.stage), group=pp_group)
        held = 0 if owner else own.numel() * own.element_size()
        stats.pp_bytes_received += held
        return [_as_2d(own.view(step.shape))], held
    # Shard t over PP group t (into its slot of the gathered buffer), then all-gather over TP.
    gathered = temps.new(tp * n, dtype)
    own = mine if owner else gathered[tp_rank * n : (tp_rank + 1) * n]
    if pp > 1:
        dist.broadcast(own, src=dist.get_global_rank(pp_group, step.stage), group=pp_group)
        stats.pp_bytes_received += 0 if owner else own.numel() * own.element_size()
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(gathered, own, group=tp_group)  # in place on the stages that received their slot
    stats.tp_bytes_received += (tp - 1) * n * dtype.itemsize
    return [
        _as_2d(gathered[t * n : (t + 1) * n].view(step.shape)) for t in range(tp)
    ], gathered.numel() * gathered.element_size()


@torch.no_grad()
def copy_colocated(
    spec: ModelSpec,
    chunks: List[torch.nn.Module],
    engine_params: Dict[str, torch.Tensor],
    norm_names: Optional[str] = None,
    *,
    vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
    fp8_band_bytes: int = DEFAULT_FP8_BAND_BYTES,
) -> ColocatedCopyStats:
    """Copy the policy from this rank's Megatron shards (any TP x PP x DP) into its TP-1 engine.

    A collective over the rank's TP and PP groups: every rank of the trainer calls it.
    ``engine_params``: SGLang-layout tensors of TP rank 0 of a TP-1 engine
    (``allocate_generator_params(spec, 1, 0, ...)``), filled in place; fp8 linears
    (float8_e4m3fn + ``<name>_scale_inv``) are block-quantised. ``norm_names``: the layer
    spec's norm naming ("local" or "te"); None detects it from the parameter names.
    """
    # Megatron-Core here, not at the top: every rank's synchronizer (synchronizer.py) imports this module,
    # generator ranks on GPUs (which never need Megatron-Core) included; its import costs 1.3-1.5 s of CPU
    # beyond torch's (measured 2026-12-03).
    from megatron.core import parallel_state as mpu

    start = time.perf_counter()
    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    pp, pp_rank = mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()
    tp_group, pp_group = mpu.get_tensor_model_parallel_group(), mpu.get_pipeline_model_parallel_group()
    place = _Place(tp, tp_rank, tp_group, pp, pp_rank, pp_group)
    local = megatron_params(chunks)
    dtypes = {t.dtype for t in local.values()}
    if len(dtypes) != 1:
        raise ValueError(f"colocated copy needs one parameter dtype on the trainer, found {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    device = next(iter(local.values())).device
    program = build_copy_program(spec, tp, pp, norm_names or _detect_norm_names(local), vocab_divisible_by)
    temps = _Temps(device)
    stats = ColocatedCopyStats(
        model_bytes=program.model_numel * dtype.itemsize,
        steps=len(program.steps),
        engine_bytes=sum(t.numel() * t.element_size() for t in engine_params.values()),
    )

    for step in program.steps:
        shards, held = _shards_of(step, local, place, dtype, temps, stats)
        fp8_rects: Dict[str, List[Rect]] = defaultdict(list)
        for r in step.rects:
            dst = engine_params[r.dst]
            if dst.dtype == fp8_format.FP8_DTYPE:
                fp8_rects[r.dst].append(r)
                continue
            _as_2d(dst)[r.dst_rows[0] : r.dst_rows[1], r.dst_cols[0] : r.dst_cols[1]].copy_(
                shards[r.part][r.src_rows[0] : r.src_rows[1], r.src_cols[0] : r.src_cols[1]]
            )
            stats.bytes_copied += (r.dst_rows[1] - r.dst_rows[0]) * (r.dst_cols[1] - r.dst_cols[0]) * dst.element_size()
        for name, rects in fp8_rects.items():
            if program.dst_steps[name] != 1:
                raise NotImplementedError(f"fp8 engine weight {name} is written by several Megatron parameters")
            dst, scale = engine_params[name], engine_params[fp8_format.scale_name(name)]
            _quantise_into(rects, shards, dst, scale, temps, fp8_band_bytes)
            stats.bytes_copied += dst.numel() * dst.element_size() + scale.numel() * scale.element_size()
        del shards  # the last reference to this step's buffer
        temps.free(held)

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    stats.seconds = time.perf_counter() - start
    stats.peak_temp_bytes = temps.peak
    return stats
