"""MlaSpec: multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), as read from its Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class MlaSpec:
    """The low-rank projections of Megatron-Core's MLASelfAttention (its MLATransformerConfig's
    names in comments). Queries and keys are [nope | rope] per head; values have their own width."""

    q_lora_rank: Optional[int]  # q_lora_rank (None: one q_proj, as DeepSeek-V2-Lite)
    kv_lora_rank: int  # kv_lora_rank
    qk_nope_head_dim: int  # qk_head_dim
    qk_rope_head_dim: int  # qk_pos_emb_head_dim
    v_head_dim: int  # v_head_dim

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def parameters(self, hidden: int, heads: int) -> int:
        """Weights of one layer's attention (norms included, the input norm not)."""
        if self.q_lora_rank is None:
            q = hidden * heads * self.q_head_dim
        else:
            q = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.q_head_dim
        kv_down = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv_up = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_down + kv_up + heads * self.v_head_dim * hidden
