"""`megarl bench moe-decode`: the torch engine's MoE decode, routed on the device vs the per-expert loop.

A random model of a preset's shape (default ``qwen3-moe-mini``: hidden 2048, 32 experts of 768, top 8)
in the engine's SGLang layout, weights shared by both sides; in one process, alternated, median of
the timed calls:

- ``layer``: one MoE layer of a decode step (router, experts, weighted sum) at each --batch:
  moe.apply_experts (a sort, a searchsorted and two grouped GEMMs) against moe.expert_loop (the
  loop it replaced: a ``torch.nonzero`` and its host read per expert). Also counted, per layer call
  (torch's dispatcher, so on any device): aten ops (on a GPU, about its kernel launches) and host
  reads (``nonzero`` / ``item``: on a GPU, each a synchronisation). ``equal`` says whether the two
  outputs are the same floats.
- ``step``: a whole decode step of --layers layers (every sequence one new token at --context
  cached positions), the forward whose logits the sampler reads, the same model with either MoE path.

One JSON line; the ratios are loop time / device-routed time (above 1: the new path is faster).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.bench.timing import median_ms_alternated
from megarl.generator.torch_engine import moe
from megarl.generator.torch_engine.model import KVCache, Segment, SglangLayoutModel
from megarl.models.presets import preset_config
from megarl.models.spec import ModelSpec
from megarl.weight_sync.layouts import sglang_rank_layout

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HOST_READS = ("aten.nonzero", "aten._local_scalar_dense")  # the ops that wait for a value on the host


@dataclass(frozen=True)
class MoeDecodeBench:
    preset: str = "qwen3-moe-mini"
    layers: int = 8
    batch: Tuple[int, ...] = (1, 16, 64)
    context: int = 128
    dtype: str = "bf16"
    device: str = "cpu"
    reps: int = 5
    parts: Tuple[str, ...] = ("layer", "step")


class _LoopModel(SglangLayoutModel):
    """The engine's model with the MoE layer it had before moe.apply_experts: the per-expert loop."""

    def _experts(self, h, p, layer):
        moe_cfg = self.spec.moe
        weights, experts = moe.route(h, self.params[p + "mlp.gate.weight"], moe_cfg.top_k, moe_cfg.norm_topk_prob)
        self.routes[:, layer] = experts.to(torch.int16)
        w13, w2 = (self._expert_weights(p + "mlp.experts." + w) for w in ("w13_weight", "w2_weight"))
        return moe.expert_loop(h, weights, experts, w13, w2, self.first_expert)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = self.host_reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.host_reads += str(func.overloadpacket) in HOST_READS
        return func(*args, **(kwargs or {}))


def random_params(spec: ModelSpec, dtype: torch.dtype, device: str) -> Dict[str, torch.Tensor]:
    """SGLang's TP1 tensors of ``spec``, random at a trained model's scale (0.02), norms 1."""
    g = torch.Generator(device=device).manual_seed(0)
    params = {}
    for t in sglang_rank_layout(spec, 1, 0):
        if t.name.endswith("norm.weight"):
            params[t.name] = torch.ones(t.shape, dtype=dtype, device=device)
        else:
            params[t.name] = (0.02 * torch.randn(t.shape, generator=g, device=device)).to(dtype)
    return params


def bench_layer(spec: ModelSpec, params, batch: int, reps: int, device: str) -> dict:
    p = f"model.layers.{spec.moe.layers[0]}."
    gate, w13, w2 = (params[p + n] for n in ("mlp.gate.weight", "mlp.experts.w13_weight", "mlp.experts.w2_weight"))
    h = torch.randn(batch, spec.hidden_size, generator=torch.Generator().manual_seed(batch)).to(gate.dtype).to(device)
    paths = {"device_routed": moe.apply_experts, "loop": moe.expert_loop}

    def layer(path):
        weights, experts = moe.route(h, gate, spec.moe.top_k, spec.moe.norm_topk_prob)
        return path(h, weights, experts, w13, w2, 0)

    out, counts = {}, {}
    for name, path in paths.items():
        with _OpCounter() as counter:
            out[name] = layer(path)
        counts[name] = (counter.ops, counter.host_reads)
    ms = median_ms_alternated({name: (lambda path=path: layer(path)) for name, path in paths.items()}, reps, device)
    return {
        "loop_ms": ms["loop"],
        "device_routed_ms": ms["device_routed"],
        "speedup": ms["loop"] / ms["device_routed"],
        "equal": bool(torch.equal(out["loop"], out["device_routed"])),
        "aten_ops": {name: c[0] for name, c in counts.items()},
        "host_reads": {name: c[1] for name, c in counts.items()},
    }


