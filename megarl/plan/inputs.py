"""What a plan is asked about: the model, the cluster, the RL batch and the lengths.

``PlanInputs`` is a plain dataclass so a config file (or a test) can build one
without the command line; ``plan_from_inputs`` in ``llamarl_model`` takes it.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence, Tuple

from megarl.errors import ConfigError
from megarl.models.presets import preset_spec
from megarl.models.spec import ModelSpec
from megarl.parallel_dims import GeneratorDims, ParallelDims
from megarl.plan.hardware import H100, WEIGHT_BYTES, Hardware


def _positive_int(value, field_name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{field_name} must be a positive integer, got {value!r}")
    return value


@dataclass(frozen=True)
class LengthDistribution:
    """Generated tokens per response: uniform on [low, high] (constant when equal), or empirical.

    Both papers' arguments turn on this distribution: a synchronous batch waits
    for its longest response while the GPUs drain (PipelineRL App. A), and the
    lag of a streamed sequence scales with max/mean length.
    """

    low: int = 512
    high: int = 4096
    values: Tuple[int, ...] = ()  # empirical lengths, equally likely; overrides low/high

    def __post_init__(self):
        if self.values:
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in self.values):
                raise ConfigError("response length values must be positive integers")
            object.__setattr__(self, "values", tuple(sorted(self.values)))
        else:
            _positive_int(self.low, "response_tokens_min")
            _positive_int(self.high, "response_tokens_max")
            if self.low > self.high:
                raise ConfigError(f"response_tokens_min={self.low} is above response_tokens_max={self.high}")

    @classmethod
    def uniform(cls, low: int, high: int) -> "LengthDistribution":
        return cls(low, high)

    @classmethod
    def constant(cls, n: int) -> "LengthDistribution":
        return cls(n, n)

    @classmethod
    def empirical(cls, values: Sequence[int]) -> "LengthDistribution":
        if not values:
            raise ConfigError("an empirical length distribution needs at least one length")
        return cls(values=tuple(values))

    @classmethod
    def truncated_exponential(cls, mean: float, cap: int, low: int = 128, points: int = 1024) -> "LengthDistribution":
        """Right-skewed lengths (most responses short, a few run to the cap), as RL responses are:
        quantiles of low + Exp(scale) capped at `cap`, the scale solved so the capped mean is `mean`."""
        _positive_int(cap, "response_tokens_max")
        if not low < mean < cap:
            raise ConfigError(f"response_tokens_mean={mean} must lie between {low} and response_tokens_max={cap}")
        quantiles = [-math.log(1 - (i + 0.5) / points) for i in range(points)]
        values = lambda scale: [min(cap, int(low + scale * q)) for q in quantiles]  # noqa: E731
        lo, hi = 0.0, float(cap)
        for _ in range(60):  # the capped mean grows with the scale
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if sum(values(mid)) / points < mean else (lo, mid)
        return cls(values=tuple(values(hi)))

    @property
    def max(self) -> int:
        return self.values[-1] if self.values else self.high

    @property
    def mean(self) -> float:
        if self.values:
            return sum(self.values) / len(self.values)
        return (self.low + self.high) / 2

    @property
    def second_moment(self) -> float:
        if self.values:
            return sum(v * v for v in self.values) / len(self.values)
        return _uniform_m2(self.low, self.high)

    def survival(self, s: float) -> float:
        """P(length >= s): the fraction of a batch still generating at decode step s."""
        if self.values:
            return 1.0 - bisect.bisect_left(self.values, s) / len(self.values)
        if s <= self.low:
            return 1.0
        if s > self.high:
            return 0.0
        return (self.high - s + 1) / (self.high - self.low + 1)

    def quantile(self, p: float) -> int:
        """The length below which a fraction p of responses fall (0 < p < 1)."""
        if self.values:
            return self.values[min(len(self.values) - 1, int(p * len(self.values)))]
        return min(self.high, self.low + int(p * (self.high - self.low + 1)))

    @property
    def mean_inflight_position(self) -> float:
        """Mean decode position of a sequence in a continuously refilled batch: E[L^2] / (2 E[L])."""
        return self.second_moment / (2 * self.mean)

    def describe(self) -> str:
        if self.values:
            return f"empirical ({len(self.values)} lengths, mean {self.mean:.0f}, max {self.max})"
        if self.low == self.high:
            return f"constant {self.low}"
        return f"uniform [{self.low}, {self.high}] (mean {self.mean:.0f})"


def _uniform_m2(low: int, high: int) -> float:
    # E[L^2] of the discrete uniform on [low, high]
    n = high - low + 1
    s2 = lambda k: k * (k + 1) * (2 * k + 1) / 6  # noqa: E731
    return (s2(high) - s2(low - 1)) / n


RECOMPUTE = ("none", "selective", "full")  # Megatron's recompute_granularity (None spelled "none")
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")  # the selective modules a dense Llama has


@dataclass(frozen=True)
class TrainerLayout:
    """A trainer's parallel dimensions (``ParallelDims``: TP, PP, CP, VPP and the DP replicas its
    GPUs hold) and its activation settings, by Megatron-LM's names.

    The search builds one replica's layout (DP 1) and prices it on every GPU count with
    ``on_gpus``, which sets the DP that count implies. The defaults are the search's (sequence
    parallel wherever TP > 1, Megatron's selective default); a run config's layout sets every
    field from trainer.* (``config_plan.trainer_layout``).
    """

    dims: ParallelDims
    micro_batch: int = 1  # samples per micro-batch (each up to the longest sample)
    recompute: str = "selective"  # none | selective | full
    sequence_parallel: bool = True  # only meaningful with tp > 1 (Megatron turns it off at TP1)
    recompute_method: Optional[str] = None  # full: uniform | block (None: uniform)
    recompute_num_layers: Optional[int] = None  # full: layers per group (uniform) / per stage (block); None: 1
    recompute_modules: Tuple[str, ...] = ("core_attn",)  # selective: Megatron's default
    # Tokens a packed micro-batch holds (trainer.max_tokens_per_microbatch); None: micro_batch x longest sample
    micro_batch_tokens: Optional[int] = None

    @property
    def m(self) -> int:
        """GPUs of one replica (LlamaRL's m): TP x PP x CP (CP ranks hold the same weights but split the tokens)."""
        return self.dims.world_size // self.dims.dp

    @property
    def gpu_unit(self) -> int:
        """Trainer GPU counts are multiples of this: whole replicas (m), and pipeline stages of whole
        EP x ETP groups (Megatron-Core carves expert parallelism out of a stage's TP x CP x DP ranks)."""
        d = self.dims
        expert_stage = d.pp * d.ep * d.expert_tp
        return self.m * expert_stage // math.gcd(self.m, expert_stage)

    @property
    def gpus(self) -> int:
        return self.dims.world_size

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.dims.tp > 1

    def on_gpus(self, gpus: int, field: str = "trainer GPUs") -> "TrainerLayout":
        """The same replica layout data-parallel over ``gpus`` GPUs."""
        if gpus < self.m or gpus % self.m:
            raise ConfigError(f"{field}={gpus} is not a multiple of trainer TP x PP x CP = {self.m}")
        if gpus % self.gpu_unit:
            d = self.dims
            raise ConfigError(
                f"{field}={gpus}: trainer EP{d.ep} x ETP{d.expert_tp} must divide each of the PP{d.pp} stages' "
                f"ranks; use a multiple of {self.gpu_unit} GPUs"
            )
        return replace(self, dims=replace(self.dims, dp=gpus // self.m))

    def recompute_text(self) -> str:
        if self.recompute == "full":
            return f"full recompute ({self.recompute_method or 'uniform'} {self.recompute_num_layers or 1})"
        if self.recompute == "selective":
            return f"selective recompute ({'+'.join(self.recompute_modules) or 'nothing'})"
        return "no recompute"

    def describe(self) -> str:
        """One replica: its model-parallel shape and settings (the DP size is printed beside it)."""
        d = self.dims
        shape = f"TP{d.tp}xPP{d.pp}" + (f"xCP{d.cp}" if d.cp > 1 else "")
        shape += f"xEP{d.ep}" + (f"xETP{d.expert_tp}" if d.expert_tp != d.tp else "") if d.ep > 1 else ""
        shape += f" VPP{d.vpp}" if d.vpp > 1 else ""
        return f"{shape}{' SP' if self.sp else ''} mb{self.micro_batch} {self.recompute_text()}"


def replica_layout(
    tp: int, pp: int = 1, micro_batch: int = 1, recompute: str = "selective", cp: int = 1, vpp: int = 1, **settings
) -> TrainerLayout:
    """One trainer replica (DP 1) at TP x PP (x CP, VPP) with these settings: what the search enumerates."""
    return TrainerLayout(ParallelDims(tp=tp, pp=pp, cp=cp, vpp=vpp), micro_batch, recompute, **settings)


@dataclass(frozen=True)
class TrainerOptions:
    """Trainer settings that are not a layout: where the weight/grad/optimizer state lives and what
    overlaps. Defaults are megarl's trainer (Megatron DDP + distributed optimizer, fp32 grads)."""

    # optimizer: Megatron's distributed optimizer (Adam state sharded over DP x CP, ZeRO-1);
    # none: every DP rank keeps the whole state; fsdp: weights, grads and optimizer state sharded
    # over DP x CP (LlamaRL's FSDP trainer; megarl's trainer does not run it)
    state_sharding: str = "optimizer"
    optimizer_bytes: float = 12.0  # per parameter: Adam = fp32 master + exp_avg + exp_avg_sq
    grad_bytes: float = 4.0  # megarl's DDP reduces gradients in fp32 (grad_reduce_in_fp32=True)
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # Megatron-LM's --transformer-impl: transformer_engine (fused attention, norms fused into the
    # linears; what megarl builds wherever TE imports) | local (unfused attention keeps its scores)
    transformer_impl: str = "transformer_engine"

    def validate(self) -> "TrainerOptions":
        if self.state_sharding not in ("optimizer", "none", "fsdp"):
            raise ConfigError(f"state_sharding={self.state_sharding!r}: choose optimizer, none or fsdp")
        if self.transformer_impl not in ("transformer_engine", "local"):
            raise ConfigError(f"transformer_impl={self.transformer_impl!r}: choose transformer_engine or local")
        for name in ("optimizer_bytes", "grad_bytes"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        return self


def check_trainer_layout(layout: TrainerLayout, options: TrainerOptions, field: str = "layout.trainer") -> None:
    """Refuse a layout the cost model cannot price, naming the field."""
    if layout.recompute not in RECOMPUTE:
        raise ConfigError(f"{field}.recompute must be one of {RECOMPUTE}, got {layout.recompute!r}")
    _positive_int(layout.micro_batch, f"{field}.micro_batch")  # the dimensions: ParallelDims checked them
    if layout.recompute == "full":
        if (layout.recompute_method or "uniform") not in ("uniform", "block"):
            raise ConfigError(f"{field}.recompute_method must be uniform or block, got {layout.recompute_method!r}")
        n = layout.recompute_num_layers
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ConfigError(f"{field}.recompute_num_layers must be a non-negative integer, got {n!r}")
    unknown = [m for m in layout.recompute_modules if m not in RECOMPUTE_MODULES]
    if layout.recompute == "selective" and unknown:
        raise ConfigError(
            f"{field}.recompute_modules: {unknown[0]!r} is not priced for a dense Llama; "
            f"choose from {list(RECOMPUTE_MODULES)}"
        )
    if layout.sp and options.transformer_impl != "transformer_engine":
        raise ConfigError(f"{field}.sequence_parallel needs transformer_impl=transformer_engine")


def generator_dims(tp: int, gpus: int, pp: int = 1, field: str = "generator") -> ParallelDims:
    """The generators the planner prices: ``gpus`` GPUs of replicas of TP x PP GPUs each, as a
    ParallelDims whose DP is the replica count (a replica serves its own prompts).

    megarl's generators are ``GeneratorDims`` (SGLang TP replicas, no pipeline); the planner also
    prices a pipelined replica (PP > 1) where the weights do not fit on one node's GPUs (405B
    generating in bf16, e.g. Theorem 7.5's setting), and the colocated baseline generates on the
    trainer's own TP x PP shards, so its generators are described by the more general type.
    ``runtime_generator`` turns one back into megarl's ``GeneratorDims``."""
    replica = ParallelDims(tp=tp, pp=pp, section="generator")  # checks tp and pp
    m = replica.world_size
    if gpus < m or gpus % m:
        raise ConfigError(f"{field}: {gpus} generator GPUs are not a multiple of generator TP x PP = {m}")
    return replace(replica, dp=gpus // m)


def planned_generator(g: GeneratorDims) -> ParallelDims:
    """megarl's generators (a run config's ``generator_dims()``) in the planner's terms."""
    return ParallelDims(tp=g.tp, dp=g.replicas, section=g.section)


def runtime_generator(g: ParallelDims) -> GeneratorDims:
    """The planner's generators as megarl runs them; a pipelined replica is refused."""
    if g.pp > 1 or g.cp > 1 or g.vpp > 1:
        raise ConfigError(
            f"generator {generator_text(g)}: megarl's generators are SGLang TP replicas (GeneratorDims: "
            f"tp, replicas), no pipeline or context parallelism"
        )
    return GeneratorDims(tp=g.tp, replicas=g.dp)


def generator_text(g: ParallelDims) -> str:
    """One generator replica's shape: TP8, or TP8xPP2 when pipelined."""
    return f"TP{g.tp}" + (f"xPP{g.pp}" if g.pp > 1 else "")


@dataclass(frozen=True)
class FixedLayout:
    """A layout to evaluate instead of searching (LlamaRL s.7 notation in comments): its trainer's
    and generators' GPUs together are ``PlanInputs.gpus``."""

    trainer: TrainerLayout  # m_t, b_t; dims.dp replicas over theta * N GPUs
    generator: ParallelDims  # m_g = TP x PP, dp = replicas over (1 - theta) N GPUs (``generator_dims``)
    generator_batch: Optional[int] = None  # b_g: sequences in flight per replica (None: largest that fits)


@dataclass(frozen=True)
class PlanInputs:
    model: str = "llama3-8b"  # a megarl.models.presets name; ignored when spec is given
    spec: Optional[ModelSpec] = None
    gpus: int = 256
    gpus_per_node: int = 8
    prompts: int = 512
    samples_per_prompt: int = 4
    prompt_tokens: int = 512
    lengths: LengthDistribution = field(default_factory=LengthDistribution)
    gpu_memory_gb: float = 80.0
    trainer_precision: str = "bf16"
    generator_precision: str = "fp8"
    # The synchronous baseline generates with the trainer's weights: in its precision
    # unless told otherwise (LlamaRL's DeepSpeed-Chat-like baseline, Table 3).
    sync_generator_precision: Optional[str] = None
    # A synchronous step starts all its samples at once and waits for the longest
    # ("static"); "continuous" prices it with the same per-sample time as the
    # asynchronous generator, which is Theorem 7.5's setting.
    sync_batching: str = "static"
    # How the asynchronous generator batches: "continuous" (megarl: a finished sequence is replaced
    # at once, decoding goes on across steps) or "static" (LlamaRL: each step's batch is generated
    # by one policy version and the replica waits for its longest response).
    async_batching: str = "continuous"
    # The colocated baseline keeps grads and optimizer states on the GPU while generating.
    sync_offload_trainer_state: bool = False
    # Generator sequences in flight, in units of the step's batch (LlamaRL: one step off-policy).
    max_lag_steps: float = 1.0
    layout: Optional[FixedLayout] = None
    measured: Optional[str] = None  # JSON file of measured seconds/sample (see measured.py)
    weight_sync: str = "estimate"  # predict (megarl.weight_sync planner) | estimate | skip
    hardware: Optional[Hardware] = None
    max_pp: int = 16
    # Also search PP sizes that split the layers unevenly (e.g. PP16 over 405B's 126 layers):
    # Megatron can run them, megarl's check_parallelism cannot, so only on request.
    uneven_pp: bool = False
    # megarl's asynchronous loop gives every generator replica an equal share of a step's
    # prompts (config: prompts_per_step % replicas == 0); set to search only such splits.
    equal_prompt_shares: bool = False
    # Activation recomputation the search may choose (a run config names the one its trainer runs).
    recompute: Tuple[str, ...] = RECOMPUTE
    # Search interleaved pipelines too (vpp up to this many chunks per PP rank, dividing its layers).
    max_vpp: int = 4
    trainer_options: TrainerOptions = field(default_factory=TrainerOptions)
    # The engine that generates: sglang (paged KV pool, fp8 kernels, CUDA graphs) or torch
    # (megarl's reference engine: preallocated KV slots, fp8 dequantised per matmul, eager)
    generator_backend: str = "sglang"
    generator_mem_fraction: float = 0.85  # sglang: --mem-fraction-static (weights + KV pool)
    generator_dtype: str = "bf16"  # torch: the dtype fp8 weights are dequantised into and the KV cache's
    generator_max_seq_len: Optional[int] = None  # torch: KV slot length (default prompt + longest response)
    # The colocated baseline generates from its own copy of the weights (a DeepSpeed-Chat-like hybrid
    # engine; LlamaRL's eq. (6): 4 W0 + W0), not from the trainer's tensors in place.
    sync_separate_generator_copy: bool = False
    # The baseline's layout when it is given (LlamaRL's 405B baseline: mp_size 64), not searched;
    # its dims span all the GPUs (dp = gpus / m).
    sync_layout: Optional[TrainerLayout] = None

    @property
    def batch(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def hw(self) -> Hardware:
        base = self.hardware or H100
        if base.memory_gb == self.gpu_memory_gb and base.gpus_per_node == self.gpus_per_node:
            return base
        return replace(base, memory_gb=self.gpu_memory_gb, gpus_per_node=self.gpus_per_node)

    @property
    def sync_precision(self) -> str:
        return self.sync_generator_precision or self.trainer_precision

    def model_spec(self) -> ModelSpec:
        if self.spec is not None:
            return self.spec
        return preset_spec(self.model)

    def validate(self) -> "PlanInputs":
        for name in ("gpus", "gpus_per_node", "prompts", "samples_per_prompt", "prompt_tokens", "max_pp"):
            _positive_int(getattr(self, name), name)
        if self.gpus % self.gpus_per_node and self.gpus > self.gpus_per_node:
            raise ConfigError(f"gpus={self.gpus} is not a whole number of nodes of gpus_per_node={self.gpus_per_node}")
        if not self.gpu_memory_gb > 0:
            raise ConfigError(f"gpu_memory_gb must be positive, got {self.gpu_memory_gb!r}")
        for name in ("trainer_precision", "generator_precision", "sync_precision"):
            if getattr(self, name) not in WEIGHT_BYTES:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not one of {sorted(WEIGHT_BYTES)}")
        if self.trainer_precision == "fp8":
            raise ConfigError("trainer_precision='fp8' is not supported: megarl trains in bf16")
        for name in ("sync_batching", "async_batching"):
            if getattr(self, name) not in ("static", "continuous"):
                raise ConfigError(f"{name} must be 'static' or 'continuous', got {getattr(self, name)!r}")
        if self.weight_sync not in ("predict", "estimate", "skip"):
            raise ConfigError(f"weight_sync must be predict|estimate|skip, got {self.weight_sync!r}")
        if not self.recompute or any(r not in RECOMPUTE for r in self.recompute):
            raise ConfigError(f"recompute={self.recompute!r}: choose from {RECOMPUTE}")
        _positive_int(self.max_vpp, "max_vpp")
        self.trainer_options.validate()
        if self.generator_backend not in ("sglang", "torch"):
            raise ConfigError(f"generator_backend={self.generator_backend!r}: choose sglang or torch")
        if not 0 < self.generator_mem_fraction < 1:
            raise ConfigError(f"generator_mem_fraction must be in (0, 1), got {self.generator_mem_fraction!r}")
        if self.generator_dtype not in ("bf16", "fp16"):
            raise ConfigError(f"generator_dtype={self.generator_dtype!r}: the planner prices a bf16 engine")
        if self.generator_max_seq_len is not None:
            _positive_int(self.generator_max_seq_len, "generator_max_seq_len")
        if not self.max_lag_steps > 0:
            raise ConfigError(f"max_lag_steps must be positive, got {self.max_lag_steps!r}")
        _ = self.hw  # validates the hardware with the overrides
        return self
