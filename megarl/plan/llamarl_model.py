"""LlamaRL's step-time model (arXiv 2505.24034, s.7) and a layout search over it.

Notation of s.7: N GPUs, global batch B samples per step; eta_t(m, b) and
eta_g(m, b) are the seconds one model replica of m GPUs spends per sample when
training with micro-batch b / generating with b sequences in flight.

Synchronous, colocated (the DeepSpeed-Chat-like baseline of Table 3): all N
GPUs alternate between generating and training with ONE model-parallel layout
m (the trainer's, since the generator uses the trainer's weights in place),
each of the N/m replicas handling its share of B:

    T_sync = B / (N/m) * (eta_g(m, b_g) + eta_t(m, b_t))

and generation must fit beside the trainer's resident state.

Asynchronous (LlamaRL): a fraction theta of the GPUs trains at (m_t, b_t), the
rest generate at (m_g, b_g), concurrently:

    T_async = max(B / (theta N / m_t) * eta_t(m_t, b_t),  B / ((1 - theta) N / m_g) * eta_g(m_g, b_g))
              + weight sync

Theorem 7.5 (see ``llamarl_theorem``): the best asynchronous layout is strictly
faster than the best synchronous one. The search here is the practical,
discrete version: theta in whole nodes and whole replicas, m = TP x PP with TP
within a node and PP dividing the layers (uneven stages only with
``PlanInputs.uneven_pp``: megarl itself refuses them), every layout checked
against GPU memory. On top of the theorem's setting the baseline, by default, also
generates in the trainer's precision (bf16) and in static batches that wait for
the longest response (``PlanInputs.sync_batching``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import List, Optional, Sequence

from megarl.errors import ConfigError
from megarl.layout import disaggregated_world_size
from megarl.parallel_dims import ParallelDims
from megarl.plan import weight_sync_cost
from megarl.plan.costs import H100CostModel, MemoryBreakdown, Workload
from megarl.plan.engines import GeneratorEngine
from megarl.plan.inputs import (
    RECOMPUTE,
    FixedLayout,
    PlanInputs,
    TrainerLayout,
    check_trainer_layout,
    generator_dims,
    generator_text,
    replica_layout,
)
from megarl.plan.measured import load_measured

MICRO_BATCHES = (1, 2, 4, 8)


@dataclass
class AsyncCandidate:
    """An asynchronous layout as priced: trainer and generators (each with its dims) and what the
    model predicts for them -- step times, per-sample times, memory."""

    trainer: TrainerLayout  # dims.dp replicas over trainer_gpus
    generator: ParallelDims  # generator_dims: replicas of TP x PP, dp = replicas
    sequences: int  # b_g: in flight per generator replica
    train_seconds: float
    generate_seconds: float
    weight_sync_seconds: float
    eta_t: float
    eta_g: float
    trainer_memory: MemoryBreakdown
    generator_memory: MemoryBreakdown
    weight_sync_method: str = "estimate"

    @property
    def trainer_gpus(self) -> int:
        return self.trainer.gpus

    @property
    def generator_gpus(self) -> int:
        return self.generator.world_size

    @property
    def dp(self) -> int:
        return self.trainer.dims.dp

    @property
    def replicas(self) -> int:
        return self.generator.dp

    @property
    def theta(self) -> float:
        return self.trainer_gpus / (self.trainer_gpus + self.generator_gpus)

    @property
    def step_seconds(self) -> float:
        return max(self.train_seconds, self.generate_seconds) + self.weight_sync_seconds

    @property
    def fits(self) -> bool:
        return self.trainer_memory.fits and self.generator_memory.fits


@dataclass
class SyncCandidate:
    """A synchronous colocated layout as priced: the trainer's dims span every GPU, and each GPU
    generates on the trainer's own TP x PP shards before it trains."""

    trainer: TrainerLayout
    sequences: int  # b_g: in flight per replica while generating
    generator_precision: str
    batching: str
    train_seconds: float
    generate_seconds: float
    eta_t: float
    eta_g: float
    trainer_memory: MemoryBreakdown
    generator_memory: MemoryBreakdown

    @property
    def gpus(self) -> int:
        return self.trainer.gpus

    @property
    def dp(self) -> int:
        return self.trainer.dims.dp

    @property
    def step_seconds(self) -> float:
        return self.train_seconds + self.generate_seconds

    @property
    def fits(self) -> bool:
        return self.trainer_memory.fits and self.generator_memory.fits


