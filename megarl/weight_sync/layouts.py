"""Where every element of every weight lives, on the trainer and on the generators.

A rank's local tensor is described as row blocks of logical (Hugging Face)
tensors: ``Block(logical, rows, cols, local_row)`` says that local rows
``[local_row, local_row + rows[1] - rows[0])`` hold ``logical[rows[0]:rows[1],
cols[0]:cols[1]]``. Every layout in an RL weight sync is of that form:

Megatron (trainer), rank (tp, pp), local layer i = global layer pp_offset + i:
    linear_qkv   rows [t R/tp, (t+1) R/tp) of the fused [q heads of g; k_g; v_g]
                 for all KV groups g (R rows): whole groups when tp <= n_kv, part
                 of one group when tp > n_kv (Megatron all-gathers QKV then)
    linear_fc1   [gate rows of this rank; up rows of this rank]
    linear_proj, linear_fc2   row-parallel: all rows, this rank's columns
    linear_qkv.bias   (Qwen2) the weight's rows;  q_layernorm / k_layernorm (Qwen3) replicated
    word_embeddings / output_layer   rows [t V'/tp, (t+1) V'/tp) of Megatron's
                 padded vocabulary V' (rows >= V are padding: no logical source)
    norms        replicated on every TP rank of the stage
    MoE layers   pre_mlp_layernorm and the router replicated; SequentialMLP's
                 local_experts.{j} = expert ep_rank x E/ep + j, fc1 [gate; up]
                 rows and fc2 columns of its ETP rank (ExpertShard)

SGLang (generator), TP rank r (its Llama / Qwen loaders' layout, HF-derived names):
    qkv_proj     [its q heads; its k heads; its v heads], KV heads replicated
                 when tp > num_kv_heads (rank r holds head r // (tp / n_kv)); its
                 bias (Qwen2) the same rows; q_norm / k_norm (Qwen3) replicated
    gate_up_proj [gate shard; up shard];  o_proj, down_proj row-parallel
    mlp.gate     the router [E, h], replicated (MoE layers)
    mlp.experts.w13_weight / w2_weight   FusedMoE at --ep-size ep (inside TP:
                 rank r = ep_rank x tp/ep + moe_tp_rank): experts
                 [ep_rank E/ep, (ep_rank+1) E/ep), stacked; each expert's
                 intermediate rows split over moe_tp = tp/ep
    embed_tokens / lm_head   rows of SGLang's padded vocabulary (64, or 64 x tp)

Shapes only: a layout for Llama 3.1 405B is built on a laptop in milliseconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megarl.errors import ConfigError
from megarl.models.families import refuse_outside_trainer
from megarl.models.hf_mapping import hf_tensor_shapes
from megarl.models.megatron_model import DEFAULT_VOCAB_DIVISIBLE_BY, padded_vocab_size
from megarl.models.spec import ModelSpec

Range = Tuple[int, int]


@dataclass(frozen=True)
class Block:
    logical: str  # Hugging Face tensor name
    rows: Range  # rows of the logical tensor
    cols: Range  # columns of the logical tensor ((0, 1) for 1-D tensors)
    local_row: int  # first row of the block in the local tensor

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]


@dataclass(frozen=True)
class LocalTensor:
    name: str  # the parameter's name on that rank
    shape: Tuple[int, ...]  # local shape (1-D tensors are viewed as [n, 1])
    blocks: Tuple[Block, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def covered_numel(self) -> int:
        """Elements that hold model weights (the rest is vocabulary padding)."""
        return sum(b.num_rows * (b.cols[1] - b.cols[0]) for b in self.blocks)


def logical_shapes(spec: ModelSpec) -> Dict[str, Tuple[int, ...]]:
    """The logical tensors: the model's Hugging Face tensors (models/hf_mapping.py, the one
    mapping per family that checkpoint conversion uses too). Every layout (trainer's, SGLang's,
    the baseline's, colocated) starts here, so a family they do not lay out yet is refused here."""
    refuse_outside_trainer(spec.model_type, "weight sync (SGLang's layouts)")
    return hf_tensor_shapes(spec)


def _stack(name: str, parts: List[Tuple[str, Range, Range]], ncols: int) -> LocalTensor:
    """Local tensor made of row blocks (logical, rows, cols) stacked in order."""
    blocks, row = [], 0
    for logical, rows, cols in parts:
        blocks.append(Block(logical, rows, cols, row))
        row += rows[1] - rows[0]
    return LocalTensor(name, (row, ncols), tuple(blocks))


def _cut(parts: List[Tuple[str, Range, Range]], start: int, end: int) -> List[Tuple[str, Range, Range]]:
    """Rows [start, end) of the tensor made by stacking ``parts``, as parts again."""
    out, offset = [], 0
    for logical, rows, cols in parts:
        n = rows[1] - rows[0]
        lo, hi = max(start, offset), min(end, offset + n)
        if lo < hi:
            out.append((logical, (rows[0] + lo - offset, rows[0] + hi - offset), cols))
        offset += n
    return out


def _vocab_shard(name: str, logical: str, spec: ModelSpec, padded: int, tp: int, rank: int) -> LocalTensor:
    per_rank = padded // tp
    start = rank * per_rank
    real = (start, min(start + per_rank, spec.vocab_size))
    blocks = (Block(logical, real, (0, spec.hidden_size), 0),) if real[1] > real[0] else ()
    return LocalTensor(name, (per_rank, spec.hidden_size), blocks)


def _col_split(name: str, logical: str, shape: Tuple[int, int], tp: int, rank: int) -> LocalTensor:
    width = shape[1] // tp
    return LocalTensor(name, (shape[0], width), (Block(logical, (0, shape[0]), (rank * width, (rank + 1) * width), 0),))


def _replicated(name: str, logical: str, size: int) -> LocalTensor:
    return LocalTensor(name, (size,), (Block(logical, (0, size), (0, 1), 0),))


# -- Megatron ---------------------------------------------------------------------------------

MEGATRON_NORM_NAMES = {
    # Megatron's local layer spec vs the Transformer Engine spec (fused into the linears)
    "local": ("input_layernorm.weight", "pre_mlp_layernorm.weight"),
    "te": ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"),
}


@dataclass(frozen=True)
class MegatronShard:
    """Which Megatron rank: (tp_rank, pp_rank) of a TP x PP grid, its ``vp`` virtual stages
    (interleaved pipeline; None: one chunk per stage) and its place among the experts (None: EP1
    with expert TP = TP, Megatron's default expert_tensor_parallel_size)."""

    tp: int
    pp: int
    tp_rank: int
    pp_rank: int
    vp: Optional[int] = None
    experts: Optional["ExpertShard"] = None


@dataclass(frozen=True)
class _Chunk:
    """One model chunk of a rank: ``layers`` layers from global ``first_layer``; ``first`` / ``last``:
    it holds the embedding / the final norm and output layer; ``split``: the model spans several chunks."""

    first_layer: int
    layers: int
    first: bool
    last: bool
    split: bool

    @classmethod
    def stage(cls, spec: ModelSpec, shard: MegatronShard) -> "_Chunk":
        """The whole of stage ``pp_rank`` (no virtual stages)."""
        per_stage = spec.num_layers // shard.pp
        return cls(
            shard.pp_rank * per_stage, per_stage, shard.pp_rank == 0, shard.pp_rank == shard.pp - 1, shard.pp > 1
        )


def megatron_rank_layout(
    spec: ModelSpec,
    shard: MegatronShard,
    vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
    norm_names: str = "local",
) -> List[LocalTensor]:
    """The parameters of Megatron rank ``shard``, by their names in GPTModel; a model with experts
    also needs the rank's ``shard.experts`` (its EP and expert-TP coordinates).

    With ``shard.vp`` virtual stages (interleaved pipeline) the rank holds ``vp`` model
    chunks; chunk v's names carry the prefix ``"{v}/"`` (as ``endpoints.megatron_params``
    names them) and its layers start at Megatron's offset
    v x layers/vp + pp_rank x layers/(pp x vp).
    """
    if shard.experts is None:
        shard = dataclasses.replace(shard, experts=ExpertShard(1, 0, shard.tp, shard.tp_rank))
    if shard.vp is None:
        return _stage_layout(spec, shard, vocab_divisible_by, norm_names, _Chunk.stage(spec, shard))
    vp, pp, pp_rank = shard.vp, shard.pp, shard.pp_rank
    per_chunk = spec.num_layers // (pp * vp)
    out: List[LocalTensor] = []
    for v in range(vp):
        chunk = _Chunk(
            first_layer=v * (spec.num_layers // vp) + pp_rank * per_chunk,
            layers=per_chunk,
            first=v == 0 and pp_rank == 0,
            last=v == vp - 1 and pp_rank == pp - 1,
            split=True,
        )
        out += [
            dataclasses.replace(t, name=f"{v}/{t.name}")
            for t in _stage_layout(spec, shard, vocab_divisible_by, norm_names, chunk)
        ]
    return out


def _stage_layout(
    spec: ModelSpec, shard: MegatronShard, vocab_divisible_by: int, norm_names: str, chunk: _Chunk
) -> List[LocalTensor]:
    """One model chunk of rank ``shard`` (its TP slice of every tensor)."""
    tp, tp_rank, experts = shard.tp, shard.tp_rank, shard.experts
    first_layer, per_stage, first, last, split = chunk.first_layer, chunk.layers, chunk.first, chunk.last, chunk.split
    h, f, d = spec.hidden_size, spec.ffn_hidden_size, spec.head_dim
    shapes = logical_shapes(spec)
    qpg = spec.q_per_kv
    qkv_rows = spec.qkv_rows // tp  # TP splits the grouped rows evenly, even mid-group (tp > n_kv)
    attn_norm, mlp_norm = MEGATRON_NORM_NAMES[norm_names]
    out: List[LocalTensor] = []
    padded = padded_vocab_size(spec.vocab_size, tp, vocab_divisible_by)
    if first:
        out.append(
            _vocab_shard("embedding.word_embeddings.weight", "model.embed_tokens.weight", spec, padded, tp, tp_rank)
        )
    for local in range(per_stage):
        i = first_layer + local
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{local}."
        grouped = []  # the global fused QKV: [q heads of g; k_g; v_g] for every KV group g
        for g in range(spec.num_kv_heads):
            grouped.append((hf + "self_attn.q_proj.weight", (g * qpg * d, (g + 1) * qpg * d), (0, h)))
            grouped.append((hf + "self_attn.k_proj.weight", (g * d, (g + 1) * d), (0, h)))
            grouped.append((hf + "self_attn.v_proj.weight", (g * d, (g + 1) * d), (0, h)))
        qkv = _cut(grouped, tp_rank * qkv_rows, (tp_rank + 1) * qkv_rows)
        ff = (tp_rank * f // tp, (tp_rank + 1) * f // tp)
        out += [
            _replicated(mg + attn_norm, hf + "input_layernorm.weight", h),
            _stack(mg + "self_attention.linear_qkv.weight", qkv, h),
        ]
        if spec.qkv_bias:  # the same grouped rows as the weight's, one column
            bias_parts = [(x.replace(".weight", ".bias"), rows, (0, 1)) for x, rows, _ in grouped]
            bias = _stack(
                mg + "self_attention.linear_qkv.bias", _cut(bias_parts, tp_rank * qkv_rows, (tp_rank + 1) * qkv_rows), 1
            )
            out.append(dataclasses.replace(bias, shape=bias.shape[:1]))
        if spec.qk_norm:  # one weight over head_dim, on every TP rank
            out += [
                _replicated(mg + f"self_attention.{x}_layernorm.weight", hf + f"self_attn.{x}_norm.weight", d)
                for x in "qk"
            ]
        out.append(
            _col_split(
                mg + "self_attention.linear_proj.weight",
                hf + "self_attn.o_proj.weight",
                shapes[hf + "self_attn.o_proj.weight"],
                tp,
                tp_rank,
            )
        )
        if spec.is_moe_layer(i):
            out += _megatron_experts(spec, hf, mg, experts)
            continue
        out += [
            _replicated(mg + mlp_norm, hf + "post_attention_layernorm.weight", h),
            _stack(
                mg + "mlp.linear_fc1.weight",
                [(hf + "mlp.gate_proj.weight", ff, (0, h)), (hf + "mlp.up_proj.weight", ff, (0, h))],
                h,
            ),
            _col_split(mg + "mlp.linear_fc2.weight", hf + "mlp.down_proj.weight", (h, f), tp, tp_rank),
        ]
    if last:
        out.append(_replicated("decoder.final_layernorm.weight", "model.norm.weight", h))
        # Tied embeddings: the last stage's output_layer is a synchronised copy of the
        # embedding (Megatron keeps the two equal), so it can serve embed_tokens too.
        logical = "model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight"
        if not spec.tie_embeddings or split:
            out.append(_vocab_shard("output_layer.weight", logical, spec, padded, tp, tp_rank))
    return out


@dataclass(frozen=True)
class ExpertShard:
    """Where a Megatron rank sits among the experts: experts [ep_rank E/ep, (ep_rank + 1) E/ep), each
    one's FFN split over ``etp`` (expert_tensor_parallel_size) ranks (ParallelDims.expert_coords)."""

    ep: int
    ep_rank: int
    etp: int
    etp_rank: int


def _megatron_experts(spec: ModelSpec, hf: str, mg: str, shard: ExpertShard) -> List[LocalTensor]:
    """A MoE layer on one rank: its own pre-MLP norm (both layer specs), the router (replicated),
    and SequentialMLP's local experts, fc1 = [gate shard; up shard] and fc2 column-parallel over ETP."""
    h, moe = spec.hidden_size, spec.moe
    local = moe.num_experts // shard.ep
    width = moe.ffn_hidden_size // shard.etp
    ff = (shard.etp_rank * width, (shard.etp_rank + 1) * width)
    out = [
        _replicated(mg + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight", h),
        LocalTensor(
            mg + "mlp.router.weight",
            (moe.num_experts, h),
            (Block(hf + "mlp.gate.weight", (0, moe.num_experts), (0, h), 0),),
        ),
    ]
    for j in range(local):
        src, dst = f"{hf}mlp.experts.{shard.ep_rank * local + j}.", f"{mg}mlp.experts.local_experts.{j}."
        fc1 = [(src + "gate_proj.weight", ff, (0, h)), (src + "up_proj.weight", ff, (0, h))]
        out += [
            _stack(dst + "linear_fc1.weight", fc1, h),
            LocalTensor(dst + "linear_fc2.weight", (h, width), (Block(src + "down_proj.weight", (0, h), ff, 0),)),
        ]
    return out


# -- SGLang -----------------------------------------------------------------------------------

SGLANG_VOCAB_PADDING = 64


def sglang_padded_vocab(vocab_size: int, tp: int) -> int:
    """SGLang's VocabParallelEmbedding: pad to 64, or to 64 x tp when 64 does not split evenly."""
    padding = SGLANG_VOCAB_PADDING
    if (-(-vocab_size // padding) * padding) % tp:
        padding *= tp
    return -(-vocab_size // padding) * padding


def sglang_kv_head_of(spec: ModelSpec, tp: int, rank: int) -> Tuple[int, int]:
    """[first, last) KV heads held by SGLang TP rank ``rank`` (replicated when tp > n_kv)."""
    if tp >= spec.num_kv_heads:
        head = rank // (tp // spec.num_kv_heads)
        return head, head + 1
    per = spec.num_kv_heads // tp
    return rank * per, (rank + 1) * per


def check_sglang_tp(spec: ModelSpec, tp: int, ep: int = 1) -> None:
    if spec.num_attention_heads % tp:
        raise ConfigError(
            f"generator tensor_parallel={tp} does not divide num_attention_heads={spec.num_attention_heads}"
        )
    if tp >= spec.num_kv_heads and tp % spec.num_kv_heads:
        raise ConfigError(
            f"generator tensor_parallel={tp} is not a multiple of num_key_value_heads={spec.num_kv_heads}"
        )
    if tp < spec.num_kv_heads and spec.num_kv_heads % tp:
        raise ConfigError(f"generator tensor_parallel={tp} does not divide num_key_value_heads={spec.num_kv_heads}")
    if spec.num_dense_layers and spec.ffn_hidden_size % tp:
        raise ConfigError(f"generator tensor_parallel={tp} does not divide intermediate_size={spec.ffn_hidden_size}")
    if ep > 1 and spec.moe is None:
        raise ConfigError(f"generator.ep={ep}: model_type {spec.model_type!r} has no experts")
    if spec.moe is not None:
        if tp % ep:
            raise ConfigError(
                f"generator.ep={ep} does not divide generator tensor_parallel={tp} (SGLang's EP is inside TP)"
            )
        if spec.moe.num_experts % ep:
            raise ConfigError(f"generator.ep={ep} does not divide num_experts={spec.moe.num_experts}")
        if spec.moe.ffn_hidden_size % (tp // ep):
            raise ConfigError(
                f"generator tensor_parallel / ep = {tp // ep} does not divide "
                f"moe_intermediate_size={spec.moe.ffn_hidden_size}"
            )


def sglang_expert_shard(spec: ModelSpec, tp: int, rank: int, ep: int = 1) -> Tuple[Range, Range]:
    """SGLang's FusedMoE on TP rank ``rank`` with ``--ep-size ep`` (EP inside TP, moe_tp = tp / ep,
    rank = ep_rank x moe_tp + moe_tp_rank): its experts [first, last) -- contiguous, as
    FusedMoE maps global ids -- and its rows [first, last) of every expert's intermediate dimension."""
    moe_tp = tp // ep
    ep_rank, moe_tp_rank = divmod(rank, moe_tp)
    local = spec.moe.num_experts // ep
    width = spec.moe.ffn_hidden_size // moe_tp
    return (ep_rank * local, (ep_rank + 1) * local), (moe_tp_rank * width, (moe_tp_rank + 1) * width)


def _sglang_experts(spec: ModelSpec, layer: str, tp: int, rank: int, ep: int) -> List[LocalTensor]:
    """FusedMoE's stacked weights: w13 [local experts, 2 I/moe_tp, h] = per expert [gate shard; up
    shard], w2 [local experts, h, I/moe_tp] (its columns); blocks index their [-1, last dim] view.
    The router (``mlp.gate``, a ReplicatedLinear) is whole on every rank."""
    h, e = spec.hidden_size, spec.moe.num_experts
    (first, last), ff = sglang_expert_shard(spec, tp, rank, ep)
    width = ff[1] - ff[0]
    w13, w2 = [], []
    for j, x in enumerate(range(first, last)):
        src = f"{layer}mlp.experts.{x}."
        w13 += [(src + "gate_proj.weight", ff, (0, h)), (src + "up_proj.weight", ff, (0, h))]
        w2.append(Block(src + "down_proj.weight", (0, h), ff, j * h))
    gate13 = _stack(layer + "mlp.experts.w13_weight", w13, h)
    return [
        LocalTensor(layer + "mlp.gate.weight", (e, h), (Block(layer + "mlp.gate.weight", (0, e), (0, h), 0),)),
        dataclasses.replace(gate13, shape=(last - first, 2 * width, h)),
        LocalTensor(layer + "mlp.experts.w2_weight", (last - first, h, width), tuple(w2)),
    ]


def sglang_rank_layout(spec: ModelSpec, tp: int, rank: int, ep: int = 1) -> List[LocalTensor]:
    """The parameters of SGLang TP rank ``rank`` of one generator replica, by SGLang's names
    (its Llama / Qwen2 / Qwen3 / Qwen3-MoE loaders'); ``ep``: SGLang's --ep-size."""
    check_sglang_tp(spec, tp, ep)
    h, f, d = spec.hidden_size, spec.ffn_hidden_size, spec.head_dim
    shapes = logical_shapes(spec)
    heads = spec.num_attention_heads // tp
    kv0, kv1 = sglang_kv_head_of(spec, tp, rank)
    padded = sglang_padded_vocab(spec.vocab_size, tp)
    out = [_vocab_shard("model.embed_tokens.weight", "model.embed_tokens.weight", spec, padded, tp, rank)]
    ff = (rank * f // tp, (rank + 1) * f // tp)
    q_rows, kv_rows = (rank * heads * d, (rank + 1) * heads * d), (kv0 * d, kv1 * d)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        out += [
            _replicated(p + "input_layernorm.weight", p + "input_layernorm.weight", h),
            _stack(
                attn + "qkv_proj.weight",
                [(attn + "q_proj.weight", q_rows, (0, h))]
                + [(attn + f"{x}_proj.weight", kv_rows, (0, h)) for x in "kv"],
                h,
            ),
        ]
        if spec.qkv_bias:  # Qwen2: QKVParallelLinear's bias, sharded as its weight's rows
            bias = _stack(
                attn + "qkv_proj.bias",
                [(attn + "q_proj.bias", q_rows, (0, 1))] + [(attn + f"{x}_proj.bias", kv_rows, (0, 1)) for x in "kv"],
                1,
            )
            out.append(dataclasses.replace(bias, shape=bias.shape[:1]))
        if spec.qk_norm:  # Qwen3: one RMSNorm weight over head_dim, on every rank
            out += [_replicated(attn + f"{x}_norm.weight", attn + f"{x}_norm.weight", d) for x in "qk"]
        out += [
            _col_split(attn + "o_proj.weight", attn + "o_proj.weight", shapes[attn + "o_proj.weight"], tp, rank),
            _replicated(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", h),
        ]
        if spec.is_moe_layer(i):
            out += _sglang_experts(spec, p, tp, rank, ep)
            continue
        out += [
            _stack(
                p + "mlp.gate_up_proj.weight",
                [(p + "mlp.gate_proj.weight", ff, (0, h)), (p + "mlp.up_proj.weight", ff, (0, h))],
                h,
            ),
            _col_split(p + "mlp.down_proj.weight", p + "mlp.down_proj.weight", (h, f), tp, rank),
        ]
    out.append(_replicated("model.norm.weight", "model.norm.weight", h))
    if not spec.tie_embeddings:
        out.append(_vocab_shard("lm_head.weight", "lm_head.weight", spec, padded, tp, rank))
    return out
