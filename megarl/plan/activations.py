"""Per-GPU memory of a Megatron-Core trainer replica: state and activations, as the config sets them.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models"), who count the bytes each transformer layer keeps
for its backward pass, per token of a micro-batch, in 16-bit precision. For
their GPT layer (4h MLP, dropout) that is 34 h + 5 a s: 10 h replicated on every
TP rank (norm inputs, the inputs of each block's first linear, dropout masks)
and 24 h + 5 a s split over the t TP ranks; sequence parallelism splits the
replicated part too (34 h / t), selective recomputation drops the 5 a s of core
attention, full recomputation keeps only each layer's input (2 h; / t with SP).

A Llama layer counted the same way (no dropout, RMSNorm, grouped-query attention
with h_kv = kv_heads x head_dim, SwiGLU MLP of width f), bytes per token:

    norm inputs   4 h        replicated over TP unless SP (then / t)
    norm outputs  4 h        = the inputs of QKV and fc1; replicated unless SP
    attention     (2 h + 4 h_kv + 2 h) / t    Q, K, V and the attention output (o_proj's input)
    mlp           6 f / t    fc1's output (gate and up, for SwiGLU's backward) + fc2's input
    scores        2 a s / t  the softmax output, only where attention is unfused (Megatron's
                             local spec); Korthikanti's other 3 a s are dropout's mask and output

With sequence parallelism Llama 3 8B keeps exactly 34 h / t (70B 33.5 h / t, 405B
31.75 h / t). Transformer Engine's fused attention keeps no s x s tensor (only a
per-row statistic, < 0.1% of the layer: not counted), so with TE Megatron's
selective default (core_attn) saves nothing -- Megatron-Core warns as much.
Selective ``mlp`` keeps only the MLP's input; ``layernorm`` discards the norm
outputs, which only the local spec has as separate modules (TE fuses the norms
into the following linears).

In flight: 1F1B keeps pp - r micro-batches on PP rank r (rank 0 the most);
the interleaved schedule keeps (pp - r - 1) 2 + (vpp - 1) pp + 1 chunks of
L / (pp vpp) layers, both capped by the micro-batches there are. Full
recomputation rebuilds one group (uniform: recompute_num_layers layers) or one
layer (block) at a time during backward: that transient is added once. The
last stage also holds the fp32 logits of a micro-batch for the log-probs.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

from megarl.errors import ConfigError
from megarl.plan.inputs import TrainerLayout, TrainerOptions

BYTES = 2.0  # bf16 activations
LOGIT_BYTES = 4.0  # fp32 logits for the vocab-parallel log-probs


def layer_parts(
    shape, layout: TrainerLayout, options: TrainerOptions, seq_len: float, modules: Tuple[str, ...] = ()
) -> Dict[str, float]:
    """Bytes one layer keeps per token of its micro-batch on one TP rank, by part (see the module doc)."""
    t, h, te = layout.dims.tp, shape.hidden, options.transformer_impl == "transformer_engine"
    q = shape.heads * shape.head_dim
    kv_rank = max(shape.kv_heads / t, 1.0) * shape.head_dim  # K (and V) width per rank: replicated when t > kv
    replicated = t if layout.sp else 1
    parts = {
        "norm_inputs": 2 * BYTES * h / replicated,
        "norm_outputs": 2 * BYTES * h / replicated,
        "attention": BYTES * (2 * q / t + 2 * kv_rank),
        "mlp": BYTES * mlp_width(shape, layout),
        "scores": 0.0 if te else BYTES * shape.heads * seq_len / t,
    }
    if "core_attn" in modules:
        parts["scores"] = 0.0
    if "mlp" in modules:
        parts["mlp"] = 0.0
        if te:  # the fused LN-linear inside the MLP no longer keeps its norm output
            parts["norm_outputs"] /= 2
    if "layernorm" in modules and not te:  # output-discarding checkpoint of both norms
        parts["norm_outputs"] = 0.0
    return parts


def mlp_width(shape, layout: TrainerLayout) -> float:
    """Elements a layer's MLP keeps per token on one rank, averaged over the layers: a dense MLP its
    gate, up and fc2 input (3 f / t); a MoE layer, for each of the token's top-k experts, the dispatched
    hidden state (h: gathered over expert TP) and the expert's 3 f_e / etp. With EP each rank receives
    top-k tokens per local token on average (an even routing: imbalance is not priced)."""
    t, etp = layout.dims.tp, layout.dims.expert_tp
    dense = 3 * shape.ffn / t
    if not shape.moe_layers:
        return dense
    moe = shape.top_k * (shape.hidden + 3 * shape.moe_ffn / etp)
    return ((shape.layers - shape.moe_layers) * dense + shape.moe_layers * moe) / shape.layers


def layer_bytes(shape, layout, options, seq_len, modules=()) -> float:
    return sum(layer_parts(shape, layout, options, seq_len, modules).values())


def checkpoint_bytes(shape, layout: TrainerLayout) -> float:
    """Full recomputation keeps a layer's (or group's) input: 2 h per token, split over TP with SP."""
    return BYTES * shape.hidden / (layout.dims.tp if layout.sp else 1)


def chunks_in_flight(layout: TrainerLayout, micro_batches: int, rank: int) -> int:
    """Micro-batch chunks PP rank `rank` holds activations for at its peak (Megatron's warm-up + 1)."""
    pp, vpp = layout.dims.pp, layout.dims.vpp
    if vpp == 1:
        return max(1, min(pp - rank, micro_batches))
    return max(1, min((pp - rank - 1) * 2 + (vpp - 1) * pp + 1, micro_batches * vpp))


def chunk_bytes(
    shape, layout: TrainerLayout, options: TrainerOptions, layers: int, tokens: float, seq_len: float
) -> Tuple[float, float]:
    """(bytes kept per micro-batch chunk of `layers` layers, transient bytes of one rebuild)."""
    full = layer_bytes(shape, layout, options, seq_len)
    if layout.recompute == "none":
        return layers * full * tokens, 0.0
    if layout.recompute == "selective":
        return layers * layer_bytes(shape, layout, options, seq_len, layout.recompute_modules) * tokens, 0.0
    n = 1 if layout.recompute_num_layers is None else layout.recompute_num_layers
    ckpt = checkpoint_bytes(shape, layout)
    if (layout.recompute_method or "uniform") == "uniform":
        group = max(1, min(n, layers))
        return math.ceil(layers / group) * ckpt * tokens, group * full * tokens
    recomputed = min(n, layers)  # block: the first n layers of each chunk, one at a time
    kept = recomputed * ckpt + (layers - recomputed) * full
    return kept * tokens, (full * tokens if recomputed else 0.0)


def stage_activations(
    shape, layout: TrainerLayout, options: TrainerOptions, tokens: float, seq_len: float, micro_batches: int, rank: int
) -> float:
    """Peak activation bytes on PP rank `rank` (tokens: one micro-batch's, before CP splits it)."""
    layers = -(-shape.layers // (layout.dims.pp * layout.dims.vpp))  # the largest (virtual) stage's
    local = tokens / layout.dims.cp
    kept, transient = chunk_bytes(shape, layout, options, layers, local, seq_len)
    return chunks_in_flight(layout, micro_batches, rank) * kept + transient


def logits_bytes(shape, layout: TrainerLayout, tokens: float) -> float:
    return tokens / layout.dims.cp * shape.vocab / layout.dims.tp * LOGIT_BYTES


def state_parts(shape, layout: TrainerLayout, options: TrainerOptions) -> Dict[str, float]:
    """Weights, gradients and optimizer state of the largest stage on one GPU. A MoE model's routed
    experts are sharded over EP x ETP instead of TP, and their optimizer state over the expert data
    parallel group (edp = tp x cp x dp / (ep x etp)), as Megatron's distributed optimizer shards them."""
    d = layout.dims
    experts = shape.stage_expert_params(d.pp)
    dense = shape.stage_params(d.pp) - experts
    stage = dense / d.tp + experts / (d.ep * d.expert_tp)
    shards = d.dp * d.cp  # Megatron shards the optimizer over the DP x CP group
    fsdp = options.state_sharding == "fsdp"
    if fsdp and experts:
        raise ConfigError("FSDP state sharding of experts is not priced (scenarios are dense models)")
    sharded_state = dense / d.tp / shards + experts / (d.ep * d.expert_tp) / d.edp
    parts = {
        "weights": 2.0 * stage / (shards if fsdp else 1),
        "grads": options.grad_bytes * stage / (shards if fsdp else 1),
        "optimizer": options.optimizer_bytes * (stage if options.state_sharding == "none" else sharded_state),
    }
    if fsdp:  # the layer being computed and the one prefetched, gathered in bf16
        layer = shape.linear_params / shape.layers / layout.dims.tp
        parts["fsdp_gathered"] = 2 * 2.0 * layer
    return parts


def trainer_parts(
    shape, layout: TrainerLayout, options: TrainerOptions, tokens: float, seq_len: float, micro_batches: int
) -> Tuple[str, Dict[str, float]]:
    """The fullest GPU of a replica: PP rank 0 (most micro-batches in flight) or the last (logits)."""
    best = None
    for rank in sorted({0, layout.dims.pp - 1}):
        parts = dict(state_parts(shape, layout, options))
        parts["activations"] = stage_activations(shape, layout, options, tokens, seq_len, micro_batches, rank)
        parts["logits"] = logits_bytes(shape, layout, tokens) if rank == layout.dims.pp - 1 else 0.0
        total = sum(parts.values())
        if best is None or total > best[0]:
            name = "the only stage" if layout.dims.pp == 1 else ("PP rank 0" if rank == 0 else "the last PP rank")
            best = (total, name, parts)
    return best[1], best[2]
