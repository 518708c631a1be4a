"""`megarl plan --config FILE`: the capacity planner driven by a run config.

The run config says what the job runs, and the planner prices exactly that:
trainer TP x PP x CP x DP, its interleaved stages (trainer.vpp), sequence
parallelism and activation recomputation (trainer.recompute_*), the packed
micro-batch (trainer.max_tokens_per_microbatch), the optimizer state's sharding
(optimizer.use_distributed_optimizer, overlap_*), the generator's engine
(generator.backend: sglang's KV pool within sglang_mem_fraction, or the torch
engine's preallocated max_running x max_seq_len slots), its TP, replicas and
precisions. The free-form ``plan:`` section says what the planner needs about
the cluster and the workload that a run does not::

    plan:
      model: llama3-405b        # preset shapes, so planning needs no checkpoint
      gpus: 1024                # the allocation (default: the GPUs the config uses)
      gpus_per_node: 8
      gpu_memory_gb: 80
      prompt_tokens: 512        # default data.max_prompt_tokens
      response_tokens_min: 512  # uniform [min, max]; default max: rollout.max_new_tokens
      response_tokens_max: 4096
      transformer_impl: transformer_engine  # what megarl builds on GPUs (local: no TE)

A layout that does not fit in GPU memory with its own settings is refused
(``check_config_fits``, also run by ``megarl train --prepare-only``), naming the
part that overflows and the settings that would make it fit. Otherwise three
answers come back: the configured layout priced as it is, the split of the same
GPUs with the same parallelism that balances train and generate times best, and
the best layout the search finds -- restricted to what megarl runs (PP dividing
the layers, every generator replica an equal share of the prompts; it may choose
other recompute / VPP settings) -- next to the synchronous baseline, and, for
the Llama 3.1 presets, LlamaRL's setting of the same model (``scenarios``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Union

from megarl.errors import ConfigError
from megarl.models.presets import HF_CONFIGS, PRESETS
from megarl.plan.costs import MemoryBreakdown
from megarl.plan.hardware import GB, H100, Hardware
from megarl.plan.inputs import (
    FixedLayout,
    LengthDistribution,
    PlanInputs,
    TrainerLayout,
    TrainerOptions,
    planned_generator,
)
from megarl.plan.llamarl_model import (
    AsyncCandidate,
    PlanResult,
    balanced_split,
    build_costs,
    evaluate_layout,
    plan_from_inputs,
)
from megarl.plan.scenarios import scenario_for_model, scenario_json


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
    transformer_impl: str = "transformer_engine"  # Megatron-LM's --transformer-impl of the trainer's GPUs
    max_lag_steps: Optional[float] = None  # None: the config's rollout.max_lag (async), 1 (sync)
    max_pp: int = 16
    measured: Optional[Union[str, Dict[str, Any]]] = None  # see megarl/plan/measured.py
    weight_sync: str = "predict"  # predict | estimate | skip
    hardware: Dict[str, Any] = field(default_factory=dict)  # Hardware field -> value


_INTS = ("gpus", "gpus_per_node", "prompt_tokens", "response_tokens_min", "response_tokens_max", "max_pp")
_FLOATS = ("gpu_memory_gb", "response_tokens_mean", "max_lag_steps")
_CHOICES = {
    "response_dist": ("uniform", "exponential"),
    "weight_sync": ("predict", "estimate", "skip"),
    "transformer_impl": ("transformer_engine", "local"),
}
# Fields the plan section once had, now read from the trainer's own settings.
_MOVED = {
    "recompute": "the planner prices the trainer's own setting: set trainer.recompute_granularity "
    "(null | selective | full, with trainer.recompute_method / recompute_num_layers / recompute_modules)",
    "micro_batch": "the planner packs samples as the trainer does: set trainer.max_tokens_per_microbatch",
}


def plan_section(cfg) -> PlanSection:
    """Parse and check ``cfg.plan``; every error names the field (``plan.gpus: ...``)."""
    data = dict(cfg.plan or {})
    for name in sorted(set(data) & set(_MOVED)):
        raise ConfigError(f"plan.{name}: no longer a plan field; {_MOVED[name]}")
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
    section = section or plan_section(cfg)
    name = section.model
    if name is None and cfg.model.source.startswith("random:"):
        name = cfg.model.source.partition(":")[2]
    if name is None:
        raise ConfigError(
            f"plan.model: name the model's preset ({', '.join(sorted(PRESETS) + sorted(HF_CONFIGS))}) so planning does "
            f"not need the checkpoint at model.source={cfg.model.source!r}"
        )
    if name not in PRESETS and name not in HF_CONFIGS:
        raise ConfigError(f"plan.model: {name!r} is not a preset; choose one of {sorted(PRESETS) + sorted(HF_CONFIGS)}")
    return name


def _precision(name: str, value: str, hint: str) -> str:
    if value not in ("bf16", "auto"):  # auto is bf16 on the GPUs the planner prices (runtime/cpu_dtype.py)
        raise ConfigError(f"{name}: {value!r}; the planner prices H100 runs in bf16 ({hint})")
    return "bf16"


def trainer_options(cfg, section: PlanSection) -> TrainerOptions:
    """The optimizer section in the planner's terms: bytes of state per parameter, its sharding, overlap."""
    o = cfg.optimizer
    state = 12.0 if o.optimizer == "adam" else 4.0 + (4.0 if o.sgd_momentum > 0 else 0.0)  # fp32 master (+ moments)
    return TrainerOptions(
        state_sharding="optimizer" if o.use_distributed_optimizer else "none",
        optimizer_bytes=state,
        overlap_grad_reduce=o.overlap_grad_reduce,
        overlap_param_gather=o.overlap_param_gather,
        transformer_impl=section.transformer_impl,
    )


