"""Megatron-Core's MoE layers on CPU + gloo, without Transformer Engine: two fixes, each a name.

Why this exists (both found by running Megatron's MoELayer at expert parallelism 2 on CPU):

* ``te_general_gemm``: moe_utils imports it inside ``try: import transformer_engine`` and never
  defines it otherwise, yet ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None``
  in every router forward and backward: without TE every MoE forward raises NameError (on any
  device). Defining it as None sends the router to the torch.mm / addmm branch written for that
  case; nothing else reads the name.
* Split sizes of the alltoall dispatcher: ``maybe_move_tensor_to_cpu(t, as_numpy=True)`` turns a
  *CUDA* tensor into a numpy array and returns a CPU tensor unchanged, so on CPU the dispatcher
  hands ``all_to_all_single`` tensors as split sizes, which it refuses (it takes int sequences).
  On CPU the function here returns the numpy array the GPU path returns; everything else as
  written.

Installed by cpu_backend's apply (CPU processes only; ``te_general_gemm`` is defined only where
moe_utils lacks it). The first fix alone (``define_te_general_gemm``) is also installed on GPUs
without TE, by megarl.models.megatron_model.build_model_chunks for MoE models: the first GPU check
(``scripts/gpu_check.sh --preset qwen3-moe-mini`` on an H200 without TE) raised that NameError.
``megatron_functions`` keeps Megatron's own function for the tests, which compare the patched path with Megatron's: the allgather dispatcher (no split sizes) gives the same
outputs and gradients as the alltoall one, and the router's logits equal torch's.

When it can be deleted: when moe_utils defines ``te_general_gemm = None`` without TE, and its
``maybe_move_tensor_to_cpu`` converts CPU tensors too (or all_to_all_single accepts tensors).
Written for megatron-core 0.16.1 (cpu_backend warns on any other version).
"""

from __future__ import annotations

_applied = False
megatron_functions: dict = {}  # Megatron's own maybe_move_tensor_to_cpu, once replaced (tests compare)


def define_te_general_gemm() -> None:
    """The router's torch.mm branch where Transformer Engine is missing (any device)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply() -> None:
    global _applied
    if _applied:
        return
    import torch
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    define_te_general_gemm()
    own = moe_utils.maybe_move_tensor_to_cpu
    megatron_functions["maybe_move_tensor_to_cpu"] = own

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()  # what the GPU path returns: all_to_all_single takes no tensor splits
        return own(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu  # bound there by name
    _applied = True
