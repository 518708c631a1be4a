"""Per-sample times (LlamaRL s.7's eta_t, eta_g) and per-GPU memory on an H100-class GPU.

Trainer (Megatron-Core, bf16, distributed optimizer): 6 FLOPs per matmul
parameter per token (8 with full activation recomputation) plus causal
attention, at ``train_mfu``; the TP all-reduces (4 per layer per micro-batch,
over NVLink within a node, the network beyond) partly exposed; the 1F1B
pipeline bubble (pp - 1) / micro-batches; the data-parallel gradient
reduce-scatter + parameter all-gather once per step.

Generator (SGLang-class decode): memory-bandwidth bound. Each decode step a
GPU streams its weight shard (fp8: 1 byte/param, bf16: 2) plus the KV cache of
its sequences, with a compute floor at large batch, two TP all-reduces per
layer and a fixed per-step overhead; the weight read is shared by the h
sequences in flight, so the per-sample time falls with h. With pipeline
parallelism a step passes through every stage (micro-batches keep stages busy
but each stage re-reads its weights per micro-batch).

Memory: trainer = weights (2 B/param) + fp32 grads (4 B) + Adam (fp32 master +
2 moments = 12 B, sharded over DP) + activations; generator = weights + KV
cache; the colocated synchronous baseline keeps the trainer's state resident
while it generates. A layout that does not fit names the part that overflows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional

from megarl.models.spec import LlamaSpec
from megarl.plan.hardware import GB, Hardware, weight_bytes
from megarl.plan.inputs import GeneratorLayout, LengthDistribution, TrainerLayout

ADAM_BYTES = 12.0  # fp32 master weights + exp_avg + exp_avg_sq
TRAIN_WEIGHT_BYTES = 2.0  # bf16 parameters
KV_BYTES = 2.0  # bf16 KV cache (SGLang keeps a bf16 cache with fp8 weights by default)
# Activation bytes per token per layer kept for backward with sequence parallelism and
# selective recomputation (Korthikanti et al. 2022: 34 h / tp); full recomputation keeps
# only each layer's input (2 h / tp) and rebuilds one layer at a time.
SELECTIVE_ACT_BYTES_PER_HIDDEN = 34.0
FULL_ACT_BYTES_PER_HIDDEN = 2.0
DRAIN_SEGMENTS = 64  # resolution of the static-batch drain integral


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    linear_params: int  # all transformer-layer matmul weights
    embedding_params: int  # one V x h matrix
    tied: bool

    @classmethod
    def from_spec(cls, spec: LlamaSpec) -> "ModelShape":
        h = spec.hidden_size
        per_layer = spec.qkv_rows * h + spec.num_attention_heads * spec.head_dim * h + 3 * h * spec.ffn_hidden_size
        return cls(spec.num_layers, h, spec.num_attention_heads, spec.num_kv_heads, spec.head_dim,
                   spec.vocab_size, spec.num_layers * per_layer, spec.vocab_size * h, spec.tie_embeddings)

    @property
    def params(self) -> int:
        return self.linear_params + self.embedding_params * (1 if self.tied else 2)

    @property
    def matmul_params(self) -> int:
        """Parameters multiplied per token: the layers and the output layer (the input embedding is a lookup)."""
        return self.linear_params + self.embedding_params

    def stage_layers(self, pp: int) -> int:
        """Layers of the largest pipeline stage. Megatron splits unevenly when pp does not divide
        the layers (num_layers_in_first/last_pipeline_stage), as Llama 3 405B's PP16 over 126 layers."""
        return -(-self.layers // pp)

    def stage_params(self, pp: int) -> float:
        """Parameters of the largest pipeline stage (its layers plus an embedding matrix)."""
        if pp == 1:
            return self.params
        return self.linear_params * self.stage_layers(pp) / self.layers + self.embedding_params


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int
    lengths: LengthDistribution

    @property
    def mean_tokens(self) -> float:
        return self.prompt_tokens + self.lengths.mean

    @property
    def max_tokens(self) -> int:
        return self.prompt_tokens + self.lengths.max

    @property
    def mean_square_tokens(self) -> float:
        p = self.prompt_tokens
        return p * p + 2 * p * self.lengths.mean + self.lengths.second_moment

    @property
    def steady_context(self) -> float:
        """Mean context of a sequence in a continuously refilled decode batch."""
        return self.prompt_tokens + self.lengths.mean_inflight_position


@dataclass
class MemoryBreakdown:
    """Per-GPU bytes by part, in the order they are allocated; names the part that overflows."""

    role: str
    layout: str
    capacity: float  # bytes of one GPU
    parts: Dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def overflow(self) -> Optional[str]:
        """The part during whose allocation the GPU runs out (None when everything fits)."""
        used = 0.0
        for name, size in self.parts.items():
            used += size
            if used > self.capacity:
                return name
        return None

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in self.parts.items())
        head = f"{self.role} {self.layout}: {self.total / GB:.1f} of {self.capacity / GB:.0f} GB ({parts})"
        if self.fits:
            return head
        return f"{head}: does not fit, {self.overflow} overflows"


