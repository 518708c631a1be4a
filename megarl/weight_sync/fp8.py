"""Block fp8 as SGLang's block-quantised Llama loads it.

A weight W [R, C] becomes ``weight`` float8_e4m3fn [R, C] and
``weight_scale_inv`` float32 [ceil(R/128), ceil(C/128)], one scale per 128x128
block: scale_inv = max(amax(|W_block|), 1e-4) / 448 and W ~= weight * scale_inv
(quantization_config = {quant_method: fp8, weight_block_size: [128, 128]}).
Partial blocks at the edges are quantised over the elements they have.

Only the linear layers are fp8 (qkv_proj, o_proj, gate_up_proj, down_proj);
norms, embeddings and lm_head stay bf16, as in SGLang's block-fp8 checkpoints.
"""

from __future__ import annotations

from typing import Tuple

import torch

BLOCK = 128
FP8_MAX = 448.0
MIN_AMAX = 1e-4
FP8_DTYPE = torch.float8_e4m3fn
FP8_LINEARS = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")
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


def scale_shape(shape: Tuple[int, int]) -> Tuple[int, int]:
    return (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))


def quantize(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> (float8_e4m3fn [R, C], float32 scale_inv [ceil(R/128), ceil(C/128)])."""
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
    rows, cols = q.shape
    expanded = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return q.float() * expanded
