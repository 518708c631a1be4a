"""PipelineRL's throughput-vs-lag analysis (arXiv 2509.19128, Appendix A), reconstructed.

The appendix text was not available to us; this follows the brief's description
and the paper's definitions (conventional RL = generate the data of G optimizer
steps with one policy, then take the G steps; PipelineRL = generation never
stops and weights are swapped in flight). Every assumption is a parameter.

N accelerators, B sequences per optimizer step, lengths L ~ D (mean Lbar, max
Lmax), U(h) = tokens/s of one generation accelerator with h sequences in flight
(each of them advancing at U(h)/h tokens/s), tau = tokens/s of one training
accelerator.

Conventional RL at maximum lag g: G = g + 1 steps per RL step, so Q = G B / N
sequences per accelerator are generated at once by all N, then all N train::

    T_gen   = int_0^Lmax  h(x) / U(h(x)) dx,   h(x) = Q * P(L >= x)   (the batch drains)
    T_train = G B Lbar / (N tau)
    thr_conv(g) = G B Lbar / (T_gen + T_train)

(when Q exceeds the memory cap H_max the engine runs H_max continuously until the
queue empties, then drains). PipelineRL: I accelerators generate with H in
flight each (finished sequences replaced at once), N - I train::

    thr_pipe = min(I U(H), (N - I) tau)
    g = (time to generate the longest sequence) / (time per optimizer step) = Lmax H I / (B Lbar)

maximised over I and H subject to g <= g_max. The speed-up at a lag is
thr_pipe / thr_conv.

Default utilisation: the roofline of the accelerator, U(h) = U_max min(1, h /
h_sat): decode is memory bound (throughput proportional to h) until the batch
reaches the ridge point h_sat = (peak FLOP/s x decode MFU) / (effective HBM
bytes/s) for 2-byte weights, then compute bound at U_max = peak x decode MFU /
(2 P). Training runs at tau = peak x train MFU / (6 P). Both scale with 1/P, so
the speed-up does not depend on the model size; only the MFUs, the ridge point
and the length distribution matter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from megarl.errors import ConfigError
from megarl.plan.hardware import H100, Hardware
from megarl.plan.inputs import LengthDistribution

Utilisation = Callable[[float], float]  # h sequences in flight -> tokens/s of one generation accelerator
INTEGRATION_SEGMENTS = 512
PAPER_CASE = {"gpus": 128, "batch": 128, "g_max": 133, "speedup": 1.57}
DEFAULT_LAGS = (1, 2, 4, 8, 16, 32, 64, 100, 133, 200, 300, 500, 1000)


def roofline_utilisation(peak_tokens_s: float, saturation: float) -> Utilisation:
    if not peak_tokens_s > 0 or not saturation > 0:
        raise ConfigError("roofline utilisation needs positive peak_tokens_s and saturation")
    return lambda h: peak_tokens_s * min(1.0, h / saturation)


def table_utilisation(points: Dict[float, float]) -> Utilisation:
    """Measured tokens/s at some h, linear between them, through (0, 0), flat after the last."""
    pts = sorted((float(h), float(t)) for h, t in points.items())
    if not pts or any(h <= 0 or t <= 0 for h, t in pts):
        raise ConfigError("utilisation table needs positive (in-flight sequences, tokens/s) points")
    pts = [(0.0, 0.0)] + pts

    def u(h: float) -> float:
        for (h0, t0), (h1, t1) in zip(pts, pts[1:]):
            if h <= h1:
                return t0 + (t1 - t0) * (h - h0) / (h1 - h0)
        return pts[-1][1]

    return u


@dataclass(frozen=True)
class AppendixInputs:
    gpus: int = 128
    batch: int = 128
    lengths: LengthDistribution = field(default_factory=lambda: LengthDistribution.uniform(1, 8192))
    params: float = 7.6e9  # only sets the absolute tokens/s (the paper's runs used a 7B model)
    hardware: Hardware = H100
    max_inflight: Optional[float] = None  # memory cap on h per accelerator (None: unbounded)
    utilisation: Optional[Utilisation] = None  # default: the hardware's roofline
    train_tokens_s: Optional[float] = None  # default: peak x train MFU / (6 P)

    def validate(self) -> "AppendixInputs":
        for name in ("gpus", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.gpus < 2:
            raise ConfigError("gpus must be at least 2 (PipelineRL needs a generator and a trainer)")
        if not self.params > 0:
            raise ConfigError(f"params must be positive, got {self.params!r}")
        if self.max_inflight is not None and not self.max_inflight > 0:
            raise ConfigError(f"max_inflight must be positive, got {self.max_inflight!r}")
        if self.train_tokens_s is not None and not self.train_tokens_s > 0:
            raise ConfigError(f"train_tokens_s must be positive, got {self.train_tokens_s!r}")
        return self

    @property
    def saturation(self) -> float:
        hw = self.hardware
        return hw.peak_flops("bf16") * hw.decode_mfu / hw.hbm_bytes_s  # 2 FLOPs and 2 bytes per weight

    @property
    def peak_tokens_s(self) -> float:
        return self.hardware.peak_flops("bf16") * self.hardware.decode_mfu / (2 * self.params)

    @property
    def u(self) -> Utilisation:
        return self.utilisation or roofline_utilisation(self.peak_tokens_s, self.saturation)

    @property
    def tau(self) -> float:
        return self.train_tokens_s or self.hardware.peak_flops("bf16") * self.hardware.train_mfu / (6 * self.params)


@dataclass(frozen=True)
class Conventional:
    lag: int
    steps_per_rl_step: int  # G
    inflight: float  # Q, sequences per accelerator
    generate_seconds: float
    train_seconds: float
    tokens_s: float


@dataclass(frozen=True)
class Pipeline:
    lag: float
    generator_gpus: int  # I
    inflight: float  # H
    tokens_s: float


def _drain_seconds(a: AppendixInputs, sequences: float) -> float:
    """Seconds for `sequences` started together on one accelerator to all finish."""
    u, lengths = a.u, a.lengths
    top = lengths.max
    n = min(INTEGRATION_SEGMENTS, top)
    total, prev = 0.0, 0.0
    for i in range(1, n + 1):
        x = top * i / n
        h = sequences * lengths.survival((prev + x) / 2)
        if h > 0:
            total += (x - prev) * h / u(h)
        prev = x
    return total


def conventional(a: AppendixInputs, g_max: int) -> Conventional:
    steps = g_max + 1
    q = steps * a.batch / a.gpus
    cap = a.max_inflight
    if cap is not None and q > cap:  # queue drains at the capped concurrency, then the tail
        generate = (q - cap) * a.lengths.mean / a.u(cap) + _drain_seconds(a, cap)
    else:
        generate = _drain_seconds(a, q)
    tokens = steps * a.batch * a.lengths.mean
    train = tokens / (a.gpus * a.tau)
    return Conventional(g_max, steps, q, generate, train, tokens / (generate + train))


def pipeline(a: AppendixInputs, g_max: float) -> Pipeline:
    best = None
    ratio = a.lengths.max / a.lengths.mean
    for gens in range(1, a.gpus):
        h = g_max * a.batch / (ratio * gens)  # the largest H whose longest sequence stays within g_max
        if a.max_inflight is not None:
            h = min(h, a.max_inflight)
        rate = min(gens * a.u(h), (a.gpus - gens) * a.tau)
        if best is None or rate > best.tokens_s:
            best = Pipeline(ratio * h * gens / a.batch, gens, h, rate)
    return best


@dataclass(frozen=True)
class LagRow:
    g_max: float
    conventional: Conventional
    pipeline: Pipeline

    @property
    def speedup(self) -> float:
        return self.pipeline.tokens_s / self.conventional.tokens_s


def speedup_curve(a: AppendixInputs, lags: Sequence[int] = DEFAULT_LAGS) -> List[LagRow]:
    a.validate()
    for g in lags:
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise ConfigError(f"lags must be non-negative integers, got {g!r}")
    return [LagRow(g, conventional(a, g), pipeline(a, g)) for g in lags]


def ideal_tokens_s(a: AppendixInputs) -> float:
    """Both sides busy all the time at full utilisation: N / (1/U_max + 1/tau)."""
    top = a.u(a.max_inflight if a.max_inflight is not None else 1e12)
    return a.gpus / (1 / top + 1 / a.tau)


def knee_lag(a: AppendixInputs, fraction: float = 0.99) -> int:
    """The smallest lag at which PipelineRL reaches `fraction` of its ideal throughput."""
    target = fraction * ideal_tokens_s(a)
    lo, hi = 0, 1
    while pipeline(a, hi).tokens_s < target:
        lo, hi = hi, hi * 2
        if hi > 1 << 24:
            raise ConfigError("PipelineRL never reaches its ideal throughput (utilisation never saturates)")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pipeline(a, mid).tokens_s >= target else (mid, hi)
    return hi
