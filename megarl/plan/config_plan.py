"""`megarl plan --config FILE`: the capacity planner driven by a run config.

The run config says what the job runs (trainer TP x PP x DP, generator TP x
replicas, precisions, the batch); its free-form ``plan:`` section says what the
planner needs about the cluster and the workload that a run does not::

    plan:
      model: llama3-405b        # preset shapes, so planning needs no checkpoint
      gpus: 1024                # the allocation (default: the GPUs the config uses)
      gpus_per_node: 8
      gpu_memory_gb: 80
      prompt_tokens: 512        # default data.max_prompt_tokens
      response_tokens_min: 512  # uniform [min, max]; default max: rollout.max_new_tokens
      response_tokens_max: 4096
      recompute: selective      # activation recomputation the trainer runs with

Three answers come back: the configured layout priced as it is (a fixed
layout), the split of the same GPUs with the same parallelism that balances
train and generate times best, and the best layout the search finds -- all
three restricted to what megarl runs (PP dividing the layers, every generator
replica an equal share of the prompts) -- next to the synchronous baseline.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Union

from megarl.errors import ConfigError
from megarl.plan.hardware import H100, Hardware
from megarl.plan.inputs import FixedLayout, GeneratorLayout, LengthDistribution, PlanInputs, TrainerLayout
from megarl.plan.llamarl_model import (AsyncLayout, PlanResult, RECOMPUTE, balanced_split, evaluate_layout,
                                       plan_from_inputs)


@dataclass(frozen=True)
class PlanSection:
    """The config's ``plan:`` section, typed. None: derived from the rest of the config."""

    model: Optional[str] = None  # preset name; default: model.source "random:<preset>"
    gpus: Optional[int] = None
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0
    prompt_tokens: Optional[int] = None
    response_dist: str = "uniform"  # uniform | exponential
    response_tokens_min: int = 512
    response_tokens_max: Optional[int] = None
    response_tokens_mean: Optional[float] = None  # exponential only
    micro_batch: Optional[int] = None  # default trainer.max_tokens_per_microbatch // longest sample
    recompute: str = "selective"
    max_lag_steps: float = 1.0
    max_pp: int = 16
    measured: Optional[Union[str, Dict[str, Any]]] = None  # see megarl/plan/measured.py
    weight_sync: str = "predict"  # predict | estimate | skip
    hardware: Dict[str, Any] = field(default_factory=dict)  # Hardware field -> value


_INTS = ("gpus", "gpus_per_node", "prompt_tokens", "response_tokens_min", "response_tokens_max", "micro_batch",
         "max_pp")
_FLOATS = ("gpu_memory_gb", "response_tokens_mean", "max_lag_steps")
_CHOICES = {"response_dist": ("uniform", "exponential"), "recompute": RECOMPUTE,
            "weight_sync": ("predict", "estimate", "skip")}


def plan_section(cfg) -> PlanSection:
    """Parse and check ``cfg.plan``; every error names the field (``plan.gpus: ...``)."""
    data = dict(cfg.plan or {})
    known = {f.name for f in dataclasses.fields(PlanSection)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"plan.{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")
    for name in _INTS:
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"plan.{name}: expected a positive integer, got {value!r}")
    for name in _FLOATS:
        value = data.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ConfigError(f"plan.{name}: expected a positive number, got {value!r}")
        if value is not None:
            data[name] = float(value)
    for name, options in _CHOICES.items():
        if name in data and data[name] not in options:
            raise ConfigError(f"plan.{name}: {data[name]!r} is not one of {list(options)}")
    if "model" in data and not isinstance(data["model"], str):
        raise ConfigError(f"plan.model: expected a preset name, got {data['model']!r}")
    if "measured" in data and not isinstance(data["measured"], (str, dict, type(None))):
        raise ConfigError(f"plan.measured: expected a JSON file path or a mapping, got {data['measured']!r}")
    if not isinstance(data.get("hardware", {}), dict):
        raise ConfigError(f"plan.hardware: expected a mapping of Hardware fields, got {data['hardware']!r}")
    section = PlanSection(**data)
    section_hardware(section)  # checks plan.hardware's fields now, not halfway through a plan
    return section


def section_hardware(section: PlanSection) -> Hardware:
    names = {f.name for f in dataclasses.fields(Hardware)}
    for key, value in section.hardware.items():
        if key not in names:
            raise ConfigError(f"plan.hardware.{key}: unknown field (known: {', '.join(sorted(names))})")
        if key != "name" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"plan.hardware.{key}: expected a number, got {value!r}")
    changes = {**section.hardware, "gpus_per_node": section.gpus_per_node, "memory_gb": section.gpu_memory_gb}
    try:
        return replace(H100, **changes)
    except ConfigError as err:
        raise ConfigError(f"plan.{err}") from None


def model_preset(cfg, section: Optional[PlanSection] = None) -> str:
    """The shapes to plan with: plan.model, or the preset of a ``random:<preset>`` model.source."""
    from megarl.models.presets import PRESETS

    section = section or plan_section(cfg)
    name = section.model
    if name is None and cfg.model.source.startswith("random:"):
        name = cfg.model.source.partition(":")[2]
    if name is None:
        raise ConfigError(f"plan.model: name the model's preset ({', '.join(sorted(PRESETS))}) so planning does "
                          f"not need the checkpoint at model.source={cfg.model.source!r}")
    if name not in PRESETS:
        raise ConfigError(f"plan.model: {name!r} is not a preset; choose one of {sorted(PRESETS)}")
    return name


