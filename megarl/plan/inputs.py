"""What a plan is asked about: the model, the cluster, the RL batch and the lengths.

``PlanInputs`` is a plain dataclass so a config file (or a test) can build one
without the command line; ``plan_from_inputs`` in ``llamarl_model`` takes it.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

from megarl.errors import ConfigError
from megarl.models.spec import LlamaSpec
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


@dataclass(frozen=True)
class TrainerLayout:
    tp: int
    pp: int
    micro_batch: int = 1  # samples per micro-batch
    recompute: str = "selective"  # selective | full activation recomputation

    @property
    def m(self) -> int:
        return self.tp * self.pp

    def describe(self) -> str:
        return f"TP{self.tp}xPP{self.pp} mb{self.micro_batch} {self.recompute} recompute"


@dataclass(frozen=True)
class GeneratorLayout:
    tp: int
    pp: int = 1

    @property
    def m(self) -> int:
        return self.tp * self.pp

    def describe(self) -> str:
        return f"TP{self.tp}" + (f"xPP{self.pp}" if self.pp > 1 else "")


@dataclass(frozen=True)
class FixedLayout:
    """A layout to evaluate instead of searching (LlamaRL s.7 notation in comments)."""

    trainer: TrainerLayout  # m_t, b_t
    generator: GeneratorLayout  # m_g
    trainer_gpus: int  # theta * N
    generator_batch: Optional[int] = None  # b_g: sequences in flight per replica (None: largest that fits)


@dataclass(frozen=True)
class PlanInputs:
    model: str = "llama3-8b"  # a megarl.models.presets name; ignored when spec is given
    spec: Optional[LlamaSpec] = None
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
    recompute: Tuple[str, ...] = ("selective", "full")

    @property
    def batch(self) -> int:
        return self.prompts * self.samples_per_prompt

    @property
    def hw(self) -> Hardware:
        base = self.hardware or H100
        if base.memory_gb == self.gpu_memory_gb and base.gpus_per_node == self.gpus_per_node:
            return base
        from dataclasses import replace

        return replace(base, memory_gb=self.gpu_memory_gb, gpus_per_node=self.gpus_per_node)

    @property
    def sync_precision(self) -> str:
        return self.sync_generator_precision or self.trainer_precision

    def model_spec(self) -> LlamaSpec:
        if self.spec is not None:
            return self.spec
        from megarl.models.presets import preset_spec

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
        if self.sync_batching not in ("static", "continuous"):
            raise ConfigError(f"sync_batching must be 'static' or 'continuous', got {self.sync_batching!r}")
        if self.weight_sync not in ("predict", "estimate", "skip"):
            raise ConfigError(f"weight_sync must be predict|estimate|skip, got {self.weight_sync!r}")
        if not self.recompute or any(r not in ("selective", "full") for r in self.recompute):
            raise ConfigError(f"recompute={self.recompute!r}: choose from 'selective' and 'full'")
        if not self.max_lag_steps > 0:
            raise ConfigError(f"max_lag_steps must be positive, got {self.max_lag_steps!r}")
        self.hw  # validates the hardware with the overrides
        return self