@dataclass
class PlanResult:
    inputs: PlanInputs
    params: int
    best_async: Optional[AsyncCandidate]
    best_sync: Optional[SyncCandidate]
    async_evaluated: int = 0
    sync_evaluated: int = 0
    notes: List[str] = field(default_factory=list)

    @property
    def speedup(self) -> Optional[float]:
        if self.best_async is None or self.best_sync is None:
            return None
        return self.best_sync.step_seconds / self.best_async.step_seconds


# -- layout enumeration ----------------------------------------------------------------------


def _powers_of_two(limit: int) -> List[int]:
    return [1 << i for i in range(limit.bit_length()) if (1 << i) <= limit]


def pipeline_sizes(layers: int, max_pp: int, uneven: bool = False) -> List[int]:
    """PP sizes up to max_pp that divide the layers: megarl's ``ModelSpec.check_parallelism`` (and
    the weight-sync planner) refuse uneven stages, so by default the planner never recommends one.
    ``uneven``: also powers of two (Megatron's num_layers_in_first/last_pipeline_stage), opt-in."""
    sizes = {pp for pp in range(1, max_pp + 1) if layers % pp == 0}
    if uneven:
        sizes |= {pp for pp in _powers_of_two(max_pp) if pp <= layers}
    return sorted(sizes)


def trainer_layouts(
    costs, max_pp: int, uneven_pp: bool = False, recompute: Sequence[str] = RECOMPUTE, max_vpp: int = 1
) -> List[TrainerLayout]:
    """TP a power of two within a node (dividing heads and FFN), PP as ``pipeline_sizes``, each
    recompute setting (full: one layer at a time, Megatron-LM's usual uniform 1), sequence
    parallelism wherever TP > 1 (it only saves memory: the same bytes move as without), and
    interleaved stages up to max_vpp chunks per PP rank where they divide its layers."""
    spec = costs.spec
    out = []
    for tp in _powers_of_two(costs.hw.gpus_per_node):
        try:
            spec.check_parallelism(tp, 1)
        except ConfigError:
            continue
        sp = tp > 1 and costs.options.transformer_impl == "transformer_engine"
        for pp in pipeline_sizes(spec.num_layers, max_pp, uneven_pp):
            stage = spec.num_layers // pp if spec.num_layers % pp == 0 else 0
            vpps = [v for v in range(1, max_vpp + 1) if v == 1 or (pp > 1 and stage and stage % v == 0)]
            for vpp in vpps:
                for mb in MICRO_BATCHES:
                    for rc in recompute:
                        layout = replica_layout(tp, pp, mb, rc, vpp=vpp, sequence_parallel=sp)
                        if costs.trainer_allowed(layout):
                            out.append(layout)
    return out


def generator_layouts(
    costs, max_pp: int, precision: str, role: str = "generator", uneven_pp: bool = False
) -> List[ParallelDims]:
    """One replica each (``generator_dims``, dp 1): SGLang, TP a power of two within a node (KV
    heads replicated beyond their count); PP only when the weights do not fit on one node's GPUs
    (e.g. 405B in bf16), as deployed in practice."""
    gpn = costs.hw.gpus_per_node
    fits_in_node = costs.generator_weight_bytes(ParallelDims(tp=gpn), precision) < costs.hw.usable_bytes
    out = []
    for tp in _powers_of_two(gpn):
        try:
            costs.spec.check_parallelism(tp, 1)
        except ConfigError:
            continue
        for pp in [1] if fits_in_node else pipeline_sizes(costs.spec.num_layers, max_pp, uneven_pp):
            replica = generator_dims(tp, tp * pp, pp)
            if costs.generator_allowed(replica, role):
                out.append(replica)
    return out


# -- evaluation of one layout ----------------------------------------------------------------


def evaluate_trainer(costs, layout: TrainerLayout, batch: int):
    """(train seconds per step, eta_t, memory) of a trainer at its dims (DP included)."""
    dp = layout.dims.dp
    memory = costs.trainer_memory(layout, batch)
    eta = costs.trainer_seconds_per_sample(layout, batch)
    seconds = math.ceil(batch / dp) * eta + costs.trainer_step_overhead(layout)
    return seconds, eta, memory


