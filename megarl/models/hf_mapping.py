"""Hugging Face tensors <-> Megatron-Core global (logical) tensors, for every model family.

Megatron's dist checkpoints name every tensor by a canonical key (the TE-style
key, whatever layer spec the model was built with) and store its *global*
tensor, which is independent of the TP/PP/EP layout it was saved at:

    embedding.word_embeddings.weight                      [padded_vocab, h]
    decoder.layers.self_attention.linear_qkv.layer_norm_weight   [L, h]
    decoder.layers.self_attention.linear_qkv.weight       [L, (nq + 2 nkv) d, h]
        rows grouped per KV group g: [q heads of group g; k_g; v_g]
    decoder.layers.self_attention.linear_qkv.bias         [L, (nq + 2 nkv) d]  (Qwen2, same grouping)
    decoder.layers.self_attention.{q,k}_layernorm.weight  [L, d]  (Qwen3: one RMSNorm for all heads)
    decoder.layers.self_attention.linear_proj.weight      [L, h, nq d]
    decoder.layers.mlp.linear_fc1.layer_norm_weight       [L, h]          dense layers
    decoder.layers.mlp.linear_fc1.weight                  [L, 2 f, h] = [gate; up]
    decoder.layers.mlp.linear_fc2.weight                  [L, h, f]
    decoder.layers.pre_mlp_layernorm.weight               [h]             MoE layers
    decoder.layers.mlp.router.weight                      [E, h]
    decoder.layers.mlp.experts.experts.linear_fc1.weight  [E, 2 fe, h], per expert [gate; up]
    decoder.layers.mlp.experts.experts.linear_fc2.weight  [E, h, fe]
    decoder.layers.mlp.router.expert_bias                 [E]  fp32 (DeepSeek-V3, GLM-4.5: e_score_correction_bias)
    decoder.layers.mlp.shared_experts.linear_fc1.weight   [2 fs, h] = [gate; up]   (their shared_experts)
    decoder.layers.mlp.shared_experts.linear_fc2.weight   [h, fs]
    decoder.final_layernorm.weight                        [h]
    output_layer.weight                                   [padded_vocab, h] (untied only)

Multi-head latent attention (DeepSeek-V3) replaces linear_qkv by Megatron's MLASelfAttention:

    decoder.layers.input_layernorm.weight                          [h]
    decoder.layers.self_attention.linear_q_down_proj.weight        [q_lora, h]      q_a_proj
    decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight [q_lora]       q_a_layernorm
    decoder.layers.self_attention.linear_q_up_proj.weight          [n (dn + dr), q_lora]  q_b_proj
    decoder.layers.self_attention.linear_q_proj.weight             [n (dn + dr), h] q_proj (no q_lora_rank)
    decoder.layers.self_attention.linear_kv_down_proj.weight       [kv_lora + dr, h] kv_a_proj_with_mqa
    decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight [kv_lora]     kv_a_layernorm
    decoder.layers.self_attention.linear_kv_up_proj.weight         [n (dn + dv), kv_lora] kv_b_proj
    decoder.layers.self_attention.linear_proj.weight               [h, n dv]        o_proj

Both lay each head out as transformers does ([nope; rope] for q, [k_nope; v] for kv_b), so these
are copies; the rope half stays interleaved in the checkpoint and both de-interleave it in the
forward. (The layer-norm keys are the Transformer Engine spec's; models/megatron_model.py maps the
local spec's q_layernorm / kv_layernorm / pre_mlp_layernorm onto them.)

A dense model's layer tensors are stacked along a leading layer axis ([L, ...]). A model with
experts has layers of two kinds, and Megatron then keys each layer's tensors by its number,
``decoder.layers.{i}.<rest>``, without the layer axis (``layer_key``); the expert tensors keep a
leading expert axis. (Per TP rank, fc1 holds [gate shard; up shard]; Megatron's swiglu sharded
factory stores it as the global [gate; up], so it is layout independent too.) This module is the
one place that knows how the two naming schemes relate, per family; checkpoint conversion (both
ways) and weight sync's logical tensors (``hf_tensor_shapes``) both use it.

What was taken from mbridge (0.15.1, the HF <-> Megatron tables verl and slime use): nothing as
code -- it builds models with the Transformer Engine spec and calls torch.cuda -- but its Qwen2 /
Qwen3 / Qwen3-MoE name tables were read to confirm these pairs. Its Qwen3-MoE bridge sets
moe_router_pre_softmax=False whatever norm_topk_prob says, which routes wrongly for
norm_topk_prob=False (Megatron would softmax over the top k only); megarl derives it
(models/megatron_model.py) and tests the logits against transformers'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from megarl.models.spec import ModelSpec

LAYERS_PREFIX = "decoder.layers."
_NUMBERED_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

DENSE, MOE, EVERY = "dense", "moe", "every"  # which layers a per-layer mapping is on


@dataclass(frozen=True)
class TensorMapping:
    megatron_key: str  # canonical: decoder.layers.<rest> for per-layer tensors
    hf_names: tuple  # HF names, with "{layer}" for per-layer tensors and "{expert}" for experts'
    kind: str  # copy | qkv | gate_up | vocab
    layers: str = EVERY  # DENSE | MOE | EVERY: the layers of that kind have it
    per_expert: bool = False  # the Megatron tensor has a leading expert axis, one HF tensor set per expert

    @property
    def per_layer(self) -> bool:
        return self.megatron_key.startswith(LAYERS_PREFIX)

    def on_layer(self, spec: ModelSpec, layer: int) -> bool:
        return self.layers == EVERY or (self.layers == MOE) == spec.is_moe_layer(layer)

    def hf_names_for(self, layer: Optional[int], expert: Optional[int] = None) -> List[str]:
        return [name.format(layer=layer, expert=expert) for name in self.hf_names]


def layer_key(key: str, layer: int) -> str:
    """The key of one layer's tensor in a model keyed per layer (a model with experts)."""
    return f"{LAYERS_PREFIX}{layer}.{key[len(LAYERS_PREFIX) :]}"


