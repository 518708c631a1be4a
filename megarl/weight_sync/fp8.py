"""Block fp8 as SGLang's block-quantised Llama loads it.

A weight W [R, C] becomes ``weight`` float8_e4m3fn [R, C] and
``weight_scale_inv`` float32 [ceil(R/128), ceil(C/128)], one scale per 128x128
block: scale_inv = max(amax(|W_block|), 1e-4) / 448 and W ~= weight * scale_inv
(quantization_config = {quant_method: fp8, weight_block_size: [128, 128]}).
Partial blocks at the edges are quantised over the elements they have.

Only the linear layers are fp8 (qkv_proj, o_proj, gate_up_proj, down_proj, and
FusedMoE's stacked experts w13_weight / w2_weight); norms, embeddings, lm_head
and the router stay bf16, as in SGLang's block-fp8 checkpoints.

Stacked experts [E, R, C] are quantised expert by expert, scales [E, ceil(R/128),
ceil(C/128)] (SGLang's Fp8MoEMethod). Where R is whole blocks (SGLang requires
it of w13; megarl of w2, ``check_fp8_experts``) that is exactly the 2-D
quantisation of the [E x R, C] view the weight sync moves, scales viewed
[E x R/128, C/128]: no block straddles two experts.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from megarl.errors import ConfigError

BLOCK = 128
FP8_MAX = 448.0
MIN_AMAX = 1e-4
FP8_DTYPE = torch.float8_e4m3fn
FP8_LINEARS = (
    "qkv_proj.weight",
    "o_proj.weight",
    "gate_up_proj.weight",
    "down_proj.weight",
    "mlp.experts.w13_weight",
    "mlp.experts.w2_weight",
)
SCALE_SUFFIX = "_scale_inv"
# config.json's quantization_config of a block-fp8 checkpoint, as SGLang's Fp8Config reads it
BLOCK_FP8_QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}


def is_fp8_param(name: str) -> bool:
    return name.endswith(FP8_LINEARS)


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def scale_shape(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    """[R, C] -> [ceil(R/128), ceil(C/128)]; stacked experts [E, R, C] -> [E, ceil(R/128), ceil(C/128)]."""
    return (*shape[:-2], -(-shape[-2] // BLOCK), -(-shape[-1] // BLOCK))


def matrix_shape(shape: Tuple[int, ...]) -> Tuple[int, int]:
    """The [rows, cols] view the weight sync moves: stacked experts [E, R, C] as [E x R, C]."""
    return (math.prod(shape[:-1]), shape[-1])


def quantize(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> (float8_e4m3fn [R, C], float32 scale_inv [ceil(R/128), ceil(C/128)]); stacked
    experts [E, R, C] expert by expert (scales [E, ceil(R/128), ceil(C/128)])."""
    if weight.dim() == 3:
        if weight.shape[1] % BLOCK == 0:  # no block straddles two experts: one 2-D quantisation
            q, scale_inv = quantize(weight.reshape(-1, weight.shape[-1]))
            return q.view(weight.shape), scale_inv.view(scale_shape(tuple(weight.shape)))
        pairs = [quantize(w) for w in weight]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
    rows, cols = weight.shape
    rb, cb = scale_shape((rows, cols))
    padded = torch.zeros(rb * BLOCK, cb * BLOCK, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(rb, BLOCK, cb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX)
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rb * BLOCK, cb * BLOCK)[:rows, :cols].contiguous(), scale_inv


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    if q.dim() == 3:
        return torch.stack([dequantize(w, s) for w, s in zip(q, scale_inv)])
    rows, cols = q.shape
    expanded = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return q.float() * expanded


def check_fp8_experts(spec, tp: int, ep: int = 1) -> None:
    """Block fp8 for a model's experts at SGLang --tp ``tp`` --ep-size ``ep``, asked before any rank
    starts: SGLang's Fp8MoEMethod raises at load unless each expert's intermediate shard is whole
    128-blocks; megarl moves w2 [E, h, I] as [E x h, I], so hidden_size must be whole blocks too."""
    if spec.moe is None:
        return
    shard = spec.moe.ffn_hidden_size // max(1, tp // ep)
    if shard % BLOCK:
        raise ConfigError(
            f"generator.fp8: each expert's intermediate shard is moe_intermediate_size "
            f"{spec.moe.ffn_hidden_size} / (tensor_parallel {tp} / ep {ep}) = {shard} rows, not a multiple "
            f"of {BLOCK}; SGLang's block-fp8 FusedMoE refuses it at load"
        )
    if spec.hidden_size % BLOCK:
        raise ConfigError(
            f"generator.fp8: hidden_size {spec.hidden_size} is not a multiple of {BLOCK}; megarl's weight "
            "sync quantises the experts' stacked w2 [experts x hidden, intermediate] in 128-row blocks"
        )
