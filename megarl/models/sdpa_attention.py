"""Megatron's local core attention, with its three products done by one fused SDPA call.

Where Transformer Engine is absent (CPU, and GPUs without TE), Megatron's local
layer spec uses ``DotProductAttention``: ``baddbmm`` into a [b, heads, s, s] score
tensor, a cast to fp32, ``masked_fill`` with the mask, softmax, a cast back, and
``bmm`` with the values -- five full-size passes over s x s per head forward and as
many backward, plus the GQA key/value copies; its memory grows with s^2 in fp32.
``torch.nn.functional.scaled_dot_product_attention`` computes the same product
with a fused kernel (PyTorch's flash attention for CPU: blockwise, fp32
accumulation, masks supported, forward and backward), as TE's fused attention does
on GPUs. ``megarl bench attention`` (2-core AMD EPYC, AVX-512, SmolLM2's 9/3 heads,
fwd+bwd of one layer, a packed row of ~100-token samples): with the two CPU changes
below, bf16 1.52x at a 256-position row (8.6 -> 5.7 ms), 6.86x at 1024 (142 -> 21 ms);
fp32 2.14x and 8.24x (one masked SDPA call before them: bf16 1.19x and 2.12x).

``SdpaDotProductAttention`` is Megatron's class (same constructor, state, checks),
with ``forward`` replaced where SDPA expresses the same math: no attention bias,
no softmax offset, no sliding window, no query-key layer scaling, no dropout
while training, no packed (thd) sequences. Any of those sends it to Megatron's own
forward. The mask is Megatron's (True = masked out); a causal mask type without
a mask is SDPA's ``is_causal``. Numerics: Megatron's path rounds the scores to the
model's dtype before its fp32 softmax; SDPA keeps them in fp32 -- the same product,
within the model dtype's rounding (tests/multiprocess/test_sdpa_attention.py compares both).

Two things make the CPU path cheaper than one masked SDPA call over the row:

- **Packed rows attend per sample.** megarl's packed rows carry a block-diagonal
  causal mask (trainer/packing.py); a mask makes the kernel visit all s x s blocks,
  where a causal call skips the upper half and samples attend only within
  themselves. When the mask is exactly block-diagonal causal over contiguous
  segments (checked, once per mask object: the 30 layers of a micro-batch share it),
  each segment gets its own ``is_causal`` call -- the same function, a sum of
  len^2 / 2 instead of s^2 blocks.
- **On CPU, attention is computed in fp32** for bf16/fp16 models: PyTorch's CPU
  flash kernel was no faster in bf16 than in fp32 on an AVX512-BF16 EPYC, and slower
  per short causal segment (8.9 vs 3.7 ms fwd+bwd for a 256 row of ~100-token
  segments); Megatron's own path takes its softmax in fp32 as well. Inputs are cast
  up, the output back to the model's dtype.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SdpaDotProductAttention(DotProductAttention):
    def __init__(self, *args, k_channels: Optional[int] = None, v_channels: Optional[int] = None, **kwargs):
        # Multi-latent attention (DeepSeek-V3) builds its core attention with query/key heads of
        # k_channels and value heads of v_channels, which only TE's attention takes in Megatron-Core
        # 0.16.1; SDPA takes them as they come, so only the output width changes. Megatron's own
        # local forward sizes everything by kv_channels: it is not used for such heads.
        super().__init__(*args, **kwargs)
        self.head_channels = (k_channels, v_channels)
        if v_channels is not None:
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels

    def _sdpa_applies(self, attention_bias, packed_seq_params) -> bool:
        return (
            attention_bias is None
            and packed_seq_params is None
            and self.softmax_offset is None
            and self.scale_mask_softmax.window_size is None
            and not self.config.apply_query_key_layer_scaling
            and not (self.training and self.attention_dropout.p > 0)
        )

    def forward(
        self,
        query,
        key,
        value,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if not self._sdpa_applies(attention_bias, packed_seq_params):
            if self.head_channels != (None, None):
                raise NotImplementedError(
                    f"multi-latent attention's core attention (heads {self.head_channels}) runs through SDPA "
                    f"only: no attention bias, packed (thd) sequences, softmax offset, window or dropout"
                )
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:  # [sk, b, ng, hn] -> [sk, b, np, hn], as Megatron's forward does
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        sq, b = query.shape[0], query.shape[1]
        model_dtype = query.dtype
        compute_dtype = torch.float32 if query.device.type == "cpu" else model_dtype
        # [s, b, n, hn] -> [b, n, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3).to(compute_dtype) for t in (query, key, value))
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        segments = causal_segments(attention_mask) if attention_mask is not None else None
        if segments is not None:
            context = torch.cat(
                [
                    F.scaled_dot_product_attention(
                        q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], is_causal=True, scale=self.softmax_scale
                    )
                    for a, e in segments
                ],
                dim=2,
            )
        elif attention_mask is not None:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=self.softmax_scale)
        else:
            causal = mask_type == AttnMaskType.causal and sq > 1
            context = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.softmax_scale)
        # [b, np, sq, hn] -> [sq, b, hp]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition).to(model_dtype)


_last_mask: list = [None, None]  # [mask, its segments]: one entry, as every layer of a micro-batch gets the same mask


def causal_segments(mask: torch.Tensor) -> Optional[List[Tuple[int, int]]]:
    """The (start, end) query ranges of a [1, 1, s, s] mask (True = masked) that is exactly causal within
    contiguous segments and masked across them (trainer/packing.py's rows); None for any other mask."""
    if _last_mask[0] is mask:
        return _last_mask[1]
    segments = None
    if mask.dim() == 4 and mask.shape[:2] == (1, 1) and mask.shape[2] == mask.shape[3] and mask.dtype == torch.bool:
        m = mask[0, 0]
        s = m.shape[0]
        first_visible = (~m).to(torch.uint8).argmax(dim=1)  # a row with nothing visible gives 0: caught below
        starts = (first_visible == torch.arange(s, device=m.device)).nonzero().flatten()
        segment_of = torch.zeros(s, dtype=torch.long, device=m.device)
        segment_of[starts] = 1
        segment_of = segment_of.cumsum(0)
        causal = torch.ones(s, s, dtype=torch.bool, device=m.device).tril()
        if torch.equal(m, ~((segment_of[:, None] == segment_of[None, :]) & causal)):
            bounds = starts.tolist() + [s]
            segments = list(zip(bounds[:-1], bounds[1:]))
    _last_mask[:] = [mask, segments]
    return segments
