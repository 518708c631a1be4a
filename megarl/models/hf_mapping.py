"""Hugging Face Llama tensors <-> Megatron-Core global (logical) tensors.

Megatron's dist checkpoints name every tensor by a canonical key (the TE-style
key, whatever layer spec the model was built with) and store its *global*
tensor, which is independent of the TP/PP layout it was saved at:

    embedding.word_embeddings.weight                      [padded_vocab, h]
    decoder.layers.self_attention.linear_qkv.layer_norm_weight   [L, h]
    decoder.layers.self_attention.linear_qkv.weight       [L, (nq + 2 nkv) d, h]
        rows grouped per KV group g: [q heads of group g; k_g; v_g]
    decoder.layers.self_attention.linear_proj.weight      [L, h, nq d]
    decoder.layers.mlp.linear_fc1.layer_norm_weight       [L, h]
    decoder.layers.mlp.linear_fc1.weight                  [L, 2 f, h] = [gate; up]
    decoder.layers.mlp.linear_fc2.weight                  [L, h, f]
    decoder.final_layernorm.weight                        [h]
    output_layer.weight                                   [padded_vocab, h] (untied only)

(Per TP rank, fc1 holds [gate shard; up shard]; Megatron's swiglu sharded
factory stores it as the global [gate; up], so it is layout independent too.)
This module is the one place that knows how the two naming schemes relate;
checkpoint conversion and weight sync both use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from megarl.models.spec import ModelSpec

LAYERS_PREFIX = "decoder.layers."


@dataclass(frozen=True)
class TensorMapping:
    megatron_key: str
    hf_names: tuple  # HF names, with "{layer}" for per-layer tensors
    kind: str  # copy | qkv | gate_up | vocab

    @property
    def per_layer(self) -> bool:
        return self.megatron_key.startswith(LAYERS_PREFIX)

    def hf_names_for(self, layer: int | None) -> List[str]:
        return [name.format(layer=layer) for name in self.hf_names]


def tensor_mappings(spec: ModelSpec) -> List[TensorMapping]:
    layer = "model.layers.{layer}."
    mappings = [
        TensorMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
        TensorMapping(
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight", (layer + "input_layernorm.weight",), "copy"
        ),
        TensorMapping(
            "decoder.layers.self_attention.linear_qkv.weight",
            (layer + "self_attn.q_proj.weight", layer + "self_attn.k_proj.weight", layer + "self_attn.v_proj.weight"),
            "qkv",
        ),
        TensorMapping("decoder.layers.self_attention.linear_proj.weight", (layer + "self_attn.o_proj.weight",), "copy"),
        TensorMapping(
            "decoder.layers.mlp.linear_fc1.layer_norm_weight", (layer + "post_attention_layernorm.weight",), "copy"
        ),
        TensorMapping(
            "decoder.layers.mlp.linear_fc1.weight",
            (layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight"),
            "gate_up",
        ),
        TensorMapping("decoder.layers.mlp.linear_fc2.weight", (layer + "mlp.down_proj.weight",), "copy"),
        TensorMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "copy"),
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
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q_rows, h),
                p + "self_attn.k_proj.weight": (kv_rows, h),
                p + "self_attn.v_proj.weight": (kv_rows, h),
                p + "self_attn.o_proj.weight": (h, q_rows),
                p + "post_attention_layernorm.weight": (h,),
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
    g, d, h = spec.num_kv_heads, spec.head_dim, q.shape[-1]
    grouped = torch.cat([q.reshape(g, spec.q_per_kv, d, h), k.reshape(g, 1, d, h), v.reshape(g, 1, d, h)], dim=1)
    return grouped.reshape(spec.qkv_rows, h)


def split_qkv(qkv: torch.Tensor, spec: ModelSpec):
    """Inverse of fuse_qkv."""
    g, d, h = spec.num_kv_heads, spec.head_dim, qkv.shape[-1]
    grouped = qkv.reshape(g, spec.q_per_kv + 2, d, h)
    q = grouped[:, : spec.q_per_kv].reshape(spec.num_attention_heads * d, h)
    k = grouped[:, spec.q_per_kv].reshape(g * d, h)
    v = grouped[:, spec.q_per_kv + 1].reshape(g * d, h)
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
) -> torch.Tensor:
    """The Megatron global tensor for one mapping (one layer of it, if per-layer).

    ``global_rows`` is the padded vocabulary size for vocab tensors.
    """
    tensors = [read_hf(name) for name in mapping.hf_names_for(layer)]
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
    """HF tensors (name -> tensor) from one Megatron global tensor (one layer of it)."""
    names = mapping.hf_names_for(layer)
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
