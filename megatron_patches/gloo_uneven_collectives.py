"""Megatron-Core's uneven all-gather along the first dimension, on gloo.

Why this exists: the alltoall token dispatcher at expert tensor parallelism > 1 (TP x EP training
runs the experts at ETP = TP by default) gathers each rank's routed tokens over the expert-TP group
with ``output_split_sizes`` -- one count per rank, which differ because routing does.
``mappings._gather_along_first_dim`` then calls the list form of ``torch.distributed.all_gather``
with tensors of different lengths, which gloo refuses ("invalid tensor size"; NCCL takes it). On CPU
the function here pads every rank's rows to the longest, all-gathers even tensors and slices the
padding off: the same rows in the same order. Without split sizes Megatron's own function runs.
The matching uneven reduce-scatter (the gather's backward, and the dispatcher's combine) works on
gloo as written and is left alone.

Installed by cpu_backend's apply (CPU processes only). ``megatron_functions`` keeps Megatron's own
function; tests/multiprocess/test_gloo_uneven_collectives.py checks the replacement and the
reduce-scatter against results computed without collectives (and that Megatron's own gather still
raises on gloo), and the TP2 x EP2 gradient test (tests/multiprocess/test_moe_gradient.py) needs it.

When it can be deleted: when gloo's all_gather accepts uneven tensors (the test above then fails on
its "Megatron's own raises" line), or Megatron pads itself. Written for megatron-core 0.16.1
(cpu_backend warns on any other version).
"""

from __future__ import annotations

_applied = False
megatron_functions: dict = {}  # Megatron's own function, once replaced (tests compare)


def gather_uneven(input_, group, output_split_sizes):
    """Rank r's ``input_`` (``output_split_sizes[r]`` rows) concatenated in rank order."""
    import torch
    import torch.distributed as dist

    widest = max(output_split_sizes)
    if widest == 0:  # no rank routed a token here: nothing to send
        return input_.new_empty((0, *input_.shape[1:]))
    padded = input_.new_zeros((widest, *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    parts = [torch.empty_like(padded) for _ in output_split_sizes]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:rows] for part, rows in zip(parts, output_split_sizes)])


def apply() -> None:
    global _applied
    if _applied:
        return
    from megatron.core.tensor_parallel import mappings

    own_gather = mappings._gather_along_first_dim
    megatron_functions["gather"] = own_gather

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return own_gather(input_, group, output_split_sizes, use_global_buffer)
        return gather_uneven(input_, group, [int(n) for n in output_split_sizes])

    # the autograd functions of mappings look the name up in the module when they run
    mappings._gather_along_first_dim = _gather_along_first_dim
    _applied = True
