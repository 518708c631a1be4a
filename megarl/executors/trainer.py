"""The trainer executor: Megatron-Core GPTModel + DDP + distributed optimizer, the AIPO hook.

step(samples) runs one optimizer step (PolicyTrainer) after checking that no
trained token is older than the lag bound (``rollout.max_lag`` in async mode, 0
in sync). How the new policy reaches the generators is the weight
synchronizer's business (weight_sync/factory.py); it reads ``chunks`` and
``norm_names`` from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence

import torch

from megarl.config import moe_training_overrides
from megarl.errors import MegarlError
from megarl.generator.tokenizer import NO_TOKENIZER
from megarl.models.megatron_model import build_model_chunks, transformer_config, transformer_engine_usable
from megarl.models.spec import ModelSpec
from megarl.rollout import Sample
from megarl.runtime.distributed import init_megatron
from megarl.trainer.bound_loss import bind_loss
from megarl.trainer.features import gradient_accumulation_fusion


class StaleSampleError(MegarlError):
    """A sample older than max_lag reached the trainer: the generator's admission control failed."""


def check_lag(samples: Sequence[Sample], version: int, lag_bound: int) -> List[int]:
    """Per-token lags (trainer version - token version) of the trained tokens; fail loudly beyond
    ``lag_bound``. A masked token's version is a placeholder (rollout.MASKED_VERSION): never read."""
    lags: List[int] = []
    for i, s in enumerate(samples):
        versions = s.trained(s.policy_versions)
        if not versions:  # every token masked: nothing of it is trained
            continue
        oldest = min(versions)
        if version - oldest > lag_bound:
            raise StaleSampleError(
                f"sample {i} (group {s.group_id}) has a token of policy version {oldest}; "
                f"the trainer is at {version} and trains on lags up to {lag_bound} (rollout.max_lag in async mode)"
            )
        if any(b < a for a, b in zip(versions, versions[1:])):
            raise StaleSampleError(f"sample {i} (group {s.group_id}): policy versions decrease along the sequence")
        lags += [version - v for v in versions]
    return lags


def megatron_model_settings(t) -> dict:
    """The trainer section's TransformerConfig settings, by Megatron-Core's own names."""
    settings = dict(
        sequence_parallel=t.sequence_parallel,
        context_parallel_size=t.cp,
        recompute_granularity=t.recompute_granularity,
        recompute_method=t.recompute_method,
        recompute_num_layers=t.recompute_num_layers,
    )
    if t.recompute_modules is not None:
        settings["recompute_modules"] = list(t.recompute_modules)
    settings.update(moe_training_overrides(t))
    return settings


def mixed_version_fraction(samples: Sequence[Sample]) -> float:
    """The fraction of samples whose trained tokens come from more than one policy version: a weight
    update landed inside them (in-flight updates); 0 with generator.inflight_updates=false."""
    versions = [set(s.trained(s.policy_versions)) for s in samples]
    versions = [v for v in versions if v]
    return sum(len(v) > 1 for v in versions) / len(versions) if versions else 0.0


