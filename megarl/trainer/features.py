"""Trainer settings that depend on the machine: refused before any rank starts where they cannot run.

A config is checked for consistency wherever it is loaded (megarl/config.py),
including by `megarl plan` on a laptop planning a 405B job. Whether *this*
machine can run it is a separate question, asked by `megarl train` (every
launcher, before it starts or joins ranks): context parallelism runs through
Transformer Engine's attention on GPUs, and sequence parallelism through TE's
layers on GPUs (on CPU through megarl's patched torch norms), so where they
cannot run they are refused here with the reason, never silently dropped.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

from megarl.errors import ConfigError


def _cuda_available() -> bool:
    # imported here: `megarl train`'s launcher calls check_trainer_runs_here and otherwise never
    # imports torch (runtime/launch.py); only the settings below that need a GPU ask
    import torch

    return torch.cuda.is_available()


def transformer_engine_available() -> bool:
    return _cuda_available() and importlib.util.find_spec("transformer_engine") is not None


def check_trainer_runs_here(cfg) -> None:
    t = cfg.trainer
    if t.sequence_parallel and _cuda_available() and not transformer_engine_available():
        # on CPU megarl's patch runs Megatron's torch norms under sequence parallelism
        # (megatron_patches/torch_norm_sp.py); on GPUs that is TE's layer spec
        raise ConfigError(
            "trainer.sequence_parallel: needs Transformer Engine on GPUs (its layer spec carries the "
            "sequence-parallel norms); this machine has no transformer_engine package: install it "
            "(docs/install.md) or set trainer.sequence_parallel=false"
        )
    if t.cp > 1:
        if not transformer_engine_available():
            raise ConfigError(
                f"trainer.cp={t.cp}: context parallelism runs in Transformer Engine's attention on GPUs; "
                "this machine has none: set trainer.cp=1 here"
            )
        # Megatron splits each sequence into 2 x cp load-balanced chunks in the data loader, and
        # the loss must gather its per-token terms over the CP group; megarl's packing and loss
        # hook do neither yet, so a run would be wrong, not slow.
        raise ConfigError(
            f"trainer.cp={t.cp}: megarl's packed micro-batches are not yet split over context-parallel "
            "ranks; `megarl plan` models cp, `megarl train` needs trainer.cp=1"
        )
    if t.moe_grouped_gemm and not transformer_engine_available():
        raise ConfigError(
            "trainer.moe_grouped_gemm: runs the local experts through Transformer Engine's grouped GEMM "
            "on GPUs; this machine has none: set trainer.moe_grouped_gemm=false here (SequentialMLP)"
        )
    if t.gradient_accumulation_fusion:
        gradient_accumulation_fusion(True, on_gpu=_cuda_available())  # refused on a GPU without Apex
    o = cfg.optimizer
    if (o.overlap_grad_reduce or o.overlap_param_gather) and not _cuda_available():
        name = "overlap_grad_reduce" if o.overlap_grad_reduce else "overlap_param_gather"
        raise ConfigError(
            f"optimizer.{name}: overlaps NCCL collectives with compute on GPUs; on CPU (gloo) "
            f"there is nothing to overlap with: set it false here"
        )


def gradient_accumulation_fusion(setting: Optional[bool], on_gpu: bool) -> bool:
    """``trainer.gradient_accumulation_fusion`` resolved on this rank: whether weight gradients accumulate
    straight into DDP's main_grad. On GPUs Megatron's fused path (local and TE linears alike: the output
    layer is always a local one) needs Apex's fused_weight_gradient_mlp_cuda; Megatron-LM turns it on
    by default and fails without Apex, megarl turns it on where Apex is built. On CPU megarl's patch does
    the same accumulation (megatron_patches/cpu_wgrad_accumulation.py)."""
    if setting is False:
        return False
    if not on_gpu:
        return True
    available = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    if setting and not available:
        raise ConfigError(
            "trainer.gradient_accumulation_fusion: true needs Apex's fused_weight_gradient_mlp_cuda "
            "extension, which does not import here (build Apex from source, docs/install.md, GPU clusters); "
            "set it to false, or leave it unset to use it where it is built"
        )
    return available


def check_model_trains(spec, cfg) -> None:
    """What `megarl train` checks once the model's config is known: expert settings need a model
    with experts, and the parts of a family that the generators cannot serve yet are refused by
    the field that asks for them, never dropped."""
    t, g = cfg.trainer, cfg.generator
    if spec.moe is None:
        from megarl.config import moe_training_overrides

        expert_fields = {"trainer.ep": (t.ep, 1), "trainer.etp": (t.etp, None), "generator.ep": (g.ep, 1)}
        set_fields = [f"{name}={value}" for name, (value, default) in expert_fields.items() if value != default]
        set_fields += [f"trainer.{k}={v}" for k, v in moe_training_overrides(t).items()]
        if t.moe_enable_routing_replay:
            set_fields.append("trainer.moe_enable_routing_replay=true")
        if set_fields:
            raise ConfigError(f"{set_fields[0]}: model_type {spec.model_type!r} has no experts; leave it unset")
        return
    if t.tp > 1 and not t.sequence_parallel:
        # MoELayer.forward raises this in the first training step; asked here before any rank starts
        raise ConfigError(
            f"trainer.sequence_parallel: Megatron's MoE layers train at trainer.tp={t.tp} only with "
            "sequence parallelism; set trainer.sequence_parallel=true"
        )
    if t.moe_enable_routing_replay and t.cp > 1:
        raise ConfigError(
            f"trainer.moe_enable_routing_replay: routes are not laid out for context parallelism "
            f"(trainer.cp={t.cp}) yet"
        )
    if g.fp8:
        from megarl.weight_sync.fp8 import check_fp8_experts

        if cfg.layout().colocated:
            # colocated.py quantises an fp8 engine weight right after the one Megatron parameter that
            # writes it; a stacked w13 / w2 is written by every expert's fc1 / fc2
            raise ConfigError(
                "generator.fp8: sync (colocated) mode does not block-quantise stacked experts yet; "
                "run a model with experts in fp8 with run.mode=async, or set generator.fp8=false"
            )
        check_fp8_experts(spec, g.tp, g.ep)
