"""The trainer executor: Megatron-Core GPTModel + DDP + distributed optimizer, the AIPO hook.

step(samples) runs one optimizer step (PolicyTrainer) after checking that no
trained token is older than the lag bound (``rollout.max_lag`` in async mode, 0
in sync) -- unless ``rollout.max_lag_policy`` says otherwise for the tokens
that still are (apply_lag_policy). How the new policy reaches the generators is the weight
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
from megarl.rollout import LENGTH_BUCKETS, Sample, length_bucket
from megarl.runtime.distributed import init_megatron
from megarl.trainer.bound_loss import bind_loss
from megarl.trainer.features import gradient_accumulation_fusion


class StaleSampleError(MegarlError):
    """A sample older than max_lag reached the trainer: the generator's admission control failed."""


# per step, by response length (rollout.LENGTH_BUCKETS): the batch's samples, those with a trained token
# older than the lag bound, and the tokens max_lag_policy=mask left out of the loss
TRAINER_LAG_KEYS = tuple(
    f"{name}_{b}" for name in ("trained_samples", "lag_stale_samples", "lag_masked_tokens") for b in LENGTH_BUCKETS
)


def apply_lag_policy(samples: Sequence[Sample], version: int, lag_bound: int, policy: str, max_new_tokens: int) -> dict:
    """What ``rollout.max_lag_policy`` does with trained tokens older than ``lag_bound`` that reach
    the trainer, and the counts of TRAINER_LAG_KEYS. mask: those tokens' loss_mask becomes 0, in
    place (their sample's reward still counts in its group's baseline; the tokens after them, of
    newer policies, are trained); keep: nothing changes (check_lag lets them through); wait, drop:
    the generator lets none through, and check_lag refuses any that does."""
    counts = dict.fromkeys(TRAINER_LAG_KEYS, 0)
    for s in samples:
        bucket = length_bucket(len(s.response_tokens), max_new_tokens)
        counts[f"trained_samples_{bucket}"] += 1
        stale = [i for i, (v, m) in enumerate(zip(s.policy_versions, s.loss_mask)) if m and version - v > lag_bound]
        if not stale:
            continue
        counts[f"lag_stale_samples_{bucket}"] += 1
        if policy == "mask":
            for i in stale:
                s.loss_mask[i] = 0
            counts[f"lag_masked_tokens_{bucket}"] += len(stale)
    return counts


def check_lag(samples: Sequence[Sample], version: int, lag_bound: int, refuse: bool = True) -> List[int]:
    """Per-token lags (trainer version - token version) of the trained tokens; fail loudly beyond
    ``lag_bound`` (unless not ``refuse``: rollout.max_lag_policy=keep). A masked token's version is
    a placeholder (rollout.MASKED_VERSION) or, masked for its age, past the bound: never read."""
    lags: List[int] = []
    for i, s in enumerate(samples):
        versions = s.trained(s.policy_versions)
        if not versions:  # every token masked: nothing of it is trained
            continue
        oldest = min(versions)
        if refuse and version - oldest > lag_bound:
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
        r = self.cfg.rollout  # sync mode refuses every max_lag_policy but the default (wait): nothing passes
        lag_counts = apply_lag_policy(samples, self.version, self.lag_bound, r.max_lag_policy, r.max_new_tokens)
        lags = check_lag(samples, self.version, self.lag_bound, refuse=r.max_lag_policy != "keep")
        metrics = self.trainer.step(samples, version=self.version)
        # no trained token at all: the trainer skipped the step (its skip_reason says so)
        metrics.update(
            lag_mean=sum(lags) / max(len(lags), 1),
            lag_max=max(lags, default=0),
            trained_version=self.version,
            mixed_version_frac=mixed_version_fraction(samples),
            **lag_counts,
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