class TrainerExecutor:
    def __init__(self, cfg, prepared, resume_dir: Optional[Path], lag_bound: int, on_gpu: bool):
        """``lag_bound``: the largest lag (trainer version - token version) trained on: a token beyond it
        is refused (check_lag), and the mismatch metrics are bucketed 0..lag_bound (rollout.max_lag; 0
        where generation and training alternate); ``on_gpu``: this rank's device is a GPU."""
        # imported here: these import Megatron-Core (~1.0 s on top of torch), and every rank imports this
        # module (loop/schedule.py) while only trainer ranks build a TrainerExecutor
        from megarl.checkpointing.model_loading import load_megatron_model
        from megarl.checkpointing.training_checkpoint import load_training_state
        from megarl.trainer.policy_trainer import PolicyTrainer
        from megarl.trainer.setup import (
            OptimizerSettings,
            build_lr_scheduler,
            build_optimizer,
            fuse_torch_adam_on_cpu,
            unwrap,
            wrap_ddp,
        )

        t = cfg.trainer
        self.cfg, self.lag_bound = cfg, lag_bound
        loss = bind_loss(t, cfg.rollout, lag_bound)  # before the model loads: a bad loss fails at once
        # saved with every checkpoint, so `megarl eval` and exports find the tokenizer beside the weights
        self.tokenizer_files = (
            []
            if prepared.tokenizer == NO_TOKENIZER
            else sorted(p for p in Path(prepared.tokenizer).iterdir() if p.is_file())
        )
        dims = cfg.trainer_dims()
        init_megatron(dims, seed=cfg.run.seed)
        dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
        model_settings = megatron_model_settings(t)
        wgrad_fusion = gradient_accumulation_fusion(t.gradient_accumulation_fusion, on_gpu=on_gpu)
        # GPUs: Megatron's own switch; CPU: megarl's patch, turned on by wrap_ddp
        model_settings["gradient_accumulation_fusion"] = wgrad_fusion and on_gpu
        if prepared.checkpoint:
            self.spec, chunks = load_megatron_model(prepared.checkpoint, dims, params_dtype=dtype, **model_settings)
        else:  # random:<preset>: Megatron's own initialisation, seeded
            self.spec = ModelSpec.from_dict(prepared.spec)
            config = transformer_config(
                self.spec,
                dims.tp,
                dims.pp,
                dims.virtual_pipeline_model_parallel_size,
                params_dtype=dtype,
                perform_initialization=True,
                **model_settings,
            )
            chunks = build_model_chunks(self.spec, config)
        settings = OptimizerSettings.from_config(cfg.optimizer)
        self.ddp = wrap_ddp(chunks, settings, wgrad_fusion=wgrad_fusion)
        self.optimizer = build_optimizer(self.ddp, settings)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, settings, cfg.run.steps)
        self.version = 0
        self.loop_state: dict = {}
        if resume_dir is not None:
            self.loop_state = load_training_state(unwrap(self.ddp), self.optimizer, resume_dir)
            fuse_torch_adam_on_cpu(self.optimizer)  # the loaded param groups carry the saving run's setting
            self.version = int(self.loop_state.get("version", self.loop_state["iteration"]))
            if "opt_param_scheduler" in self.loop_state:  # Megatron-LM's key
                self.lr_scheduler.load_state_dict(self.loop_state["opt_param_scheduler"])
        ref = (
            load_megatron_model(prepared.checkpoint, dims, params_dtype=dtype, **model_settings)[1]
            if t.kl_coef
            else None
        )
        routing = None
        if self.spec.moe is not None:  # replayed, or with replay off the generator's routes only compared
            from megarl.trainer.router_replay import RoutingReplay

            routing = RoutingReplay(self.ddp, replay=t.moe_enable_routing_replay)
        self.trainer = PolicyTrainer(
            self.ddp,
            self.optimizer,
            self.spec.vocab_size,
            loss,
            t.max_tokens_per_microbatch,
            ref_chunks=ref,
            lr_scheduler=self.lr_scheduler,
            routing=routing,
        )
        # Transformer Engine's layer spec fuses the norms into the linears: other parameter names
        self.norm_names = "te" if transformer_engine_usable() else "local"

    @property
    def chunks(self):
        # imported here: Megatron-Core, trainer ranks only (__init__'s note; loaded by then, a lookup)
        from megarl.trainer.setup import unwrap

        return unwrap(self.ddp)

    # -- the step ------------------------------------------------------------------------------

    def step(self, samples: Sequence[Sample]) -> dict:
        lags = check_lag(samples, self.version, self.lag_bound)
        metrics = self.trainer.step(samples, version=self.version)
        # no trained token at all: the trainer skipped the step (its skip_reason says so)
        metrics.update(
            lag_mean=sum(lags) / max(len(lags), 1),
            lag_max=max(lags, default=0),
            trained_version=self.version,
            mixed_version_frac=mixed_version_fraction(samples),
        )
        if not metrics.get("skipped"):
            self.version += 1
        return metrics

    def save_checkpoint(self, root: Path, step: int, loop_state: dict) -> Path:
        # imported here: Megatron-Core, trainer ranks only (__init__'s note; loaded by then, a lookup)
        from megarl.checkpointing.training_checkpoint import save_training_state

        return save_training_state(
            self.chunks,
            self.optimizer,
            root,
            self.spec,
            step,
            keep_checkpoints=self.cfg.run.keep_checkpoints,
            loop_state=dict(loop_state, version=self.version, opt_param_scheduler=self.lr_scheduler.state_dict()),
            tokenizer_files=self.tokenizer_files,
        )