def split_layer_key(key: str) -> Tuple[str, Optional[int]]:
    """(canonical key, layer) of a per-layer-numbered key; (key, None) for any other."""
    match = _NUMBERED_LAYER.match(key)
    return (LAYERS_PREFIX + match.group(2), int(match.group(1))) if match else (key, None)


def _latent_attention_mappings(spec: ModelSpec) -> List[TensorMapping]:
    layer, attn = "model.layers.{layer}.self_attn.", "decoder.layers.self_attention."
    pairs = [("decoder.layers.input_layernorm.weight", "model.layers.{layer}.input_layernorm.weight")]
    if spec.mla.q_lora_rank is None:
        pairs.append((attn + "linear_q_proj.weight", layer + "q_proj.weight"))
    else:
        pairs += [
            (attn + "linear_q_down_proj.weight", layer + "q_a_proj.weight"),
            (attn + "linear_q_up_proj.layer_norm_weight", layer + "q_a_layernorm.weight"),
            (attn + "linear_q_up_proj.weight", layer + "q_b_proj.weight"),
        ]
    pairs += [
        (attn + "linear_kv_down_proj.weight", layer + "kv_a_proj_with_mqa.weight"),
        (attn + "linear_kv_up_proj.layer_norm_weight", layer + "kv_a_layernorm.weight"),
        (attn + "linear_kv_up_proj.weight", layer + "kv_b_proj.weight"),
        (attn + "linear_proj.weight", layer + "o_proj.weight"),
    ]
    return [TensorMapping(key, (name,), "copy") for key, name in pairs]