def evaluate_async(
    costs,
    inputs: PlanInputs,
    trainer: TrainerLayout,
    generator: ParallelDims,
    sequences: Optional[int] = None,
    trainer_eval=None,
) -> AsyncCandidate:
    """Price a trainer and generators that share inputs.gpus between them."""
    if trainer.gpus + generator.world_size != inputs.gpus:
        raise ConfigError(
            f"layout: trainer {trainer.gpus} GPUs ({trainer.dims.describe()}) + generator "
            f"{generator.world_size} GPUs ({generator.dp} x {generator_text(generator)}) != gpus={inputs.gpus}"
        )
    batch, precision = inputs.batch, inputs.generator_precision
    train_s, eta_t, t_mem = trainer_eval or evaluate_trainer(costs, trainer, batch)
    replicas = generator.dp
    mode = inputs.async_batching
    if sequences is None:
        # eta_g falls with b_g: run as many as fit, but no more than the lag bound allows (static:
        # the replica's share of the step's batch, started together)
        cap = math.ceil((1 if mode == "static" else inputs.max_lag_steps) * batch / replicas)
        sequences = min(cap, costs.max_sequences(generator, precision, mode))
    g_mem = costs.generator_memory(generator, precision, max(sequences, 1), mode)
    eta_g = costs.generator_seconds_per_sample(generator, precision, max(sequences, 1), mode)
    if sequences < 1:
        g_mem.parts["kv_cache"] = max(g_mem.parts["kv_cache"], g_mem.capacity)  # not even one sequence fits
    sync_s = 0.0
    if inputs.weight_sync != "skip":
        sync_s = weight_sync_cost.estimate_seconds(costs, trainer, generator, precision)
    share = batch / replicas if mode == "continuous" else math.ceil(batch / replicas)
    return AsyncCandidate(
        trainer,
        generator,
        sequences,
        train_s,
        share * eta_g,
        sync_s,
        eta_t,
        eta_g,
        t_mem,
        g_mem,
        "skip" if inputs.weight_sync == "skip" else "estimate",
    )


def evaluate_sync(costs, inputs: PlanInputs, trainer: TrainerLayout, trainer_eval=None) -> SyncCandidate:
    """Price the colocated baseline: the trainer's dims span inputs.gpus, and every GPU also
    generates, on the trainer's own TP x PP shards."""
    batch, gpus = inputs.batch, inputs.gpus
    if trainer.gpus != gpus:
        raise ConfigError(
            f"sync layout {trainer.dims.describe()}: {trainer.gpus} GPUs, the colocated baseline runs on all {gpus}"
        )
    train_s, eta_t, t_mem = trainer_eval or evaluate_trainer(costs, trainer, batch)
    dp = trainer.dims.dp
    precision, mode = inputs.sync_precision, inputs.sync_batching
    layout = trainer.dims  # the colocated generator uses the trainer's shards
    resident = {k: v for k, v in t_mem.parts.items() if k in ("weights", "grads", "optimizer")}
    if inputs.sync_offload_trainer_state:
        resident = {"weights": resident["weights"]}
    if (
        precision != inputs.trainer_precision
        or inputs.sync_separate_generator_copy
        or costs.options.state_sharding == "fsdp"
    ):
        # a second copy of the weights to generate with (quantised, the engine's own, or gathered
        # from FSDP's shards: a GPU holds 1/dp of its layers' weights, not a generator's TP x PP shard)
        resident["generator weights"] = costs.generator_weight_bytes(layout, precision)
    per_replica = math.ceil(batch / dp)
    sequences = min(per_replica, costs.max_sequences(layout, precision, mode, resident))
    g_mem = costs.generator_memory(layout, precision, max(sequences, 1), mode, resident)
    if sequences < 1:
        g_mem.parts["kv_cache"] = max(g_mem.parts["kv_cache"], g_mem.capacity)
    eta_g = costs.generator_seconds_per_sample(layout, precision, max(sequences, 1), mode, role="sync_generator")
    return SyncCandidate(trainer, sequences, precision, mode, train_s, per_replica * eta_g, eta_t, eta_g, t_mem, g_mem)


# -- the search ------------------------------------------------------------------------------


def _split_unit(inputs: PlanInputs, m: int) -> int:
    """theta moves in whole nodes (a single node: whole GPUs) and whole units of ``m`` GPUs (a
    replica; with experts, TrainerLayout.gpu_unit)."""
    node = inputs.gpus_per_node if inputs.gpus >= 2 * inputs.gpus_per_node else 1
    return m * node // math.gcd(m, node)


