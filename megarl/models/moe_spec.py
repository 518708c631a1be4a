"""MoeSpec: the routed experts of a model, as read from its Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class MoeSpec:
    """Routed experts, as Megatron-Core's MoELayer builds them (names of its TransformerConfig
    in comments). The router, group and shared-expert fields are DeepSeek-V3's and GLM-4.5's
    (sigmoid router with expert bias, group-limited top-k, shared experts); Qwen3-MoE leaves
    them at their defaults."""

    num_experts: int  # num_moe_experts
    top_k: int  # moe_router_topk
    ffn_hidden_size: int  # moe_ffn_hidden_size (HF moe_intermediate_size)
    layers: Tuple[int, ...]  # global indices of the MoE layers; the others are dense MLPs
    norm_topk_prob: bool  # renormalise the top-k probabilities (moe_router_pre_softmax=False)
    router_score_function: str = "softmax"  # moe_router_score_function
    router_expert_bias: bool = False  # moe_router_enable_expert_bias
    shared_expert_ffn_hidden_size: int = 0  # moe_shared_expert_intermediate_size (0: none)
    num_groups: int = 0  # moe_router_num_groups (HF n_group; 0: no group limit)
    group_topk: int = 0  # moe_router_group_topk (HF topk_group)
    topk_scaling_factor: float = 1.0  # moe_router_topk_scaling_factor (HF routed_scaling_factor)

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.layers
