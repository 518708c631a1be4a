"""A decomposition check of `megarl bench async-vs-sync`: the planner's step-time model, fed
the phase times of the very runs it is compared with, against those runs' whole steps.

This is not a prediction. Every per-sample time below is measured in the run whose step time
it is then composed into, so agreement says that LlamaRL's composition (max(train, generate) +
sync for async, generate + train for sync) accounts for the steps' time -- that the parts the
model leaves out (channels, controller work, the in-place weight copy) are small -- not that the
planner can price a layout it has not seen run. A prediction would take eta_t and eta_g from
other runs (another batch size or layout); on a CPU host whose ranks share its cores those times
change with what else runs beside them (below), and each tiny run is ~40 s of two cores, so the
bench does not attempt one.

LlamaRL s.7 prices a layout with two per-sample times of one model replica (m devices),
eta_t(m, b) and eta_g(m, b) -- tau(b) / b, the seconds a replica spends per sample at batch b --
and composes them (``megarl.plan.llamarl_model``)::

    sync  (colocated: N devices, every replica generates, then trains, its B / (N/m) samples)
        T_sync  = B / (N/m) * (eta_g(m, b_g) + eta_t(m, b_t))
    async (dp trainer replicas and r generator replicas, concurrently)
        T_async = max(B / dp * eta_t(m_t, b_t),  B / r * eta_g(m_g, b_g))  +  weight sync

The bench runs both modes on the same ranks (the planner's "devices"). This module takes the
per-sample times each mode ran at, at the batch sizes it ran at, gives them to the planner as
measured tables (``megarl.plan.measured``) and prices the two layouts that ran with the
planner's own ``evaluate_async`` / ``evaluate_sync`` -- the functions that price the 405B
layouts -- so the ``composed_ratio`` printed is the model's composition of the measured parts,
next to the measured ratio of whole steps. What the model leaves out (the rollout and batch
channels, controller work between phases, the baseline's in-place weight copy) is what
separates the two.

Model inputs, and how a run's metrics (metrics.jsonl) give them:

* Steady steps. The first recorded step of each mode carries one-time costs (the trainer's first
  step, the reward function's first call) and an asynchronous run's last iteration only trains
  (the pipeline drains: nothing is generated); both are left out (``steady_records``). The
  asynchronous pipeline's fill -- the first batch generated with nothing to train -- is not a
  recorded step. The planner prices steady steps, and the measured ratio it is compared with is
  the steady steps' samples/s.
* eta_t at the replica's batch. megarl packs a replica's samples into token-bounded
  micro-batches, and the per-step costs (the optimizer step, the data-parallel gradient
  exchange) amortise over the samples a replica trains per step, B / dp: eta_t is measured and
  looked up at that batch (``ReplicaBatchCosts``; the stock tables key it by micro-batch).
  Async trains B samples per step on dp replicas, sync B on N/m: different b_t, different eta_t.
* eta_g of scored samples. A generator replica delivers samples with their rewards (scoring runs
  on the generator's ranks in both modes), so eta_g = (generate + reward seconds) / samples per
  replica. Async generates with up to ``generator.max_running`` sequences in flight and refills
  (continuous); sync starts its B / (N/m) at once and waits for the longest (static): separate
  tables, ``generator`` and ``sync_generator``.
* Generating while waiting. With ``generator.generate_while_waiting`` an asynchronous generator
  keeps decoding for the next batch until the trainer's step ends, so its measured time per step
  is max(its own work, the trainer's step): eta_g derived from it is an upper bound, exact when
  the generator is the bottleneck, and max(train, generate) -- T_async -- is the same either way.
  The output says which (``eta_g_is``).
* Devices that share cores. On a CPU the ranks are processes sharing the host's cores, each with
  its intra-op threads (``threads``): async runs the trainer and generator ranks at once, each
  with the threads its config gives it; sync runs every rank through both phases with the cores
  split evenly. The per-sample times are measured in situ -- while the other ranks run as that
  mode runs them -- so whatever the ranks take from each other is inside them, and the model's
  premise (a replica's time depends on its layout and batch, not on what the other devices do)
  holds for them. Per-sample times measured with the cores to one rank alone would not carry
  over to either mode here.
* Weight sync. Async: the measured per-step sync (the planner's own estimate is an NVLink
  figure). The colocated baseline updates its engine in place and the planner prices no sync
  for it; megarl's sync mode copies the new weights into each rank's engine, reported as
  ``unpriced_copy_s``.

Memory is not checked here: the tables replace the times, and the capacity is set so that the
GPU memory model never binds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence

from megarl.errors import ConfigError
from megarl.layout import disaggregated_world_size
from megarl.parallel_dims import GeneratorDims, ParallelDims
from megarl.plan.inputs import LengthDistribution, PlanInputs, TrainerLayout, planned_generator
from megarl.plan.llamarl_model import build_costs, evaluate_async, evaluate_sync
from megarl.plan.measured import MeasuredCostModel

# capacity given to the planner's (GPU) memory model so that it never limits a measured layout
UNBOUNDED_MEMORY_GB = 1e6


# -- the runs' metrics ----------------------------------------------------------------------------


def steady_records(records: Sequence[dict], mode: str) -> List[dict]:
    """The steps whose timing is the loop's steady state (see the module doc). Too short a run
    keeps what it has: async needs 3 recorded steps, sync 2, to drop anything."""
    records = list(records)
    if mode == "async":
        if records and records[-1].get("time_generate", 0.0) == 0.0 and len(records) > 1:
            records = records[:-1]  # the drain: the last batch trained, nothing generated
        return records[1:] if len(records) > 1 else records
    if mode == "sync":
        return records[1:] if len(records) > 1 else records
    raise ConfigError(f"mode {mode!r}: async or sync")


@dataclass(frozen=True)
class PhaseTimes:
    """Mean seconds per step of one mode's steady steps, by phase (metrics.jsonl's fields)."""

    steps: List[int]
    samples: float  # per step
    step_s: float
    train_s: float
    generate_s: float  # the slowest replica's (the step waits for it)
    reward_s: float
    weight_sync_s: float
    idle_trainer_s: float = 0.0  # the trainer waiting for a batch (async: the generator is behind)

    @classmethod
    def from_records(cls, records: Sequence[dict]) -> "PhaseTimes":
        if not records:
            raise ConfigError("no recorded steps to measure")

        def mean(key: str) -> float:
            return sum(float(r.get(key, 0.0)) for r in records) / len(records)

        return cls(
            [int(r["step"]) for r in records],
            mean("samples"),
            mean("time_step"),
            mean("time_train"),
            mean("time_generate"),
            mean("time_reward"),
            mean("time_weight_sync"),
            mean("idle_trainer"),
        )

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step_s


# -- the layouts that ran -------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchLayouts:
    """The two layouts of the bench in the planner's terms; devices = ranks. ``trainer`` and
    ``generator``: the asynchronous run's; ``sync``: the synchronous run's trainer, the same TP x
    PP over every rank (each rank generates too)."""

    ranks: int
    prompts: int
    samples_per_prompt: int
    trainer: ParallelDims  # async
    generator: GeneratorDims  # async
    sync: ParallelDims
    max_running: int  # async b_g: sequences in flight per generator replica
    micro_batch: int = 1  # samples per micro-batch of the planner (megarl packs by tokens)
    recompute: str = "none"
    generate_while_waiting: bool = True
    threads: Dict[str, int] = field(default_factory=dict)  # rank role -> intra-op threads (CPU)
    cores: Optional[int] = None

    @property
    def batch(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def async_trainer_b(self) -> int:
        return math.ceil(self.batch / self.trainer.dp)

    @property
    def async_generator_b(self) -> int:
        return self.max_running

    @property
    def samples_per_generator(self) -> float:
        return self.batch / self.generator.replicas

    @property
    def sync_b(self) -> int:
        return math.ceil(self.batch / self.sync.dp)

    def check(self) -> "BenchLayouts":
        t, g, s = self.trainer, self.generator, self.sync
        if disaggregated_world_size(t, g) != self.ranks:
            raise ConfigError(
                f"async: trainer {t.describe()} ({t.world_size} ranks) + generator {g.describe()} "
                f"({g.world_size} ranks) != {self.ranks}"
            )
        if s.world_size != self.ranks:
            raise ConfigError(f"sync: {s.describe()} = {s.world_size} ranks != {self.ranks} ranks")
        if (s.tp, s.pp, s.cp) != (t.tp, t.pp, t.cp):
            raise ConfigError(f"sync: {s.describe()} must run the async trainer's model parallelism {t.describe()}")
        return self


def layouts_from_config(
    cfg, sync_dp: int, threads: Optional[Dict[str, int]] = None, cores: Optional[int] = None
) -> BenchLayouts:
    """The bench's layouts from its async run's config (the sync run: the same TP x PP on every rank)."""
    t, g, r = cfg.trainer, cfg.generator, cfg.rollout
    longest = cfg.data.max_prompt_tokens + r.max_new_tokens
    trainer = cfg.trainer_dims()
    return BenchLayouts(
        ranks=cfg.layout().world_size,
        prompts=r.prompts_per_step,
        samples_per_prompt=r.samples_per_prompt,
        trainer=trainer,
        generator=cfg.generator_dims(),
        sync=replace(trainer, dp=sync_dp),
        max_running=g.max_running,
        micro_batch=max(1, t.max_tokens_per_microbatch // longest),
        recompute=t.recompute_granularity or "none",
        generate_while_waiting=g.generate_while_waiting,
        threads=dict(threads or {}),
        cores=cores,
    ).check()


# -- measured per-sample times -> the planner's tables ---------------------------------------------


def measured_tables(layouts: BenchLayouts, async_t: PhaseTimes, sync_t: PhaseTimes) -> dict:
    """LlamaRL s.7's eta per replica, at the batch each mode ran, as the planner's measured tables
    (trainer records keyed by samples per replica per step: ``ReplicaBatchCosts``)."""
    L = layouts
    return {
        "trainer": [
            {
                "tp": L.trainer.tp,
                "pp": L.trainer.pp,
                "samples_per_replica": L.async_trainer_b,
                "recompute": L.recompute,
                "seconds_per_sample": async_t.train_s / L.async_trainer_b,
            },
            {
                "tp": L.sync.tp,
                "pp": L.sync.pp,
                "samples_per_replica": L.sync_b,
                "recompute": L.recompute,
                "seconds_per_sample": sync_t.train_s / L.sync_b,
            },
        ],
        "generator": [
            {
                "tp": L.generator.tp,
                "pp": 1,
                "b": L.async_generator_b,
                "seconds_per_sample": (async_t.generate_s + async_t.reward_s) / L.samples_per_generator,
            }
        ],
        "sync_generator": [
            {
                "tp": L.sync.tp,
                "pp": L.sync.pp,
                "b": L.sync_b,
                "seconds_per_sample": (sync_t.generate_s + sync_t.reward_s) / L.sync_b,
            }
        ],
    }


class ReplicaBatchCosts(MeasuredCostModel):
    """Measured tables with eta_t keyed by the samples a trainer replica trains per step.

    LlamaRL's eta_t(b) = tau_t(b) / b falls with b as the fixed costs of a step spread over more
    samples. With megarl's token-packed micro-batches the per-step costs that matter -- the
    optimizer step, the DP gradient reduce-scatter and parameter all-gather -- are paid once per
    step per replica, so the batch that sets eta_t is the replica's share of the step, B / dp.
    Trainer records: ``{"tp", "pp", "samples_per_replica", "recompute", "seconds_per_sample"}``,
    the whole per-sample cost (no separate step overhead is added). Generator tables: as
    ``MeasuredCostModel``'s.
    """

    def __init__(self, base, tables: dict):
        tables = dict(tables)
        trainer = tables.pop("trainer", [])
        super().__init__(base, tables)
        self.by_replica_batch: Dict[tuple, float] = {}
        for rec in trainer:
            try:
                key = (
                    int(rec["tp"]),
                    int(rec.get("pp", 1)),
                    int(rec["samples_per_replica"]),
                    str(rec.get("recompute", "none")),
                )
                seconds = float(rec["seconds_per_sample"])
            except (KeyError, TypeError, ValueError) as err:
                raise ConfigError(f"measured.trainer: bad record {rec!r} ({err})") from None
            if not seconds > 0 or min(key[:3]) < 1:
                raise ConfigError(f"measured.trainer: record {rec!r} needs positive tp, pp, samples and seconds")
            self.by_replica_batch[key] = seconds

    def trainer_seconds_per_sample(self, layout, batch: int) -> float:
        d = layout.dims
        key = (d.tp, d.pp, math.ceil(batch / d.dp), layout.recompute)
        if key not in self.by_replica_batch:
            raise ConfigError(
                f"measured.trainer: no time for TP{key[0]} x PP{key[1]} at {key[2]} samples per "
                f"replica ({key[3]} recompute); measured: {sorted(self.by_replica_batch)}"
            )
        return self.by_replica_batch[key]

    def trainer_step_overhead(self, layout) -> float:
        return 0.0  # inside the measured per-sample time


# -- the decomposition -----------------------------------------------------------------------------


@dataclass
class Decomposition:
    """Each mode's steady steps against the planner's composition of their own phase times."""

    layouts: BenchLayouts
    tables: dict
    async_candidate: object  # llamarl_model.AsyncCandidate, priced from the async run's own phases
    sync_candidate: object  # llamarl_model.SyncCandidate, from the sync run's
    measured_async: PhaseTimes
    measured_sync: PhaseTimes

    @property
    def composed_ratio(self) -> float:
        """Async samples/s over sync samples/s as the model composes them: T_sync / T_async."""
        return self.sync_candidate.step_seconds / self.async_candidate.step_seconds

    @property
    def measured_ratio(self) -> float:
        return self.measured_async.samples_per_s / self.measured_sync.samples_per_s

    def to_dict(self) -> dict:
        L, a, s = self.layouts, self.async_candidate, self.sync_candidate
        ma, ms = self.measured_async, self.measured_sync
        bottleneck = "trainer" if a.train_seconds >= a.generate_seconds else "generator"
        if L.generate_while_waiting:  # the generator's time fills the step: whether the trainer waited tells
            bottleneck = "generator" if ma.idle_trainer_s > 0.05 * ma.step_s else "trainer"
        if L.generate_while_waiting:
            eta_g_is = (
                "at most this: with generate_while_waiting the generator decodes ahead until the trainer's "
                "step ends, so its time per step is max(its own work, the trainer's step); T_async = "
                "max(train, generate) is the same either way"
            )
        else:
            eta_g_is = "measured (the generator stops once its batch is ready)"
        r = lambda x: round(x, 4)  # noqa: E731
        return {
            "kind": "decomposition check: the planner's composition of the phase times measured in these same "
            "runs, against their whole steps (not a prediction from other runs)",
            "composed_ratio": r(self.composed_ratio),
            "measured_ratio": r(self.measured_ratio),
            "devices": L.ranks,
            "cores": L.cores,
            "threads": L.threads,
            "async": {
                "layout": f"trainer {L.trainer.describe()} + generator {L.generator.describe()}",
                "steady_steps": ma.steps,
                "b_t": L.async_trainer_b,
                "eta_t": r(a.eta_t),
                "b_g": a.sequences,
                "eta_g": r(a.eta_g),
                "eta_g_is": eta_g_is,
                "train_s": r(a.train_seconds),
                "generate_s": r(a.generate_seconds),
                "weight_sync_s": r(a.weight_sync_seconds),
                "bottleneck": bottleneck,
                "composed_step_s": r(a.step_seconds),
                "measured_step_s": r(ma.step_s),
            },
            "sync": {
                "layout": f"{L.sync.describe()}, every rank generates then trains",
                "steady_steps": ms.steps,
                "b_t": L.sync_b,
                "eta_t": r(s.eta_t),
                "b_g": s.sequences,
                "eta_g": r(s.eta_g),
                "train_s": r(s.train_seconds),
                "generate_s": r(s.generate_seconds),
                "unpriced_copy_s": r(ms.weight_sync_s),
                "composed_step_s": r(s.step_seconds),
                "measured_step_s": r(ms.step_s),
            },
        }


def plan_inputs(layouts: BenchLayouts, spec, prompt_tokens: int, max_new_tokens: int):
    """PlanInputs for the bench's machine: N = its ranks, the run's batch; times come from tables."""
    L = layouts
    return PlanInputs(
        spec=spec,
        gpus=L.ranks,
        gpus_per_node=L.ranks,
        prompts=L.prompts,
        samples_per_prompt=L.samples_per_prompt,
        prompt_tokens=prompt_tokens,
        lengths=LengthDistribution.uniform(1, max_new_tokens),
        gpu_memory_gb=UNBOUNDED_MEMORY_GB,
        trainer_precision="bf16",
        generator_precision="bf16",
        weight_sync="skip",
    ).validate()


def decompose(
    layouts: BenchLayouts,
    async_records: Sequence[dict],
    sync_records: Sequence[dict],
    spec,
    prompt_tokens: int,
    max_new_tokens: int,
) -> Decomposition:
    """The planner's async and sync step times for the layouts that ran, composed from their own steady steps."""
    L = layouts.check()
    measured_async = PhaseTimes.from_records(steady_records(async_records, "async"))
    measured_sync = PhaseTimes.from_records(steady_records(sync_records, "sync"))
    tables = measured_tables(L, measured_async, measured_sync)
    inputs = plan_inputs(L, spec, prompt_tokens, max_new_tokens)
    costs = ReplicaBatchCosts(build_costs(replace(inputs, measured=None)), tables)
    settings = dict(micro_batch=L.micro_batch, recompute=L.recompute)
    a = evaluate_async(
        costs,
        inputs,
        TrainerLayout(L.trainer, **settings),
        planned_generator(L.generator),
        sequences=L.async_generator_b,
    )
    a.weight_sync_seconds, a.weight_sync_method = measured_async.weight_sync_s, "measured"
    s = evaluate_sync(costs, inputs, TrainerLayout(L.sync, **settings))
    if s.sequences != L.sync_b:
        raise ConfigError(f"sync: the planner runs {s.sequences} sequences per replica, the bench {L.sync_b}")
    return Decomposition(L, tables, a, s, measured_async, measured_sync)
