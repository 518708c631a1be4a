"""On CPU, weight gradients accumulate straight into Megatron's main_grad buffers, as on GPUs.

Why this exists: Megatron-LM on GPUs trains with gradient_accumulation_fusion: a linear layer's
weight-gradient GEMM adds into ``param.main_grad`` (Apex's fused_weight_gradient_mlp_cuda, or
Transformer Engine's fuse_wgrad_accumulation) and autograd carries only a placeholder. That extension
is CUDA-only, so on CPU every weight gradient was a tensor of its own that DDP's hook then added to the
fp32 main_grad. For a model whose vocabulary is a fifth of its parameters, as SmolLM2's (49152 x 576
of 135M), that meant per micro-batch: a zeroed dense [vocab, hidden] gradient for the embedding's few
hundred looked-up rows, a second one from the tied output layer, their sum, and an fp32 temporary of
the whole matrix for the mixed-dtype add -- ~0.3 s a micro-batch in a profile of a bf16 train step,
most of it page faults of fresh memory.

What ``enable(ddp_chunks)`` does, on CPU, to chunks DDP has wrapped (every param has its main_grad):

* Megatron's linear layers take their fusion path; this module's stand-in for
  fused_weight_gradient_mlp_cuda computes main_grad += grad_output^T @ input: the product in the
  layer's dtype, added to main_grad in blocks (never a full-size temporary);
* the word embedding's backward index-adds the looked-up rows' gradients into main_grad: no dense
  embedding gradient exists. A placeholder goes to autograd, as from a fused linear (DDP's hook runs
  on it and, seeing grad_added_to_main_grad, adds nothing), or nothing where the tied output layer
  already sent one in this backward (two placeholders would be summed, touching 2 x 56 MB). The tied
  weight's ``zero_out_wgrad`` -- Megatron's guard for a dense embedding gradient meeting the output
  layer's placeholder -- is then not needed, and cleared: the placeholder stays unwritten.

Math: the product is rounded to the layer's dtype before it is added, as without the fusion (cuBLAS's
fused GEMM on GPUs adds it unrounded; torch's CPU matmul has no bf16 x bf16 -> fp32 output).
Embedding rows are added in main_grad's dtype, where Megatron without the fusion first summed repeated
tokens' rows and the tied output layer's gradient in the model's dtype: bf16 runs differ at bf16
rounding (the fused sum is the more exact one), fp32 runs in summation order only.

When it can be deleted: when Megatron-Core accumulates weight gradients into main_grad on CPU itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_patches import cpu_backend

# Megatron-Core is imported when the patch applies: on CPU only, where cpu_backend has checked its
# version (enable() returns at once elsewhere); trainer/setup.py imports this module at its top.

# Mixed-dtype add_ converts its operand into a temporary first; in blocks of 1M elements (4 MB fp32)
# malloc reuses the block, where a full-size temporary (113 MB for SmolLM2's vocab) is mapped and
# page-faulted in afresh every time.
_BLOCK_ELEMENTS = 1 << 20
_WGRAD_ADDED = "_megarl_wgrad_added"  # set on a main_grad when a fused linear added into it
_EMBEDS_INTO_MAIN_GRAD = "_megarl_embedding_into_main_grad"
_installed = False


def add_into(main_grad: torch.Tensor, grad: torch.Tensor) -> None:
    """main_grad += grad, converting ``grad`` to main_grad's dtype a block at a time."""
    if grad.dtype == main_grad.dtype:
        main_grad.add_(grad)
        return
    flat_main, flat_grad = main_grad.view(-1), grad.reshape(-1)
    for start in range(0, flat_main.numel(), _BLOCK_ELEMENTS):
        flat_main[start : start + _BLOCK_ELEMENTS].add_(flat_grad[start : start + _BLOCK_ELEMENTS])


class CpuWgradAccumulation:
    """The two functions megatron/core/tensor_parallel/layers.py calls on fused_weight_gradient_mlp_cuda."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor):
        add_into(main_grad, grad_output.t().matmul(total_input))
        setattr(main_grad, _WGRAD_ADDED, True)

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


class EmbeddingIntoMainGrad(torch.autograd.Function):
    """F.embedding whose weight gradient is added into ``weight.main_grad`` row by row."""

    @staticmethod
    def forward(ctx, indices, weight):
        ctx.save_for_backward(indices)
        ctx.weight = weight  # its values are not needed, only its main_grad (as Megatron's linears keep it)
        setattr(weight.main_grad, _WGRAD_ADDED, False)
        return F.embedding(indices, weight)

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        weight = ctx.weight
        main_grad = weight.main_grad
        rows = grad_output.reshape(-1, grad_output.shape[-1]).to(main_grad.dtype)
        main_grad.index_add_(0, indices.reshape(-1), rows)
        # the tied output layer's placeholder, if any, was sent in this backward before this one
        # (the output layer comes last in the forward); then this leaf gets it, and one is enough
        placeholder_sent = getattr(main_grad, _WGRAD_ADDED, False)
        weight.grad_added_to_main_grad = True
        if placeholder_sent:
            return None, None
        return None, torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)


class _FunctionalForMegatronLayers:
    """torch.nn.functional, with ``embedding`` routed through EmbeddingIntoMainGrad for enabled weights."""

    def __getattr__(self, name):
        return getattr(F, name)

    @staticmethod
    def embedding(input, weight, *args, **kwargs):
        if (
            not args
            and not kwargs
            and getattr(weight, _EMBEDS_INTO_MAIN_GRAD, False)
            and torch.is_grad_enabled()
            and weight.requires_grad
        ):
            return EmbeddingIntoMainGrad.apply(input, weight)
        return F.embedding(input, weight, *args, **kwargs)


def _install() -> None:
    global _installed
    if _installed:
        return
    from megatron.core.tensor_parallel import layers

    layers.fused_weight_gradient_mlp_cuda = CpuWgradAccumulation
    layers._grad_accum_fusion_available = True
    layers.F = _FunctionalForMegatronLayers()  # VocabParallelEmbedding.forward calls F.embedding
    _installed = True


def enable(ddp_chunks) -> bool:
    """Turn the fusion on for these DDP-wrapped chunks, on CPU; returns False (nothing changed) elsewhere."""
    if not cpu_backend.is_active():
        return False
    _install()
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    for chunk in ddp_chunks:
        for module in chunk.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                weight = module.weight
                # the tied output layer has no weight of its own: it gets the embedding's, which DDP covers
                if weight is None or hasattr(weight, "main_grad"):
                    module.gradient_accumulation_fusion = True
            elif isinstance(module, VocabParallelEmbedding) and hasattr(module.weight, "main_grad"):
                if not module.deterministic_mode:  # which indexes the weight instead of calling F.embedding
                    setattr(module.weight, _EMBEDS_INTO_MAIN_GRAD, True)
                    module.weight.zero_out_wgrad = False
    return True