def planned_lag(cfg, section) -> float:
    """Steps of generation a replica may run ahead (what caps sequences in flight): the run's own
    (RunLayout.steps_ahead) unless plan.max_lag_steps overrides it."""
    if section.max_lag_steps is not None:
        return section.max_lag_steps
    return float(cfg.layout().steps_ahead)


def inputs_from_config(cfg, section: Optional[PlanSection] = None) -> PlanInputs:
    """PlanInputs of a run config: batch, precisions, engine and lengths from the run, the rest from plan:."""
    section = section or plan_section(cfg)
    r, g = cfg.rollout, cfg.generator
    trainer_precision = _precision("model.dtype", cfg.model.dtype, "set model.dtype: bf16")
    if g.fp8:
        generator_precision = "fp8"
        if g.backend == "torch":  # the torch engine dequantises fp8 weights into generator.dtype
            _precision("generator.dtype", g.dtype, "the torch engine dequantises fp8 into it")
    else:
        generator_precision = _precision("generator.dtype", g.dtype, "or set generator.fp8: true")
    longest = section.response_tokens_max or r.max_new_tokens
    if section.response_dist == "exponential":
        if section.response_tokens_mean is None:
            raise ConfigError("plan.response_tokens_mean: needed with plan.response_dist: exponential")
        lengths = LengthDistribution.truncated_exponential(section.response_tokens_mean, longest)
    else:
        lengths = LengthDistribution.uniform(min(section.response_tokens_min, longest), longest)
    return PlanInputs(
        model=model_preset(cfg, section),
        gpus=section.gpus or cfg.layout().world_size,
        gpus_per_node=section.gpus_per_node,
        prompts=r.prompts_per_step,
        samples_per_prompt=r.samples_per_prompt,
        prompt_tokens=section.prompt_tokens or cfg.data.max_prompt_tokens,
        lengths=lengths,
        gpu_memory_gb=section.gpu_memory_gb,
        trainer_precision=trainer_precision,
        generator_precision=generator_precision,
        max_lag_steps=planned_lag(cfg, section),
        measured=section.measured,
        weight_sync=section.weight_sync,
        hardware=section_hardware(section),
        max_pp=section.max_pp,
        equal_prompt_shares=not cfg.layout().colocated,
        trainer_options=trainer_options(cfg, section),
        generator_backend=g.backend,
        generator_mem_fraction=g.sglang_mem_fraction,
        generator_dtype="bf16",
        generator_max_seq_len=g.max_seq_len if g.backend == "torch" else None,
    )


