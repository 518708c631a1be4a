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

Recomputation adds forward FLOPs (full: the recomputed layers; selective: core
attention and/or the MLP), sequence parallelism moves the same bytes as the
all-reduces it replaces, context parallelism adds the K/V exchange of ring
attention, and an interleaved pipeline divides the bubble by vpp.

Memory: trainer = weights (2 B/param) + fp32 grads (4 B) + optimizer state
(Adam: fp32 master + 2 moments = 12 B, sharded over DP x CP by the distributed
optimizer) + activations as ``activations`` counts them for the config's
recompute / SP / CP / VPP settings; generator = weights + KV cache (see
``engines`` for SGLang's pool and the torch engine's preallocated slots); the
colocated synchronous baseline keeps the trainer's state resident while it
generates. A layout that does not fit names the part that overflows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from megarl.errors import ConfigError
from megarl.models.spec import ModelSpec
from megarl.parallel_dims import ParallelDims
from megarl.plan import activations as act
from megarl.plan.engines import GeneratorEngine
from megarl.plan.hardware import GB, Hardware, weight_bytes
from megarl.plan.inputs import LengthDistribution, TrainerLayout, TrainerOptions, generator_text

ADAM_BYTES = 12.0  # fp32 master weights + exp_avg + exp_avg_sq
TRAIN_WEIGHT_BYTES = 2.0  # bf16 parameters
KV_BYTES = 2.0  # bf16 KV cache (SGLang keeps a bf16 cache with fp8 weights by default)
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
    ffn: int = 0  # the dense MLP's width (SwiGLU's f)
    # mixture of experts (0 for dense models): MoE layers, routed experts per layer and per token, an
    # expert's width; expert_params (all MoE layers' routed experts) are part of linear_params
    moe_layers: int = 0
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> "ModelShape":
        h = spec.hidden_size
        attention = spec.qkv_rows * h + spec.num_attention_heads * spec.head_dim * h
        linear = spec.num_layers * attention + spec.num_dense_layers * 3 * h * spec.ffn_hidden_size
        moe = dict(moe_layers=0, experts=0, top_k=0, moe_ffn=0)
        if spec.moe:
            m = spec.moe
            if m.shared_expert_ffn_hidden_size:
                raise ConfigError(f"plan.model: {spec.source}: shared experts are not priced yet")
            moe = dict(moe_layers=spec.num_moe_layers, experts=m.num_experts, top_k=m.top_k, moe_ffn=m.ffn_hidden_size)
            linear += spec.num_moe_layers * (m.num_experts * 3 * h * m.ffn_hidden_size + m.num_experts * h)  # + router
        return cls(
            spec.num_layers,
            h,
            spec.num_attention_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.vocab_size,
            linear,
            spec.vocab_size * h,
            spec.tie_embeddings,
            spec.ffn_hidden_size,
            **moe,
        )

    @property
    def expert_params(self) -> int:
        """The routed experts' weights (all of them, every MoE layer): sharded over EP x ETP."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.moe_ffn

    @property
    def active_linear_params(self) -> int:
        """Layer weights one token is multiplied by: the top-k experts of each MoE layer, not all."""
        return self.linear_params - self.moe_layers * (self.experts - self.top_k) * 3 * self.hidden * self.moe_ffn

    @property
    def mlp_fraction(self) -> float:
        """Share of a token's layer FLOPs in its MLPs (the dense ones' 3 h f, the top-k experts')."""
        dense_layers = self.layers - self.moe_layers
        mlp = 3 * self.hidden * (self.ffn * dense_layers + self.top_k * self.moe_ffn * self.moe_layers)
        return mlp / self.active_linear_params

    @property
    def params(self) -> int:
        return self.linear_params + self.embedding_params * (1 if self.tied else 2)

    @property
    def matmul_params(self) -> int:
        """Parameters multiplied per token: the layers (top-k experts) and the output layer (the input
        embedding is a lookup)."""
        return self.active_linear_params + self.embedding_params

    def stage_layers(self, pp: int) -> int:
        """Layers of the largest pipeline stage. Megatron splits unevenly when pp does not divide
        the layers (num_layers_in_first/last_pipeline_stage), as Llama 3 405B's PP16 over 126 layers."""
        return -(-self.layers // pp)

    def stage_params(self, pp: int) -> float:
        """Parameters of the largest pipeline stage (its layers plus an embedding matrix)."""
        if pp == 1:
            return self.params
        return self.linear_params * self.stage_layers(pp) / self.layers + self.embedding_params

    def stage_expert_params(self, pp: int) -> float:
        """The routed experts' share of stage_params (MoE layers spread over the stages as layers are)."""
        return self.expert_params * min(1.0, self.stage_layers(pp) / self.layers)


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

    def __init__(
        self,
        spec: ModelSpec,
        hw: Hardware,
        workload: Workload,
        grad_bytes: float = 4.0,
        options: Optional[TrainerOptions] = None,
        engine: Optional[GeneratorEngine] = None,
    ):
        self.spec, self.hw, self.work = spec, hw, workload
        self.shape = ModelShape.from_spec(spec)
        self.options = options or TrainerOptions(grad_bytes=grad_bytes)
        self.grad_bytes = self.options.grad_bytes  # megarl's DDP reduces gradients in fp32
        self.engine = engine or GeneratorEngine()
        self.batch = 2048  # samples per step (build_costs sets the plan's): FSDP's micro-batch count

    # -- trainer ------------------------------------------------------------------------------

    def packing(self, layout: TrainerLayout, batch: int) -> Tuple[int, float]:
        """(micro-batches per DP rank per step, real tokens / token positions processed).

        A layout with micro_batch_tokens is megarl's packer (trainer/packing.py): the rank's
        samples (the length distribution's quantiles) first-fit-decreasing into rows of that
        many tokens, padded to full rows when PP > 1 (fixed-shape pipeline messages)."""
        per_rank = math.ceil(batch / layout.dims.dp)
        if layout.micro_batch_tokens is None:
            return math.ceil(per_rank / layout.micro_batch), 1.0
        rows, used = _pack(self.work, per_rank, layout.micro_batch_tokens)
        return rows, (1.0 if layout.dims.pp == 1 else used / (rows * layout.micro_batch_tokens))

    def micro_batches(self, layout: TrainerLayout, batch: int) -> int:
        return self.packing(layout, batch)[0]

    def trainer_memory(self, layout: TrainerLayout, batch: int) -> MemoryBreakdown:
        """The fullest GPU of a replica (PP rank 0 or the last), by part; see ``activations``."""
        w = self.work
        tokens = layout.micro_batch_tokens or layout.micro_batch * w.max_tokens  # may hold the longest sample
        stage, parts = act.trainer_parts(
            self.shape, layout, self.options, tokens, w.max_tokens, self.micro_batches(layout, batch)
        )
        return MemoryBreakdown(
            "trainer",
            f"{layout.describe()}, {stage}",
            self.hw.memory_gb * GB,
            {"reserved": self.hw.reserved_gb * GB, **parts},
        )

    def _recomputed_flops(self, layout: TrainerLayout, linear: float, attention: float) -> float:
        """Forward FLOPs run a second time in backward (per sample)."""
        if layout.recompute == "full":
            chunk = -(-self.shape.layers // (layout.dims.pp * layout.dims.vpp))
            n = (
                chunk
                if (layout.recompute_method or "uniform") == "uniform"
                else min(chunk, 1 if layout.recompute_num_layers is None else layout.recompute_num_layers)
            )
            return (linear + attention) * n / chunk
        if layout.recompute == "selective":
            modules = layout.recompute_modules
            return ("core_attn" in modules) * attention + ("mlp" in modules) * linear * self.shape.mlp_fraction
        return 0.0

    def trainer_seconds_per_sample(self, layout: TrainerLayout, batch: int) -> float:
        """eta_t: seconds of one model replica (tp x pp x cp GPUs) per sample, pipeline bubble included."""
        s, hw, w = self.shape, self.hw, self.work
        linear = 2.0 * s.active_linear_params * w.mean_tokens  # forward FLOPs of the layers' matmuls
        attention = 2.0 * s.layers * s.hidden * w.mean_square_tokens  # causal QK^T and PV, forward
        head = 2.0 * s.embedding_params * w.mean_tokens
        recomputed = self._recomputed_flops(layout, linear, attention)
        flops = 3.0 * (linear + attention + head) + recomputed  # forward + backward (2x) + recomputation
        imbalance = s.stage_layers(layout.dims.pp) * layout.dims.pp / s.layers  # the largest stage sets the pace
        micro_batches, efficiency = self.packing(layout, batch)
        compute = flops * imbalance / (layout.m * hw.peak_flops("bf16") * hw.train_mfu * efficiency)
        layers, comm = s.stage_layers(layout.dims.pp), 0.0
        if layout.dims.tp > 1:
            # 2 all-reduces forward, 2 backward (with SP: all-gather + reduce-scatter, the same bytes),
            # and the recomputed forward's again; each CP rank's TP group moves 1/cp of the tokens
            message = w.mean_tokens / layout.dims.cp * s.hidden * 2.0
            ring = 2.0 * (layout.dims.tp - 1) / layout.dims.tp
            count = 4.0 + 2.0 * recomputed / max(linear + attention, 1e-30)
            comm += layers * count * ring * message / hw.link_bytes_s(layout.dims.tp)
        if layout.dims.cp > 1:
            # ring attention: every rank receives the other ranks' K and V forward, and K, V, dK, dV backward
            kv = w.mean_tokens / layout.dims.cp * 2 * s.kv_heads * s.head_dim / layout.dims.tp * 2.0
            comm += layers * 3.0 * (layout.dims.cp - 1) * kv / hw.link_bytes_s(layout.dims.tp * layout.dims.cp)
        bubble = 1.0 + (layout.dims.pp - 1) / (layout.dims.vpp * micro_batches)
        return (compute + comm * hw.tp_comm_exposed / efficiency) * bubble

    def trainer_step_overhead(self, layout: TrainerLayout, batch: Optional[int] = None) -> float:
        """Once per step: the gradient reduction over DP x CP and, with sharded weights, the bf16
        parameter all-gather; an overlapped one hides behind one micro-batch's backward (forward).
        FSDP (``TrainerOptions.state_sharding``) moves its weights every micro-batch instead."""
        shards = layout.dims.dp * layout.dims.cp
        if shards == 1:
            return 0.0
        hw, o, w, s, d = self.hw, self.options, self.work, self.shape, layout.dims
        experts = s.stage_expert_params(d.pp)
        shard = (s.stage_params(d.pp) - experts) / d.tp
        link = hw.link_bytes_s(shards * d.tp * d.pp)
        ring = (shards - 1) / shards
        if experts:
            # the experts' gradients are reduced over the expert data-parallel group (edp ranks, each
            # holding experts / (ep x etp)): ring-equivalent elements on the dense part's ring
            expert_ring = (d.edp - 1) / d.edp
            shard += experts / (d.ep * d.expert_tp) * expert_ring / ring
        tokens = layout.micro_batch_tokens or layout.micro_batch * w.mean_tokens
        per_mb = (
            6.0 * s.matmul_params * tokens / (layout.m * hw.peak_flops("bf16") * hw.train_mfu)
        )  # one micro-batch's forward + backward
        if o.state_sharding == "fsdp":
            # FSDP gathers the weights before each micro-batch's forward and again before its backward
            # and reduce-scatters its gradients after; prefetching hides them behind its compute
            per_mb_comm = ring * (2 * TRAIN_WEIGHT_BYTES + o.grad_bytes) * shard / link
            micro_batches = self.micro_batches(layout, batch or self.batch)
            return max(0.0, per_mb_comm - per_mb) * micro_batches * hw.dp_comm_exposed
        if o.state_sharding == "none":  # plain DDP: one all-reduce of the gradients
            reduce, gather = 2 * ring * o.grad_bytes * shard / link, 0.0
        else:  # distributed optimizer: reduce-scatter the gradients, all-gather the new weights
            reduce, gather = ring * o.grad_bytes * shard / link, ring * TRAIN_WEIGHT_BYTES * shard / link
        if o.overlap_grad_reduce:
            reduce = max(0.0, reduce - per_mb * 2 / 3)
        if o.overlap_param_gather:
            gather = max(0.0, gather - per_mb / 3)
        return (reduce + gather) * hw.dp_comm_exposed

    # -- generator ----------------------------------------------------------------------------

    def kv_bytes_per_token(self, layout: ParallelDims) -> float:
        s = self.shape
        heads_per_rank = max(1.0, s.kv_heads / layout.tp)  # replicated when tp > kv heads
        return 2.0 * s.stage_layers(layout.pp) * heads_per_rank * s.head_dim * KV_BYTES

    def generator_weight_bytes(self, layout: ParallelDims, precision: str) -> float:
        s = self.shape
        linear = s.linear_params * s.stage_layers(layout.pp) / s.layers / layout.tp
        linear *= weight_bytes(precision, "generator_precision")
        matrices = (1 if s.tied else 2) if layout.pp == 1 else 1
        return linear + matrices * s.embedding_params * 2.0 / layout.tp  # embeddings stay bf16

    def generator_memory(
        self,
        layout: ParallelDims,
        precision: str,
        sequences: float,
        mode: str,
        resident: Optional[Dict[str, float]] = None,
    ) -> MemoryBreakdown:
        """Per GPU: weights + KV of `sequences` in flight (+ a colocated trainer's resident state).
        The asynchronous generator follows its engine (``engines``); the colocated baseline is an
        SGLang-class engine sharing the trainer's GPU."""
        hw, e, cap = self.hw, self.engine, self.hw.memory_gb * GB
        parts = {"reserved": hw.reserved_gb * GB}
        if resident:
            parts.update(resident)  # the colocated trainer's weights double as the generator's
        else:
            if e.backend == "sglang":  # SGLang keeps 1 - mem_fraction for activations and CUDA graphs
                parts["reserved"] = max(parts["reserved"], (1 - e.mem_fraction) * cap)
            parts["weights"] = self.generator_weight_bytes(layout, precision)
            if e.torch and precision == "fp8":  # the largest matrix (fc1: gate + up) dequantised
                parts["dequant_workspace"] = 2 * self.shape.ffn * self.shape.hidden / layout.tp * 2.0
        parts["kv_cache"] = sequences * self._kv_tokens_per_sequence(mode, resident) * self.kv_bytes_per_token(layout)
        role = "colocated generator" if resident else f"generator ({e.backend})"
        return MemoryBreakdown(role, f"{generator_text(layout)} {precision} x{sequences:g}", cap, parts)

    def _kv_tokens_per_sequence(self, mode: str, resident=None) -> float:
        w = self.work
        if self.engine.torch and not resident:  # preallocated slots
            return self.engine.max_seq_len or w.max_tokens
        if mode == "continuous":
            return w.steady_context
        # static batch: the peak over decode steps of (fraction still running) x context
        return max(w.lengths.survival(step) * (w.prompt_tokens + step) for step in _drain_points(w.lengths))

    def max_sequences(
        self, layout: ParallelDims, precision: str, mode: str, resident: Optional[Dict[str, float]] = None
    ) -> int:
        empty = self.generator_memory(layout, precision, 0, mode, resident)
        room = empty.capacity - empty.total
        per_sequence = self._kv_tokens_per_sequence(mode, resident) * self.kv_bytes_per_token(layout)
        return max(0, int(room // per_sequence))

    def decode_step_seconds(
        self,
        layout: ParallelDims,
        precision: str,
        sequences: float,
        context: float,
        engine: Optional[GeneratorEngine] = None,
    ) -> float:
        """One decode step of a replica: every one of `sequences` advances one token
        (engine: the asynchronous generator's; None prices an SGLang-class engine)."""
        s, hw, e = self.shape, self.hw, engine or GeneratorEngine()
        sequences = max(sequences, 1e-9)
        micro = sequences / min(layout.pp, max(sequences, 1.0))  # sequences per pipeline micro-batch
        q = e.weight_read_bytes(weight_bytes(precision, "generator_precision"), precision)
        stage_linear = s.linear_params * s.stage_layers(layout.pp) / s.layers / layout.tp
        read = stage_linear * q + s.embedding_params * 2.0 / layout.tp  # the last stage also reads lm_head
        if e.torch:  # one padded batch: every slot's cache up to the longest running context
            context = max(context, self.work.max_tokens)
        kv = micro * context * self.kv_bytes_per_token(layout)
        memory = (read + kv) / hw.hbm_bytes_s
        # every expert's weights are read (a decode batch routes to nearly all of them), the top-k computed
        active = s.active_linear_params * s.stage_layers(layout.pp) / s.layers / layout.tp
        flops = 2.0 * micro * (active + s.embedding_params / layout.tp)
        flops += 4.0 * micro * context * s.head_dim * s.heads / layout.tp * s.stage_layers(layout.pp)
        compute = flops / (hw.peak_flops(e.compute_precision(precision)) * hw.decode_mfu)
        comm = 0.0
        if layout.tp > 1:
            ring = 2.0 * (layout.tp - 1) / layout.tp
            one = hw.allreduce_latency_s(layout.tp) + ring * micro * s.hidden * 2.0 / hw.link_bytes_s(layout.tp)
            comm = 2.0 * s.stage_layers(layout.pp) * one
        eager = s.stage_layers(layout.pp) * e.ops_per_layer(precision) * hw.eager_op_us * 1e-6
        stage = max(memory, compute) + comm + eager
        return layout.pp * stage + hw.decode_step_overhead_ms * 1e-3

    def prefill_seconds_per_sample(self, layout: ParallelDims, precision: str) -> float:
        s, hw, p = self.shape, self.hw, self.work.prompt_tokens
        flops = 2.0 * s.matmul_params * p + 2.0 * s.layers * s.hidden * p * p
        return flops / (layout.tp * layout.pp * hw.peak_flops(precision) * hw.prefill_mfu)

    def trainer_allowed(self, layout: TrainerLayout) -> bool:
        return True  # every layout is priced (a measured table restricts this)

    def generator_allowed(self, layout: ParallelDims, role: str = "generator") -> bool:
        return True

    def generator_seconds_per_sample(
        self,
        layout: ParallelDims,
        precision: str,
        sequences: float,
        mode: str = "continuous",
        role: str = "generator",
    ) -> float:
        """eta_g: replica seconds per sample with `sequences` in flight.

        continuous: finished sequences are replaced at once (the asynchronous
        generator), so every step runs `sequences` at the steady mean context.
        static: all start together and the batch drains as they finish; the
        replica is busy until the longest one ends (a synchronous step).
        """
        w = self.work
        engine = self.engine if role == "generator" else None  # the baseline: an SGLang-class engine
        prefill = self.prefill_seconds_per_sample(layout, precision)
        if mode == "continuous":
            step = self.decode_step_seconds(layout, precision, sequences, w.steady_context, engine)
            return step * w.lengths.mean / sequences + prefill
        total = 0.0
        points = _drain_points(w.lengths)
        for lo, hi in zip([0] + points[:-1], points):
            mid = (lo + hi) / 2
            running = sequences * w.lengths.survival(mid)
            if running > 0:
                total += (hi - lo) * self.decode_step_seconds(layout, precision, running, w.prompt_tokens + mid, engine)
        return total / sequences + prefill


@functools.lru_cache(maxsize=256)
def _pack(work: Workload, samples: int, capacity: int) -> Tuple[int, float]:
    """First-fit-decreasing of `samples` lengths (the distribution's quantiles) into rows of
    `capacity` tokens: (rows, tokens). Samples longer than a row are refused by the config."""
    sizes = sorted(
        (work.prompt_tokens + work.lengths.quantile((i + 0.5) / samples) for i in range(samples)), reverse=True
    )
    rows: list = []
    for size in sizes:
        for i, room in enumerate(rows):
            if size <= room:
                rows[i] = room - size
                break
        else:
            rows.append(capacity - min(size, capacity))
    return len(rows), float(sum(sizes))


def _drain_points(lengths: LengthDistribution):
    """Decode positions at which to evaluate a draining batch (segment ends, last = longest)."""
    top = lengths.max
    n = min(DRAIN_SEGMENTS, top)
    return [round(top * (i + 1) / n) for i in range(n)]