def _latent_attention_shapes(spec: ModelSpec, p: str) -> Dict[str, Tuple[int, ...]]:
    mla, h, n = spec.mla, spec.hidden_size, spec.num_attention_heads
    q_rows = n * mla.q_head_dim
    if mla.q_lora_rank is None:
        shapes = {p + "self_attn.q_proj.weight": (q_rows, h)}
    else:
        shapes = {
            p + "self_attn.q_a_proj.weight": (mla.q_lora_rank, h),
            p + "self_attn.q_a_layernorm.weight": (mla.q_lora_rank,),
            p + "self_attn.q_b_proj.weight": (q_rows, mla.q_lora_rank),
        }
    return shapes | {
        p + "self_attn.kv_a_proj_with_mqa.weight": (mla.kv_lora_rank + mla.qk_rope_head_dim, h),
        p + "self_attn.kv_a_layernorm.weight": (mla.kv_lora_rank,),
        p + "self_attn.kv_b_proj.weight": (n * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
        p + "self_attn.o_proj.weight": (h, n * mla.v_head_dim),
    }


def tensor_mappings(spec: ModelSpec) -> List[TensorMapping]:
    layer = "model.layers.{layer}."
    attn = "decoder.layers.self_attention."
    mappings = [TensorMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    if spec.mla:
        mappings += _latent_attention_mappings(spec)
    else:
        mappings += [
            TensorMapping(attn + "linear_qkv.layer_norm_weight", (layer + "input_layernorm.weight",), "copy"),
            TensorMapping(
                attn + "linear_qkv.weight",
                tuple(layer + f"self_attn.{x}_proj.weight" for x in "qkv"),
                "qkv",
            ),
            TensorMapping(attn + "linear_proj.weight", (layer + "self_attn.o_proj.weight",), "copy"),
        ]
    mappings.append(TensorMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"))
    if spec.qkv_bias:
        names = tuple(layer + f"self_attn.{x}_proj.bias" for x in "qkv")
        mappings.append(TensorMapping(attn + "linear_qkv.bias", names, "qkv"))
    if spec.qk_norm:
        for x in "qk":
            mappings.append(
                TensorMapping(attn + f"{x}_layernorm.weight", (layer + f"self_attn.{x}_norm.weight",), "copy")
            )
    if spec.num_dense_layers:
        mlp = "decoder.layers.mlp."
        mappings += [
            TensorMapping(
                mlp + "linear_fc1.layer_norm_weight", (layer + "post_attention_layernorm.weight",), "copy", DENSE
            ),
            TensorMapping(
                mlp + "linear_fc1.weight",
                (layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"),
                "gate_up",
                DENSE,
            ),
            TensorMapping(mlp + "linear_fc2.weight", (layer + "mlp.down_proj.weight",), "copy", DENSE),
        ]
    if spec.moe:
        expert = layer + "mlp.experts.{expert}."
        experts = "decoder.layers.mlp.experts.experts."
        mappings += [
            TensorMapping(
                "decoder.layers.pre_mlp_layernorm.weight", (layer + "post_attention_layernorm.weight",), "copy", MOE
            ),
            TensorMapping("decoder.layers.mlp.router.weight", (layer + "mlp.gate.weight",), "copy", MOE),
            TensorMapping(
                experts + "linear_fc1.weight",
                (expert + "gate_proj.weight", expert + "up_proj.weight"),
                "gate_up",
                MOE,
                True,
            ),
            TensorMapping(experts + "linear_fc2.weight", (expert + "down_proj.weight",), "copy", MOE, True),
        ]
        if spec.moe.router_expert_bias:
            bias = (layer + "mlp.gate.e_score_correction_bias",)
            mappings.append(TensorMapping("decoder.layers.mlp.router.expert_bias", bias, "copy", MOE))
        if spec.moe.shared_expert_ffn_hidden_size:
            shared, hf_shared = "decoder.layers.mlp.shared_experts.", layer + "mlp.shared_experts."
            mappings += [
                TensorMapping(
                    shared + "linear_fc1.weight",
                    (hf_shared + "gate_proj.weight", hf_shared + "up_proj.weight"),
                    "gate_up",
                    MOE,
                ),
                TensorMapping(shared + "linear_fc2.weight", (hf_shared + "down_proj.weight",), "copy", MOE),
            ]
    if not spec.tie_embeddings:
        mappings.append(TensorMapping("output_layer.weight", ("lm_head.weight",), "vocab"))
    return mappings


def mapping_by_key(spec: ModelSpec) -> Dict[str, TensorMapping]:
    return {m.megatron_key: m for m in tensor_mappings(spec)}


def hf_tensor_shapes(spec: ModelSpec) -> Dict[str, Tuple[int, ...]]:
    """Every tensor of the model by its Hugging Face checkpoint name (the hub layout: one tensor
    per expert), with its shape. The logical tensors of weight sync's layouts
    (weight_sync/layouts.py) and of checkpoint conversion are these names."""
    h, f, d = spec.hidden_size, spec.ffn_hidden_size, spec.head_dim
    q_rows, kv_rows = spec.num_attention_heads * d, spec.num_kv_heads * d
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
        if spec.mla:
            shapes.update(_latent_attention_shapes(spec, p))
        else:
            shapes.update(
                {
                    p + "self_attn.q_proj.weight": (q_rows, h),
                    p + "self_attn.k_proj.weight": (kv_rows, h),
                    p + "self_attn.v_proj.weight": (kv_rows, h),
                    p + "self_attn.o_proj.weight": (h, q_rows),
                }
            )
        if spec.qkv_bias:
            shapes.update(
                {p + "self_attn.q_proj.bias": (q_rows,), p + "self_attn.k_proj.bias": (kv_rows,)}
                | {p + "self_attn.v_proj.bias": (kv_rows,)}
            )
        if spec.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if spec.is_moe_layer(i):
            moe = spec.moe
            shapes[p + "mlp.gate.weight"] = (moe.num_experts, h)  # the router
            if moe.router_expert_bias:
                shapes[p + "mlp.gate.e_score_correction_bias"] = (moe.num_experts,)
            if moe.shared_expert_ffn_hidden_size:
                x, fs = p + "mlp.shared_experts.", moe.shared_expert_ffn_hidden_size
                shapes.update({x + "gate_proj.weight": (fs, h), x + "up_proj.weight": (fs, h)})
                shapes[x + "down_proj.weight"] = (h, fs)
            for e in range(moe.num_experts):
                x = f"{p}mlp.experts.{e}."
                fe = moe.ffn_hidden_size
                shapes.update({x + "gate_proj.weight": (fe, h), x + "up_proj.weight": (fe, h)})
                shapes[x + "down_proj.weight"] = (h, fe)
        else:
            shapes.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h)})
            shapes[p + "mlp.down_proj.weight"] = (h, f)
    return shapes


# -- layout transforms ----------------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """HF q/k/v projections -> Megatron's fused QKV, grouped per KV group."""
    g, d, rest = spec.num_kv_heads, spec.head_dim, tuple(q.shape[1:])  # rest: (h,), or () for biases
    grouped = torch.cat(
        [q.reshape(g, spec.q_per_kv, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)], dim=1
    )
    return grouped.reshape(spec.qkv_rows, *rest)


def split_qkv(qkv: torch.Tensor, spec: ModelSpec):
    """Inverse of fuse_qkv."""
    g, d, rest = spec.num_kv_heads, spec.head_dim, tuple(qkv.shape[1:])
    grouped = qkv.reshape(g, spec.q_per_kv + 2, d, *rest)
    q = grouped[:, : spec.q_per_kv].reshape(spec.num_attention_heads * d, *rest)
    k = grouped[:, spec.q_per_kv].reshape(g * d, *rest)
    v = grouped[:, spec.q_per_kv + 1].reshape(g * d, *rest)
    return q.contiguous(), k.contiguous(), v.contiguous()


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Append zero rows up to Megatron's padded vocabulary size."""
    if padded_rows < weight.shape[0]:
        raise ValueError(f"padded vocabulary {padded_rows} is smaller than the vocabulary {weight.shape[0]}")
    if padded_rows == weight.shape[0]:
        return weight
    pad = weight.new_zeros((padded_rows - weight.shape[0],) + tuple(weight.shape[1:]))
    return torch.cat([weight, pad], dim=0)


def to_megatron(
    mapping: TensorMapping,
    spec: ModelSpec,
    read_hf: Callable[[str], torch.Tensor],
    layer: int | None,
    global_rows: int | None = None,
    expert: int | None = None,
) -> torch.Tensor:
    """The Megatron global tensor for one mapping (one layer of it, if per-layer; one expert of
    that, for the experts' tensors).

    ``global_rows`` is the padded vocabulary size for vocab tensors.
    """
    tensors = [read_hf(name) for name in mapping.hf_names_for(layer, expert)]
    if mapping.kind == "copy":
        return tensors[0]
    if mapping.kind == "qkv":
        return fuse_qkv(*tensors, spec)
    if mapping.kind == "gate_up":
        return torch.cat(tensors, dim=0)
    if mapping.kind == "vocab":
        return pad_vocab(tensors[0], global_rows or tensors[0].shape[0])
    raise AssertionError(mapping.kind)


def to_hf(mapping: TensorMapping, spec: ModelSpec, tensor: torch.Tensor, layer: int | None) -> Dict[str, torch.Tensor]:
    """HF tensors (name -> tensor) from one Megatron global tensor (one layer of it; all its
    experts, the leading axis, for the experts' tensors)."""
    if mapping.per_expert:
        out: Dict[str, torch.Tensor] = {}
        for expert in range(tensor.shape[0]):
            out.update(_to_hf(mapping, spec, tensor[expert], mapping.hf_names_for(layer, expert)))
        return out
    return _to_hf(mapping, spec, tensor, mapping.hf_names_for(layer))


def _to_hf(mapping: TensorMapping, spec: ModelSpec, tensor: torch.Tensor, names: List[str]) -> Dict[str, torch.Tensor]:
    if mapping.kind == "copy":
        parts: Sequence[torch.Tensor] = [tensor]
    elif mapping.kind == "qkv":
        parts = split_qkv(tensor, spec)
    elif mapping.kind == "gate_up":
        parts = [p.contiguous() for p in torch.chunk(tensor, 2, dim=0)]
    elif mapping.kind == "vocab":
        parts = [tensor[: spec.vocab_size].contiguous()]
    else:
        raise AssertionError(mapping.kind)
    return dict(zip(names, parts))
