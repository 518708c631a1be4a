"""Mark tensor-parallel weights that Megatron-Core built without initialising.

Why this exists: megatron-core 0.16.1 sets a weight's ``tensor_model_parallel``
attributes only inside its weight initialisers (_initialize_affine_weight_cpu /
_gpu). A model built with ``perform_initialization=False`` -- the right choice
when the weights come from a checkpoint, since initialising a 405B model only
to overwrite it costs minutes -- has TP-sharded weights that look like
TP-duplicates. clip_grads then counts them on TP rank 0 only and under-reports
the gradient norm (measured on a tiny Llama: 1.76 at TP2 vs 2.19 at TP1), so
gradient clipping scales TP runs differently from TP1 runs.

What it does: sets the attributes with Megatron's own
set_tensor_model_parallel_attributes on the weights of Megatron's local
tensor-parallel layers that lack them. Never changes a weight's values. TE
layers set their attributes themselves and are left alone.

When it can be deleted: when Megatron-Core sets the attributes at parameter
creation regardless of perform_initialization.
"""

from __future__ import annotations

import torch


def mark_tensor_parallel_weights(model: torch.nn.Module) -> int:
    """Set missing TP attributes on ``model``'s parallel weights; return how many were set."""
    # Megatron-Core here, not at the top: models/megatron_model.py imports this module at its top and
    # stays without Megatron-Core until it builds a model (see the comment there)
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    marked = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            partition_dim = 0
        elif isinstance(module, RowParallelLinear):
            partition_dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, True, partition_dim, 1)
            marked += 1
    return marked