class H100CostModel:
    """The default eta_t / eta_g and memory model; every constant comes from ``Hardware``."""

    def __init__(self, spec: LlamaSpec, hw: Hardware, workload: Workload, grad_bytes: float = 4.0):
        self.spec, self.hw, self.work = spec, hw, workload
        self.shape = ModelShape.from_spec(spec)
        self.grad_bytes = grad_bytes  # megarl's DDP reduces gradients in fp32 (grad_reduce_in_fp32=True)

    # -- trainer ------------------------------------------------------------------------------

    def trainer_memory(self, layout: TrainerLayout, dp: int, batch: int) -> MemoryBreakdown:
        s, hw = self.shape, self.hw
        stage = s.stage_params(layout.pp) / layout.tp
        micro_batches = math.ceil(math.ceil(batch / dp) / layout.micro_batch)
        tokens = layout.micro_batch * self.work.max_tokens  # a micro-batch may hold the longest sample
        in_flight = min(layout.pp, micro_batches)  # 1F1B: stage 0 holds pp micro-batches
        per_layer = (FULL_ACT_BYTES_PER_HIDDEN if layout.recompute == "full" else SELECTIVE_ACT_BYTES_PER_HIDDEN)
        activations = tokens * s.stage_layers(layout.pp) * in_flight * per_layer * s.hidden / layout.tp
        if layout.recompute == "full":
            activations += tokens * SELECTIVE_ACT_BYTES_PER_HIDDEN * s.hidden / layout.tp  # the layer being rebuilt
        activations += tokens * s.vocab / layout.tp * 4.0  # fp32 logits chunk for the log-probs (last stage)
        return MemoryBreakdown("trainer", layout.describe(), hw.memory_gb * GB, {
            "reserved": hw.reserved_gb * GB,
            "weights": TRAIN_WEIGHT_BYTES * stage,
            "grads": self.grad_bytes * stage,
            "optimizer": ADAM_BYTES * stage / dp,
            "activations": activations,
        })

    def trainer_seconds_per_sample(self, layout: TrainerLayout, dp: int, batch: int) -> float:
        """eta_t: seconds of one model replica (tp x pp GPUs) per sample, pipeline bubble included."""
        s, hw, w = self.shape, self.hw, self.work
        passes = 4.0 if layout.recompute == "full" else 3.0  # forward + backward (2x) [+ recomputed forward]
        flops = passes * 2.0 * (s.matmul_params * w.mean_tokens + s.layers * s.hidden * w.mean_square_tokens)
        imbalance = s.stage_layers(layout.pp) * layout.pp / s.layers  # the largest stage sets the pace
        compute = flops * imbalance / (layout.m * hw.peak_flops("bf16") * hw.train_mfu)
        comm = 0.0
        if layout.tp > 1:
            message = w.mean_tokens * s.hidden * 2.0  # bf16 activations of one sample
            ring = 2.0 * (layout.tp - 1) / layout.tp
            per_layer = (passes + 1) * ring * message / hw.link_bytes_s(layout.tp)  # 2 fwd + 2 bwd (+2 recompute)
            comm = s.stage_layers(layout.pp) * per_layer * hw.tp_comm_exposed
        micro_batches = math.ceil(math.ceil(batch / dp) / layout.micro_batch)
        bubble = 1.0 + (layout.pp - 1) / micro_batches
        return (compute + comm) * bubble

    def trainer_step_overhead(self, layout: TrainerLayout, dp: int) -> float:
        """Once per step: the distributed optimizer's fp32 grad reduce-scatter + bf16 param all-gather."""
        if dp == 1:
            return 0.0
        hw = self.hw
        shard = self.shape.stage_params(layout.pp) / layout.tp
        volume = (dp - 1) / dp * (self.grad_bytes + TRAIN_WEIGHT_BYTES) * shard
        return volume / hw.link_bytes_s(dp * layout.m) * hw.dp_comm_exposed

    # -- generator ----------------------------------------------------------------------------

    def kv_bytes_per_token(self, layout: GeneratorLayout) -> float:
        s = self.shape
        heads_per_rank = max(1.0, s.kv_heads / layout.tp)  # replicated when tp > kv heads
        return 2.0 * s.stage_layers(layout.pp) * heads_per_rank * s.head_dim * KV_BYTES

    def generator_weight_bytes(self, layout: GeneratorLayout, precision: str) -> float:
        s = self.shape
        linear = s.linear_params * s.stage_layers(layout.pp) / s.layers / layout.tp
        linear *= weight_bytes(precision, "generator_precision")
        matrices = (1 if s.tied else 2) if layout.pp == 1 else 1
        return linear + matrices * s.embedding_params * 2.0 / layout.tp  # embeddings stay bf16

    def generator_memory(self, layout: GeneratorLayout, precision: str, sequences: float, mode: str,
                         resident: Optional[Dict[str, float]] = None) -> MemoryBreakdown:
        """Per GPU: weights + KV of `sequences` in flight (+ a colocated trainer's resident state)."""
        parts = {"reserved": self.hw.reserved_gb * GB}
        if resident:
            parts.update(resident)  # the colocated trainer's weights double as the generator's
        else:
            parts["weights"] = self.generator_weight_bytes(layout, precision)
        parts["kv_cache"] = sequences * self._kv_tokens_per_sequence(mode) * self.kv_bytes_per_token(layout)
        role = "colocated generator" if resident else "generator"
        return MemoryBreakdown(role, f"{layout.describe()} {precision} x{sequences:g}", self.hw.memory_gb * GB, parts)

    def _kv_tokens_per_sequence(self, mode: str) -> float:
        w = self.work
        if mode == "continuous":
            return w.steady_context
        # static batch: the peak over decode steps of (fraction still running) x context
        return max(w.lengths.survival(step) * (w.prompt_tokens + step) for step in _drain_points(w.lengths))

    def max_sequences(self, layout: GeneratorLayout, precision: str, mode: str,
                      resident: Optional[Dict[str, float]] = None) -> int:
        empty = self.generator_memory(layout, precision, 0, mode, resident)
        room = empty.capacity - empty.total
        per_sequence = self._kv_tokens_per_sequence(mode) * self.kv_bytes_per_token(layout)
        return max(0, int(room // per_sequence))

    def decode_step_seconds(self, layout: GeneratorLayout, precision: str, sequences: float, context: float) -> float:
        """One decode step of a replica: every one of `sequences` advances one token."""
        s, hw = self.shape, self.hw
        sequences = max(sequences, 1e-9)
        micro = sequences / min(layout.pp, max(sequences, 1.0))  # sequences per pipeline micro-batch
        q = weight_bytes(precision, "generator_precision")
        stage_linear = s.linear_params * s.stage_layers(layout.pp) / s.layers / layout.tp
        read = stage_linear * q + s.embedding_params * 2.0 / layout.tp  # the last stage also reads lm_head
        kv = micro * context * self.kv_bytes_per_token(layout)
        memory = (read + kv) / hw.hbm_bytes_s
        flops = 2.0 * micro * (stage_linear + s.embedding_params / layout.tp)
        flops += 4.0 * micro * context * s.head_dim * s.heads / layout.tp * s.stage_layers(layout.pp)
        compute = flops / (hw.peak_flops(precision) * hw.decode_mfu)
        comm = 0.0
        if layout.tp > 1:
            ring = 2.0 * (layout.tp - 1) / layout.tp
            one = hw.allreduce_latency_s(layout.tp) + ring * micro * s.hidden * 2.0 / hw.link_bytes_s(layout.tp)
            comm = 2.0 * s.stage_layers(layout.pp) * one
        stage = max(memory, compute) + comm
        return layout.pp * stage + hw.decode_step_overhead_ms * 1e-3

    def prefill_seconds_per_sample(self, layout: GeneratorLayout, precision: str) -> float:
        s, hw, p = self.shape, self.hw, self.work.prompt_tokens
        flops = 2.0 * s.matmul_params * p + 2.0 * s.layers * s.hidden * p * p
        return flops / (layout.m * hw.peak_flops(precision) * hw.prefill_mfu)

    def trainer_allowed(self, layout: TrainerLayout) -> bool:
        return True  # every layout is priced (a measured table restricts this)

    def generator_allowed(self, layout: GeneratorLayout, role: str = "generator") -> bool:
        return True

    def generator_seconds_per_sample(self, layout: GeneratorLayout, precision: str, sequences: float,
                                     mode: str = "continuous", role: str = "generator") -> float:
        """eta_g: replica seconds per sample with `sequences` in flight.

        continuous: finished sequences are replaced at once (the asynchronous
        generator), so every step runs `sequences` at the steady mean context.
        static: all start together and the batch drains as they finish; the
        replica is busy until the longest one ends (a synchronous step).
        """
        w = self.work
        prefill = self.prefill_seconds_per_sample(layout, precision)
        if mode == "continuous":
            step = self.decode_step_seconds(layout, precision, sequences, w.steady_context)
            return step * w.lengths.mean / sequences + prefill
        total = 0.0
        points = _drain_points(w.lengths)
        for lo, hi in zip([0] + points[:-1], points):
            mid = (lo + hi) / 2
            running = sequences * w.lengths.survival(mid)
            if running > 0:
                total += (hi - lo) * self.decode_step_seconds(layout, precision, running, w.prompt_tokens + mid)
        return total / sequences + prefill


def _drain_points(lengths: LengthDistribution):
    """Decode positions at which to evaluate a draining batch (segment ends, last = longest)."""
    top = lengths.max
    n = min(DRAIN_SEGMENTS, top)
    return [round(top * (i + 1) / n) for i in range(n)]
