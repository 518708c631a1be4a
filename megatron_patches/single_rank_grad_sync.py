"""On CPU, DDP's gradient reduce-scatter and parameter all-gather over a one-rank group are skipped.

Why this exists: with one data-parallel rank, Megatron's DDP still issues its reduce-scatter of the
whole grad buffer into itself (and the all-gather of the param buffer after the optimizer step). Over
NCCL that is a cheap device copy; gloo's coalesced reduce-scatter *clones* the buffer first: for
SmolLM2 in fp32 main grads that is a fresh 538 MB tensor every optimizer step, page-faulted in and
copied -- 1.2 s of a ~8 s bf16 train step in a profile of ``megarl bench train-step``. Over one rank
both collectives are the identity, so they are skipped; what start_grad_sync does besides the
collective (the first-batch guard, the NaN/large-grad checks, the gradient scaling) runs as written,
and a finished handle stands in where an overlapped collective would leave one to wait on.

Installed by cpu_backend (CPU processes only); groups of more than one rank, and several
distributed-optimizer instances, take Megatron's own code unchanged.

When it can be deleted: when Megatron-Core skips collectives over single-rank groups, or gloo's
reduce-scatter stops copying its input.
"""

from __future__ import annotations

_applied = False
megatron_methods: dict = {}  # Megatron's own start_grad_sync / start_param_sync, once replaced (tests compare)


class _Finished:
    """What a completed collective's handle does: nothing left to wait for."""

    def wait(self):
        return None


def _single_rank(bucket_group, use_distributed_optimizer: bool) -> bool:
    ddp_config = bucket_group.ddp_config
    if ddp_config.num_distributed_optimizer_instances > 1:
        return False
    group = (
        bucket_group.intra_distributed_optimizer_instance_group
        if use_distributed_optimizer
        else bucket_group.data_parallel_group
    )
    return group.size() == 1


def apply() -> None:
    global _applied
    if _applied:
        return
    # a private class: imported when the patch applies, after cpu_backend (which imports this module
    # at its top) has checked Megatron-Core's version
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as BucketGroup

    original_grad_sync, original_param_sync = BucketGroup.start_grad_sync, BucketGroup.start_param_sync
    megatron_methods.update(start_grad_sync=original_grad_sync, start_param_sync=original_param_sync)

    def start_grad_sync(self, force_all_reduce=False):
        if not _single_rank(self, self.ddp_config.use_distributed_optimizer):
            return original_grad_sync(self, force_all_reduce=force_all_reduce)
        # megatron/core/distributed/param_and_grad_buffer.py start_grad_sync, less the collective
        if self.is_first_batch and self.grad_reduce_handle is not None:
            return
        assert self.grad_reduce_handle is None, "Should not have multiple communication calls outstanding at once"
        if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
            self.check_grads(
                check_for_nan_or_inf=self.ddp_config.check_for_nan_in_grad,
                check_for_large=self.ddp_config.check_for_large_grads,
            )
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
        # an overlapped reduce leaves a handle that finish_grad_sync waits on; a synchronous one leaves None
        self.grad_reduce_handle = _Finished() if self.ddp_config.overlap_grad_reduce else None

    def start_param_sync(self, force_sync=False):
        if not _single_rank(self, True):
            return original_param_sync(self, force_sync=force_sync)
        if force_sync:
            if self.param_gather_handle is not None:
                self.param_gather_handle = None
                return
        else:
            assert self.param_gather_handle is None
        self.param_gather_handle = _Finished() if self.ddp_config.overlap_param_gather and not force_sync else None
        self.param_gather_dispatched = True

    BucketGroup.start_grad_sync, BucketGroup.start_param_sync = start_grad_sync, start_param_sync
    _applied = True