def trainer_layout(cfg, inputs: PlanInputs) -> TrainerLayout:
    """The trainer's layout exactly as trainer.* sets it: its dims (``cfg.trainer_dims()``, DP
    included) and settings (Megatron's recompute_granularity None is "none")."""
    t = cfg.trainer
    rows = t.max_tokens_per_microbatch
    return TrainerLayout(
        cfg.trainer_dims(),
        max(1, int(rows // (inputs.prompt_tokens + inputs.lengths.mean))),
        recompute=t.recompute_granularity or "none",
        sequence_parallel=t.sequence_parallel,
        recompute_method=t.recompute_method,
        recompute_num_layers=t.recompute_num_layers,
        recompute_modules=tuple(t.recompute_modules) if t.recompute_modules is not None else ("core_attn",),
        micro_batch_tokens=rows,
    )


def configured_layout(
    cfg, inputs: PlanInputs, section: Optional[PlanSection] = None, notes: Optional[List[str]] = None
) -> FixedLayout:
    """The config's own layout in the planner's terms. SGLang runs at most the requests its KV pool
    holds (the rest wait), so its sequences in flight are min(max_running, what fits); the torch
    engine allocates all max_running slots at start, fitting or not."""
    g = cfg.generator
    if cfg.layout().colocated:
        raise ConfigError("run.mode: sync runs colocated; `megarl plan --config` prices asynchronous layouts")
    generator = planned_generator(cfg.generator_dims())
    sequences = g.max_running
    if g.backend == "sglang":
        room = build_costs(inputs).max_sequences(generator, inputs.generator_precision, "continuous")
        if 0 < room < sequences:
            sequences = room
            if notes is not None:
                notes.append(
                    f"SGLang's KV pool holds {room} of generator.max_running={g.max_running} sequences "
                    f"per replica at the mean context; the rest wait (priced at {room})"
                )
    return FixedLayout(trainer_layout(cfg, inputs), generator, generator_batch=sequences)


# -- does the configured layout fit? -------------------------------------------------------------


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def _trainer_remedies(costs, layout: TrainerLayout, batch: int, part: str) -> List[str]:
    """Settings that would make the trainer fit, each checked with the same model."""
    tries = []
    if part in ("activations", "logits"):
        if (
            layout.dims.tp > 1
            and not layout.sequence_parallel
            and costs.options.transformer_impl == "transformer_engine"
        ):
            tries.append(("trainer.sequence_parallel=true", replace(layout, sequence_parallel=True)))
        if layout.recompute != "selective" and costs.options.transformer_impl == "local":
            tries.append(("trainer.recompute_granularity=selective", replace(layout, recompute="selective")))
        if layout.recompute != "full":
            tries.append(
                (
                    "trainer.recompute_granularity=selective with trainer.recompute_modules=[core_attn, mlp]",
                    replace(layout, recompute="selective", recompute_modules=("core_attn", "mlp")),
                )
            )
            tries.append(
                (
                    "trainer.recompute_granularity=full (recompute_method=uniform, recompute_num_layers=1)",
                    replace(layout, recompute="full", recompute_method="uniform", recompute_num_layers=1),
                )
            )
    out = []
    for text, candidate in tries:
        memory = costs.trainer_memory(candidate, batch)
        out.append(f"{text} ({_gb(memory.total)}{'' if memory.fits else ', still too much'})")
    advice = {
        "weights": "a larger trainer.tp or trainer.pp (the weights are split over TP x PP)",
        "grads": "a larger trainer.tp or trainer.pp (gradients are split over TP x PP)",
        "optimizer": "optimizer.use_distributed_optimizer=true or a larger trainer.dp / tp / pp",
        "activations": "a larger trainer.tp or trainer.pp",
        "logits": "a larger trainer.tp (the logits are split over TP)",
    }
    if part in advice:
        out.append(advice[part])
    return out


def _generator_remedies(cfg, part: str) -> List[str]:
    g = cfg.generator
    if part == "kv_cache":
        if g.backend == "torch":
            return [
                f"a smaller generator.max_running (now {g.max_running}) or generator.max_seq_len "
                f"(now {g.max_seq_len}): the torch engine allocates every slot at start",
                "or generator.backend=sglang (a paged pool: only what is in flight)",
            ]
        return ["a larger generator.tp (not even one sequence fits SGLang's KV pool)"]
    if part in ("weights", "dequant_workspace"):
        return ["a larger generator.tp"] + ([] if g.fp8 else ["or generator.fp8=true"])
    return []


def overflow_message(memory: MemoryBreakdown, remedies: List[str]) -> str:
    part = memory.overflow
    parts = " + ".join(f"{k} {v / GB:.1f}" for k, v in memory.parts.items() if v)
    text = (
        f"{memory.role} {memory.layout}: {part} {_gb(memory.parts[part])} overflows the "
        f"{memory.capacity / GB:g} GB GPU ({parts} = {_gb(memory.total)})"
    )
    return text + ("; fits with " + "; or ".join(remedies) if remedies else "")


def check_layout_fits(cfg, inputs: PlanInputs, layout: AsyncCandidate) -> None:
    """Refuse a configured layout whose trainer or generator GPUs overflow, naming the part."""
    costs = build_costs(inputs)
    if not layout.trainer_memory.fits:
        part = layout.trainer_memory.overflow
        remedies = _trainer_remedies(costs, layout.trainer, inputs.batch, part)
        raise ConfigError(overflow_message(layout.trainer_memory, remedies))
    if not layout.generator_memory.fits:
        part = layout.generator_memory.overflow
        raise ConfigError(overflow_message(layout.generator_memory, _generator_remedies(cfg, part)))


def check_config_fits(cfg) -> Optional[AsyncCandidate]:
    """`megarl train --prepare-only`: refuse a config with a plan: section whose layout does not fit
    (memory only: no search, no weight-sync plan). Sync mode: the trainer's GPUs alone are checked
    (the colocated engine's copy is not priced). Returns the priced layout (None for sync)."""
    section = plan_section(cfg)
    inputs = replace(inputs_from_config(cfg, section), gpus=cfg.layout().world_size, weight_sync="skip")
    if cfg.layout().colocated:
        costs = build_costs(inputs)
        layout = trainer_layout(cfg, inputs)
        memory = costs.trainer_memory(layout, inputs.batch)
        if not memory.fits:
            remedies = _trainer_remedies(costs, layout, inputs.batch, memory.overflow)
            raise ConfigError(overflow_message(memory, remedies))
        return None
    layout = evaluate_layout(inputs, configured_layout(cfg, inputs, section))
    check_layout_fits(cfg, inputs, layout)
    return layout


@dataclass
class ConfigPlan:
    path: str
    inputs: PlanInputs  # on the allocation (plan.gpus)
    gpus_used: int
    configured: AsyncCandidate  # the config's layout as it is
    balanced: Optional[AsyncCandidate]  # the same parallelism, the best split of the same GPUs
    searched: PlanResult  # the best megarl-runnable layout on plan.gpus, and the sync baseline
    notes: List[str] = field(default_factory=list)
    scenario: Optional[dict] = None  # LlamaRL's setting of the same model (scenarios.scenario_json)

    def speedup(self, layout: Optional[AsyncCandidate]) -> Optional[float]:
        s = self.searched.best_sync
        return None if layout is None or s is None else s.step_seconds / layout.step_seconds


def moe_assumptions(spec, cfg) -> List[str]:
    """What the planner assumes about a model with experts, each by the field it reads."""
    if spec.moe is None:
        return []
    m, t, g = spec.moe, cfg.trainer, cfg.generator
    dims = cfg.trainer_dims()
    return [
        f"experts (model's config): {spec.num_moe_layers} MoE layers x {m.num_experts} experts of width "
        f"{m.ffn_hidden_size}, top {m.top_k}: {spec.num_parameters() / 1e9:.1f}B parameters, "
        f"{spec.num_active_parameters() / 1e9:.1f}B active; FLOPs are priced from the active ones",
        f"trainer.ep={t.ep} x trainer.etp={dims.expert_tp}: the routed experts are sharded over EP x ETP, "
        f"their optimizer state over the expert data-parallel group (edp={dims.edp}); the dense part over "
        "TP as usual",
        "routing is priced as even (each rank receives top-k tokens per local token; imbalance and "
        "trainer.moe_* capacity settings are not priced), and the token dispatcher's all-to-all time is not "
        f"priced (trainer.moe_token_dispatcher_type={t.moe_token_dispatcher_type!r})",
        f"generator.ep={g.ep} sits inside generator.tp={g.tp} (SGLang): every expert's weights are read in "
        "each decode step (a batch routes to nearly all of them), the top-k computed",
        "the searched and synchronous-baseline rows keep the experts unsharded (EP1): the layout search "
        "does not enumerate expert parallelism yet; the configured row is the MoE layout",
    ]


def plan_config(cfg, path: str = "config") -> ConfigPlan:
    section = plan_section(cfg)
    inputs = inputs_from_config(cfg, section)
    used, notes = cfg.layout().world_size, []
    if used > inputs.gpus:
        raise ConfigError(
            f"plan.gpus={inputs.gpus}: the config uses {used} GPUs (trainer {cfg.trainer_dims().world_size} "
            f"+ generator {cfg.generator_dims().world_size}); raise plan.gpus or shrink trainer.dp / "
            f"generator.replicas"
        )
    if used < inputs.gpus:
        notes.append(f"the config uses {used} of plan.gpus={inputs.gpus} GPUs; its layout is priced on those {used}")
    on_used = replace(inputs, gpus=used)
    fixed = configured_layout(cfg, on_used, section, notes)
    configured = evaluate_layout(on_used, fixed, notes)
    check_layout_fits(cfg, on_used, configured)
    # b_g free here: as many sequences as fit (and the lag allows) -- a recommendation for max_running
    balanced = balanced_split(on_used, fixed.trainer, fixed.generator, None, notes)
    searched = plan_from_inputs(inputs)
    notes.extend(searched.notes)
    notes.extend(moe_assumptions(inputs.model_spec(), cfg))
    name = scenario_for_model(inputs.model)
    scenario = scenario_json(name) if name else None
    return ConfigPlan(path, inputs, used, configured, balanced, searched, notes, scenario)