def bench_step(spec: ModelSpec, params, batch: int, context: int, reps: int, device: str) -> dict:
    models = {
        "device_routed": SglangLayoutModel(spec, params, cpu_kernels="torch" if device != "cpu" else "auto"),
        "loop": _LoopModel(spec, params, cpu_kernels="torch" if device != "cpu" else "auto"),
    }
    first = models["loop"]
    # the new tokens' keys land at position ``context``, the same slot on each side: the caches are shared
    cache = KVCache(spec.num_layers, batch, first.kv_heads, context + 1, spec.head_dim, first.dtype, device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, spec.vocab_size, (batch,), generator=g).to(device)
    positions = torch.full((batch,), context, device=device)
    segments = [Segment(b, context, 1, b) for b in range(batch)]

    def step(model):
        logits = model.forward(tokens, positions, segments, cache)
        return logits, model.routes.cpu()  # the engine's one copy of the step's routes

    out = {name: step(model) for name, model in models.items()}
    ms = median_ms_alternated({name: (lambda model=model: step(model)) for name, model in models.items()}, reps, device)
    return {
        "loop_ms": ms["loop"],
        "device_routed_ms": ms["device_routed"],
        "speedup": ms["loop"] / ms["device_routed"],
        "equal_logits": bool(torch.equal(out["loop"][0], out["device_routed"][0])),
        "equal_routes": bool(torch.equal(out["loop"][1], out["device_routed"][1])),
    }


def run(b: MoeDecodeBench) -> dict:
    config = {**preset_config(b.preset), "num_hidden_layers": b.layers}
    spec = ModelSpec.from_hf_config(config, source=f"preset {b.preset}, {b.layers} layers")
    if spec.moe is None:
        raise ValueError(f"--preset {b.preset}: not a mixture-of-experts model")
    params = random_params(spec, DTYPES[b.dtype], b.device)
    result = {
        "preset": b.preset,
        "layers": b.layers,
        "experts": spec.moe.num_experts,
        "top_k": spec.moe.top_k,
        "dtype": b.dtype,
        "device": b.device,
        "threads": torch.get_num_threads(),
        "context": b.context,
        "layer": {},
        "step": {},
    }
    for batch in b.batch if "layer" in b.parts else ():
        r = result["layer"][str(batch)] = bench_layer(spec, params, batch, b.reps, b.device)
        print(
            f"MoE layer, batch {batch}: loop {r['loop_ms']:.2f} ms, device-routed {r['device_routed_ms']:.2f} ms "
            f"({r['speedup']:.2f}x; aten ops {r['aten_ops']['loop']} -> {r['aten_ops']['device_routed']}, "
            f"host reads {r['host_reads']['loop']} -> {r['host_reads']['device_routed']}; equal {r['equal']})",
            flush=True,
        )
    for batch in b.batch if "step" in b.parts else ():
        r = result["step"][str(batch)] = bench_step(spec, params, batch, b.context, b.reps, b.device)
        print(
            f"decode step of {b.layers} layers, batch {batch}: loop {r['loop_ms']:.1f} ms, device-routed "
            f"{r['device_routed_ms']:.1f} ms ({r['speedup']:.2f}x; equal logits {r['equal_logits']}, "
            f"routes {r['equal_routes']})",
            flush=True,
        )
    print(json.dumps(result), flush=True)
    return result