def gpus_used(cfg) -> int:
    """GPUs the run occupies: trainer + generators (async, whichever backend), or the trainer's (sync)."""
    if cfg.run.mode == "sync":
        return cfg.trainer_size()
    return cfg.trainer_size() + cfg.generator_size()


def _precision(name: str, value: str, hint: str) -> str:
    if value != "bf16":
        raise ConfigError(f"{name}: {value!r}; the planner prices H100 runs in bf16 ({hint})")
    return value


def inputs_from_config(cfg, section: Optional[PlanSection] = None) -> PlanInputs:
    """PlanInputs of a run config: batch, precisions and lengths from the run, the rest from plan:."""
    section = section or plan_section(cfg)
    r = cfg.rollout
    trainer_precision = _precision("model.dtype", cfg.model.dtype, "set model.dtype: bf16")
    if cfg.generator.fp8:
        generator_precision = "fp8"
    else:
        generator_precision = _precision("generator.dtype", cfg.generator.dtype, "or set generator.fp8: true")
    longest = section.response_tokens_max or r.max_new_tokens
    if section.response_dist == "exponential":
        if section.response_tokens_mean is None:
            raise ConfigError("plan.response_tokens_mean: needed with plan.response_dist: exponential")
        lengths = LengthDistribution.truncated_exponential(section.response_tokens_mean, longest)
    else:
        lengths = LengthDistribution.uniform(min(section.response_tokens_min, longest), longest)
    return PlanInputs(
        model=model_preset(cfg, section), gpus=section.gpus or gpus_used(cfg),
        gpus_per_node=section.gpus_per_node, prompts=r.prompts_per_step, samples_per_prompt=r.samples_per_prompt,
        prompt_tokens=section.prompt_tokens or cfg.data.max_prompt_tokens, lengths=lengths,
        gpu_memory_gb=section.gpu_memory_gb, trainer_precision=trainer_precision,
        generator_precision=generator_precision, max_lag_steps=section.max_lag_steps, measured=section.measured,
        weight_sync=section.weight_sync, hardware=section_hardware(section), max_pp=section.max_pp,
        equal_prompt_shares=cfg.run.mode == "async", recompute=(section.recompute,),
    )


def configured_layout(cfg, inputs: PlanInputs, section: PlanSection) -> FixedLayout:
    """The config's own layout in the planner's terms. A micro-batch of the planner holds
    ``micro_batch`` longest samples; megarl packs up to trainer.max_tokens_per_microbatch tokens."""
    t, g = cfg.trainer, cfg.generator
    if cfg.run.mode != "async":
        raise ConfigError("run.mode: sync runs colocated; `megarl plan --config` prices asynchronous layouts")
    longest = inputs.prompt_tokens + inputs.lengths.max
    micro_batch = section.micro_batch or max(1, t.max_tokens_per_microbatch // longest)
    return FixedLayout(TrainerLayout(t.tp, t.pp, micro_batch, section.recompute), GeneratorLayout(g.tp),
                       trainer_gpus=cfg.trainer_size(), generator_batch=g.max_running)


@dataclass
class ConfigPlan:
    path: str
    inputs: PlanInputs  # on the allocation (plan.gpus)
    gpus_used: int
    configured: AsyncLayout  # the config's layout as it is
    balanced: Optional[AsyncLayout]  # the same parallelism, the best split of the same GPUs
    searched: PlanResult  # the best megarl-runnable layout on plan.gpus, and the sync baseline
    notes: List[str] = field(default_factory=list)

    def speedup(self, layout: Optional[AsyncLayout]) -> Optional[float]:
        s = self.searched.best_sync
        return None if layout is None or s is None else s.step_seconds / layout.step_seconds


def plan_config(cfg, path: str = "config") -> ConfigPlan:
    section = plan_section(cfg)
    inputs = inputs_from_config(cfg, section)
    used, notes = gpus_used(cfg), []
    if used > inputs.gpus:
        raise ConfigError(f"plan.gpus={inputs.gpus}: the config uses {used} GPUs (trainer {cfg.trainer_size()} "
                          f"+ generator {cfg.generator_size()}); raise plan.gpus or shrink trainer.dp / "
                          f"generator.replicas")
    if used < inputs.gpus:
        notes.append(f"the config uses {used} of plan.gpus={inputs.gpus} GPUs; its layout is priced on those {used}")
    fixed = configured_layout(cfg, inputs, section)
    on_used = replace(inputs, gpus=used)
    configured = evaluate_layout(on_used, fixed, notes)
    # b_g free here: as many sequences as fit (and the lag allows) -- a recommendation for max_running
    balanced = balanced_split(on_used, fixed.trainer, fixed.generator, None, notes)
    searched = plan_from_inputs(inputs)
    notes.extend(searched.notes)
    if not configured.fits:
        over = [m.describe() for m in (configured.trainer_memory, configured.generator_memory) if not m.fits]
        notes.append(f"the configured layout does not fit in {inputs.gpu_memory_gb:g} GB: " + "; ".join(over))
    return ConfigPlan(path, inputs, used, configured, balanced, searched, notes)