def search_layouts(costs, inputs: PlanInputs):
    """Best asynchronous and best synchronous layouts that fit in memory (LlamaRL s.7)."""
    batch, n, layers = inputs.batch, inputs.gpus, costs.spec.num_layers
    # The synchronous baseline models the comparison system (Megatron-style, uneven stages
    # allowed); the asynchronous layout is the recommendation, so it is one megarl can run.
    trainers = trainer_layouts(costs, inputs.max_pp, uneven_pp=True, recompute=inputs.recompute, max_vpp=inputs.max_vpp)
    generators = generator_layouts(costs, inputs.max_pp, inputs.generator_precision, uneven_pp=inputs.uneven_pp)
    best_train = {}  # trainer GPUs -> (seconds, layout on those GPUs, evaluation)
    best_sync, sync_count, async_count = None, 0, 0
    for replica in trainers:
        unit = _split_unit(inputs, replica.gpu_unit)
        runnable = inputs.uneven_pp or layers % replica.dims.pp == 0
        for gpus in range(unit, n, unit) if runnable else ():
            layout = replica.on_gpus(gpus)
            ev = evaluate_trainer(costs, layout, batch)
            if ev[2].fits and (gpus not in best_train or ev[0] < best_train[gpus][0]):
                best_train[gpus] = (ev[0], layout, ev)
        if (
            inputs.sync_layout is None
            and n % replica.m == 0
            and costs.generator_allowed(replica.dims, "sync_generator")
        ):
            sync_count += 1
            layout = replica.on_gpus(n)
            ev = evaluate_trainer(costs, layout, batch)
            if ev[2].fits:
                candidate = evaluate_sync(costs, inputs, layout, ev)
                if candidate.fits and (best_sync is None or candidate.step_seconds < best_sync.step_seconds):
                    best_sync = candidate
    if inputs.sync_layout is not None:  # given: priced whether or not it is the best
        sync_count = 1
        best_sync = evaluate_sync(costs, inputs, inputs.sync_layout)
    best_async = None
    for gpus, (_, layout, ev) in best_train.items():
        for replica in generators:
            m_g = replica.world_size
            if (n - gpus) % m_g:
                continue
            if inputs.equal_prompt_shares and inputs.prompts % ((n - gpus) // m_g):
                continue
            async_count += 1
            generator = generator_dims(replica.tp, n - gpus, replica.pp)
            candidate = evaluate_async(costs, inputs, layout, generator, trainer_eval=ev)
            if candidate.fits and (best_async is None or candidate.step_seconds < best_async.step_seconds):
                best_async = candidate
    return best_async, best_sync, async_count, sync_count


def build_costs(inputs: PlanInputs):
    spec = inputs.model_spec()
    engine = GeneratorEngine(
        inputs.generator_backend, inputs.generator_mem_fraction, inputs.generator_dtype, inputs.generator_max_seq_len
    )
    costs = H100CostModel(
        spec, inputs.hw, Workload(inputs.prompt_tokens, inputs.lengths), options=inputs.trainer_options, engine=engine
    )
    costs.batch = inputs.batch
    if inputs.measured:
        costs = load_measured(inputs.measured, costs)
    return costs


def plan_from_inputs(inputs: PlanInputs) -> PlanResult:
    """Search (or evaluate inputs.layout) and return both layouts and the predicted speed-up."""
    inputs.validate()
    costs = build_costs(inputs)
    best_async, best_sync, n_async, n_sync = search_layouts(costs, inputs)
    result = PlanResult(inputs, costs.shape.params, best_async, best_sync, n_async, n_sync)
    if inputs.layout is not None:
        result.best_async = _evaluate_fixed(costs, inputs, inputs.layout)
        result.notes.append("asynchronous layout given, not searched")
    if result.best_async is None:
        result.notes.append("no asynchronous layout fits in memory")
    if result.best_sync is None:
        result.notes.append("no synchronous (colocated) layout fits in memory")
    why = {
        "asynchronous trainer": "megarl's check_parallelism refuses it (searched because uneven_pp was set)",
        "synchronous baseline": "the comparison system's layout, not one megarl runs",
    }
    for name, layout in (
        ("asynchronous trainer", result.best_async and result.best_async.trainer),
        ("synchronous baseline", result.best_sync and result.best_sync.trainer),
    ):
        layers = costs.spec.num_layers
        pp = layout.dims.pp if layout is not None else 1
        if layers % pp:
            result.notes.append(
                f"{name} PP{pp} splits {layers} layers unevenly (largest stage {-(-layers // pp)}, "
                f"Megatron's num_layers_in_first/last_pipeline_stage): {why[name]}"
            )
    if result.best_async is not None:
        predict_weight_sync(costs, inputs, result.best_async, result.notes)
    return result


def predict_weight_sync(costs, inputs: PlanInputs, a: AsyncCandidate, notes: List[str]) -> None:
    """Replace the estimate by megarl's transfer planner's prediction, when inputs ask for it."""
    if inputs.weight_sync != "predict":
        return
    try:
        if a.generator.pp > 1:
            raise ConfigError(f"generator PP{a.generator.pp}: megarl's sync planner has SGLang TP layouts only")
        a.weight_sync_seconds = weight_sync_cost.predict_seconds(
            costs.spec, costs.hw, a.trainer, a.generator, inputs.generator_precision
        )
        a.weight_sync_method = "predict"
    except ImportError as err:  # the planner itself needs no torch; the transfer planner does
        notes.append(f"weight sync estimated, not predicted ({err})")
    except ConfigError as err:  # e.g. uneven pipeline stages, which megarl's sync planner refuses
        notes.append(f"weight sync estimated, not predicted: {err}")


def evaluate_layout(inputs: PlanInputs, fixed: FixedLayout, notes: Optional[List[str]] = None) -> AsyncCandidate:
    """One asynchronous layout on inputs.gpus GPUs, priced without searching (e.g. a run config's)."""
    inputs.validate()
    costs = build_costs(inputs)
    layout = _evaluate_fixed(costs, inputs, fixed)
    predict_weight_sync(costs, inputs, layout, notes if notes is not None else [])
    return layout


def balanced_split(
    inputs: PlanInputs,
    trainer: TrainerLayout,
    generator: ParallelDims,
    sequences: Optional[int] = None,
    notes: Optional[List[str]] = None,
) -> Optional[AsyncCandidate]:
    """The trainer/generator split of inputs.gpus with the fastest step for fixed parallelism (the
    replicas' TP x PP of ``trainer`` and ``generator``; their DP sizes are what is chosen): theta
    moves in whole nodes and whole replicas (and, with equal_prompt_shares, replica counts
    dividing the prompts), so train and generate times come as close as they can."""
    inputs.validate()
    costs = build_costs(inputs)
    n, best = inputs.gpus, None
    unit = _split_unit(inputs, trainer.gpu_unit)
    m_g = generator.world_size // generator.dp
    for gpus in range(unit, n, unit):
        replicas = (n - gpus) // m_g
        if (n - gpus) % m_g or (inputs.equal_prompt_shares and inputs.prompts % replicas):
            continue
        candidate = evaluate_async(
            costs, inputs, trainer.on_gpus(gpus), generator_dims(generator.tp, n - gpus, generator.pp), sequences
        )
        if candidate.fits and (best is None or candidate.step_seconds < best.step_seconds):
            best = candidate
    if best is not None:
        predict_weight_sync(costs, inputs, best, notes if notes is not None else [])
    return best


def _evaluate_fixed(costs, inputs: PlanInputs, fixed: FixedLayout) -> AsyncCandidate:
    n, t, g = inputs.gpus, fixed.trainer.dims, fixed.generator
    if disaggregated_world_size(t, g) != n:
        raise ConfigError(
            f"layout: layout.trainer {t.describe()} ({t.world_size} GPUs) + layout.generator {g.dp} x "
            f"{generator_text(g)} ({g.world_size} GPUs) must use the gpus={n} GPUs"
        )
    costs.spec.check_parallelism(t.tp, 1)
    costs.spec.check_parallelism(g.tp, 1)
    check_trainer_layout(fixed.trainer, costs.options)
    if not 1 <= t.pp <= costs.spec.num_layers:
        raise ConfigError(f"layout.trainer.pp={t.pp} must be between 1 and the {costs.spec.num_layers} layers")
    if costs.spec.num_layers % t.pp and not inputs.uneven_pp:
        raise ConfigError(
            f"layout.trainer.pp={t.pp} does not divide the {costs.spec.num_layers} layers: "
            f"megarl refuses uneven pipeline stages (the planner prices them with uneven_pp)"
        )
    if t.vpp > 1 and costs.spec.num_layers % (t.pp * t.vpp):
        raise ConfigError(
            f"layout.trainer.vpp={t.vpp}: PP{t.pp} x VPP{t.vpp} chunks do not divide the {costs.spec.num_layers} layers"
        )
    return evaluate_async(costs, inputs, fixed.trainer, g, fixed.generator_batch)


def theorem_setting(inputs: PlanInputs) -> PlanInputs:
    """Theorem 7.5's setting: one eta_g for both (same precision, continuous batching), so the
    only differences left are the layout freedom and the memory the trainer's state takes."""
    p = inputs.trainer_precision
    return replace(inputs, generator_precision=p, sync_generator_precision=p, sync_batching="continuous")
