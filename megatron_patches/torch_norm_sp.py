"""Megatron-Core's torch norms (the local layer spec's, without Transformer Engine or Apex) under
sequence parallelism.

Why this exists: ``WrappedTorchNorm`` asserts ``not config.sequence_parallel``, so the local spec
cannot train with sequence parallelism, and Megatron's MoELayer refuses to train at TP > 1 without
it: no TP x EP training on CPU. A norm is per token, so sharding the tokens over TP changes nothing
in its forward; its weight's gradient is then a partial sum on each TP rank, which Megatron's
finalize_model_grads all-reduces for every parameter marked ``sequence_parallel`` -- the attribute
TE's and Apex's norms set. Under sequence parallelism this builds the same torch norm and marks its
parameters so; without it, Megatron's code as written.

Installed by cpu_backend's apply (CPU processes only). The tests compare TP2 gradients with and
without sequence parallelism against a float reference (tests/multiprocess/test_rl_gradient.py,
test_moe_gradient.py): an unmarked weight (no all-reduce) would be half its gradient.

When it can be deleted: when WrappedTorchNorm supports sequence_parallel itself.
Written for megatron-core 0.16.1 (cpu_backend warns on any other version).
"""

from __future__ import annotations

import copy

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    from megatron.core.transformer import torch_norm

    own_new = torch_norm.WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return own_new(cls, config, hidden_size, *args, **kwargs)
        # dataclasses.replace would rerun TransformerConfig's __post_init__ checks; a shallow
        # copy with the one field changed keeps everything else as validated
        plain = copy.copy(config)
        object.__setattr__(plain, "sequence_parallel", False)
        norm = own_new(cls, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True  # finalize_model_grads sums it over TP
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(__new__)
    _applied = True
