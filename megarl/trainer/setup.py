"""Wrap Megatron model chunks for training: DDP, optimizer and schedule hooks.

Everything here is Megatron-Core's own: DistributedDataParallel over a
contiguous gradient buffer, get_megatron_optimizer (the distributed optimizer
when configured), finalize_model_grads for the DP / embedding all-reduces and
per-token loss scaling. This module only wires them together the way
Megatron-LM's training loop does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

import megatron_patches
from megatron_patches import cpu_wgrad_accumulation
from megatron_patches.optimizer_state import inner_torch_optimizers


@dataclass(frozen=True)
class OptimizerSettings:
    """What megarl.config.OptimizerConfig holds (Megatron-LM's names); tests build it directly."""

    optimizer: str = "adam"  # adam | sgd
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_decay_style: str = "constant"  # constant | linear | cosine
    lr_warmup_iters: int = 0
    lr_warmup_init: float = 0.0
    lr_decay_iters: Optional[int] = None  # None: constant style, or the caller's step count
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False

    @classmethod
    def from_config(cls, section) -> "OptimizerSettings":
        return cls(**{f.name: getattr(section, f.name) for f in dataclasses.fields(cls)})


def wrap_ddp(
    chunks: List[torch.nn.Module], settings: OptimizerSettings = OptimizerSettings(), wgrad_fusion: bool = True
) -> list:
    """Megatron DDP over the chunks; ``wgrad_fusion`` (CPU: megarl's accumulation into main_grad;
    GPUs read TransformerConfig.gradient_accumulation_fusion instead, see trainer/features.py)."""
    for chunk in chunks:
        # Losses return (sum, token count) and Megatron divides the gradients by
        # the global token count, so how a batch is split over micro-batches and
        # DP ranks changes nothing. DDP reads this flag when it is built (it then
        # sums rather than averages over DP); models/megatron_model.py sets it when
        # the model is built, as MoE routers read it then.
        if not chunk.config.calculate_per_token_loss:
            raise ValueError(
                "wrap_ddp: the model's TransformerConfig has calculate_per_token_loss=False; megarl's losses "
                "need it from the start (build the model with megarl.models.megatron_model.transformer_config)"
            )

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        overlap_grad_reduce=settings.overlap_grad_reduce,
        overlap_param_gather=settings.overlap_param_gather,
    )
    # Megatron-LM disables bucketing for all but the first virtual chunk.
    ddp_chunks = [
        DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    # On CPU, weight gradients accumulate into main_grad as on GPUs (megatron_patches/cpu_wgrad_accumulation.py)
    if wgrad_fusion:
        cpu_wgrad_accumulation.enable(ddp_chunks)
    return ddp_chunks


def build_optimizer(ddp_chunks: list, settings: OptimizerSettings):
    model_config = ddp_chunks[0].config
    constant = settings.lr_decay_style == "constant"
    config = OptimizerConfig(
        optimizer=settings.optimizer,
        lr=settings.lr,
        min_lr=settings.lr if constant else settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        sgd_momentum=settings.sgd_momentum,
        clip_grad=settings.clip_grad,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        overlap_param_gather=settings.overlap_param_gather,
        bf16=model_config.bf16,
        fp16=model_config.fp16,
        params_dtype=model_config.params_dtype,
    )
    optimizer = get_megatron_optimizer(config, ddp_chunks)
    fuse_torch_adam_on_cpu(optimizer)
    configure_schedule(ddp_chunks, optimizer, settings)
    return optimizer


def fuse_torch_adam_on_cpu(optimizer) -> int:
    """Run the torch Adam(W) Megatron wraps on CPU (no Apex/TE there) as its fused kernel.

    Megatron builds torch.optim.AdamW with torch's defaults, which on CPU is the per-parameter
    loop: ~10 elementwise passes, each allocating a temporary of the parameter's size (0.3-1.4 s for
    SmolLM2's 135M fp32 main params here, vs 0.07-0.12 s fused; the same update, results equal to
    2.4e-7). Megatron itself passes fused=True to the torch Adam of its CPU-offload optimizer.
    Also called after a checkpoint load, whose param groups replace these. Returns the groups changed.
    """
    if not megatron_patches.is_active():
        return 0
    changed = 0
    for inner in inner_torch_optimizers(optimizer):
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            if not group.get("fused"):
                group.update(fused=True, foreach=False)
                changed += 1
    return changed


def build_lr_scheduler(optimizer, settings: OptimizerSettings, steps: int):
    """Megatron's OptimizerParamScheduler, in optimizer steps (Megatron-LM's --lr-*-iters).

    It sets every parameter group's lr when built (step 0) and at each ``step(1)``.
    On resume the config's schedule wins and the checkpoint supplies the step
    count (Megatron-LM's --override-opt_param-scheduler), so a run whose schedule
    was edited continues under the new one from where it stopped.
    """
    decay_iters = settings.lr_decay_iters if settings.lr_decay_iters is not None else steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=settings.lr_warmup_init,
        max_lr=settings.lr,
        min_lr=settings.lr if settings.lr_decay_style == "constant" else settings.min_lr,
        lr_warmup_steps=settings.lr_warmup_iters,
        lr_decay_steps=max(decay_iters, settings.lr_warmup_iters + 1),
        lr_decay_style=settings.lr_decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=max(decay_iters, 1),
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def configure_schedule(ddp_chunks: list, optimizer, settings: OptimizerSettings = OptimizerSettings()) -> None:
    """Set the TransformerConfig hooks Megatron's schedules call (as Megatron-LM's training.py does)."""
    for chunk in ddp_chunks:
        config = chunk.config
        config.grad_scale_func = optimizer.scale_loss
        config.finalize_model_grads_func = finalize_model_grads
        if settings.overlap_grad_reduce:
            # the DP reduce-scatter of each bucket starts while backward goes on
            config.no_sync_func = [c.no_sync for c in ddp_chunks] if len(ddp_chunks) > 1 else ddp_chunks[0].no_sync
            config.grad_sync_func = (
                [c.start_grad_sync for c in ddp_chunks] if len(ddp_chunks) > 1 else ddp_chunks[0].start_grad_sync
            )
        if settings.overlap_param_gather:
            config.param_sync_func = (
                [c.start_param_sync for c in ddp_chunks] if len(ddp_chunks) > 1 else ddp_chunks[0].start_param_sync
            )


def run_schedule(
    chunks: list,
    forward_step_func,
    micro_batches: list,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
    **kwargs,
):
    """Megatron's forward_backward_func over ``micro_batches`` (each model chunk reads its own iterator)."""
    iterators = [iter(micro_batches) for _ in chunks]
    single = len(chunks) == 1
    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=iterators[0] if single else iterators,
        model=chunks[0] if single else chunks,
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        **kwargs,
    )


def zero_grads(ddp_chunks: list, optimizer) -> None:
    for chunk in ddp_chunks:
        chunk.train()
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


def train_step(
    ddp_chunks: list, optimizer, forward_step_func, micro_batches: list, seq_length: int, micro_batch_size: int
) -> dict:
    """One optimizer step through Megatron's schedule. Returns losses, grad norm, success."""
    zero_grads(ddp_chunks, optimizer)
    losses = run_schedule(
        ddp_chunks, forward_step_func, micro_batches, seq_length, micro_batch_size, forward_only=False
    )
    success, grad_norm, _ = optimizer.step()
    return {"losses": losses, "grad_norm": grad_norm, "success": success}


def unwrap(ddp_chunks: list) -> List[torch.nn.Module]:
    return [chunk.module for chunk in ddp_chunks]
