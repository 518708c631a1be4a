"""LlamaRL Theorem 7.5 (arXiv 2505.24034, s.7) in its own, abstract setting.

The paper's text was not available to us; this is our reading of s.7, stated
so that it can be checked. N GPUs, B samples per step, M bytes per GPU. A
model replica of m GPUs processes samples at eta_t(m, b) seconds each when
training (micro-batch b) and eta_g(m, b) when generating (b in flight).

Memory, per GPU of a replica of m GPUs (bytes per replica divided over m):
  training               (W_t + b * A_t) / m <= M   W_t: weights + grads + optimizer state
  generating, async      (W_g + b * K_g) / m <= M   W_g: generator weights only
  generating, colocated  (W_t + b * K_g) / m <= M   the trainer's state stays resident

Synchronous: one m for both phases,  T_sync = (m B / N) (eta_g(m, b_g) + eta_t(m, b_t)).
Asynchronous: theta N GPUs train, the rest generate; with theta free in (0, 1)
(the paper's continuous relaxation) the balanced split gives
  T_async = (B / N) (m_t eta_t(m_t, b_t) + m_g eta_g(m_g, b_g)),  theta = m_t eta_t / (m_t eta_t + m_g eta_g).

Theorem 7.5 (as we read it): if eta_g is strictly decreasing in b ("a larger
batch amortises the weight reads": monotonically decreasing per-sample time)
and W_g < W_t (the trainer's state is more than the generator's weights --
always, since it holds gradients and optimizer moments), then
min T_async < min T_sync. Proof (``witness``): take the best synchronous
(m, b_t, b_g); asynchronously keep m and b_t, and generate with the largest b
that fits without the trainer's state, b' > b_g; eta_g(m, b') < eta_g(m, b_g)
so the balanced T_async is strictly smaller. Nothing is assumed about how eta
depends on m. With integer batches strictness needs W_t - W_g >= K_g (room for
one more sequence), which holds by gigabytes in practice. With whole replicas
instead of a continuous theta the inequality can fail for tiny N; the discrete
planner (``llamarl_model``) checks it numerically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

from megarl.errors import ConfigError

Eta = Callable[[int, int], float]


@dataclass(frozen=True)
class AbstractSystem:
    gpus: float  # N
    batch: float  # B
    memory: float  # M, bytes per GPU
    trainer_state: float  # W_t, bytes per replica
    generator_weights: float  # W_g
    activation_per_sample: float  # A_t
    kv_per_sample: float  # K_g
    eta_t: Eta
    eta_g: Eta
    model_parallel: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)
    # Batches tried per m; None: powers of two up to the memory limit, and the limit itself
    # (b is bounded by memory alone, as in s.7).
    batches: Optional[Sequence[int]] = None

    def __post_init__(self):
        for name in ("gpus", "batch", "memory", "trainer_state", "generator_weights"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.generator_weights > self.trainer_state:
            raise ConfigError("generator_weights must not exceed trainer_state (the trainer holds the weights too)")

    def trains(self, m: int, b: int) -> bool:
        return self.trainer_state + b * self.activation_per_sample <= m * self.memory

    def generates(self, m: int, b: int, colocated: bool) -> bool:
        resident = self.trainer_state if colocated else self.generator_weights
        return resident + b * self.kv_per_sample <= m * self.memory

    def candidates(self, m: int, fits) -> List[int]:
        if self.batches is not None:
            return [b for b in self.batches if fits(m, b)]
        if not fits(m, 1):
            return []
        lo = 1
        while fits(m, 2 * lo):
            lo *= 2
        top = 2 * lo  # fits(lo) and not fits(top): bisect for the largest b that fits
        while top - lo > 1:
            mid = (lo + top) // 2
            lo, top = (mid, top) if fits(m, mid) else (lo, mid)
        return sorted({1 << i for i in range(lo.bit_length())} | {lo})

    def _best(self, m: int, fits, eta: Eta) -> Optional[Tuple[float, int]]:
        options = [(eta(m, b), b) for b in self.candidates(m, fits)]
        return min(options) if options else None


@dataclass(frozen=True)
class SyncOptimum:
    seconds: float
    m: int
    b_t: int
    b_g: int


@dataclass(frozen=True)
class AsyncOptimum:
    seconds: float
    theta: float
    m_t: int
    b_t: int
    m_g: int
    b_g: int


def best_sync(s: AbstractSystem) -> Optional[SyncOptimum]:
    best = None
    for m in s.model_parallel:
        train = s._best(m, s.trains, s.eta_t)
        gen = s._best(m, lambda m_, b: s.generates(m_, b, colocated=True), s.eta_g)
        if train and gen:
            seconds = m * s.batch / s.gpus * (train[0] + gen[0])
            if best is None or seconds < best.seconds:
                best = SyncOptimum(seconds, m, train[1], gen[1])
    return best


def balanced(s: AbstractSystem, m_t: int, b_t: int, m_g: int, b_g: int) -> AsyncOptimum:
    """T_async at the theta where trainer and generator take equally long (the optimum over theta)."""
    cost_t, cost_g = m_t * s.eta_t(m_t, b_t), m_g * s.eta_g(m_g, b_g)  # GPU-seconds per sample
    return AsyncOptimum(s.batch / s.gpus * (cost_t + cost_g), cost_t / (cost_t + cost_g), m_t, b_t, m_g, b_g)


def best_async(s: AbstractSystem) -> Optional[AsyncOptimum]:
    # With theta continuous, T_async separates: minimise m * eta for each side on its own.
    trainer = [
        (m * e, m, b)
        for m in s.model_parallel
        for e, b in [s._best(m, s.trains, s.eta_t) or (None, 0)]
        if e is not None
    ]
    gen = [
        (m * e, m, b)
        for m in s.model_parallel
        for e, b in [s._best(m, lambda m_, b_: s.generates(m_, b_, colocated=False), s.eta_g) or (None, 0)]
        if e is not None
    ]
    if not trainer or not gen:
        return None
    _, m_t, b_t = min(trainer)
    _, m_g, b_g = min(gen)
    return balanced(s, m_t, b_t, m_g, b_g)


def witness(s: AbstractSystem, sync: SyncOptimum) -> AsyncOptimum:
    """The proof's construction: the synchronous layout, generating with the freed memory."""
    b_prime = max(s.candidates(sync.m, lambda m, b: s.generates(m, b, colocated=False)))
    return balanced(s, sync.m, sync.b_t, sync.m, b_prime)
