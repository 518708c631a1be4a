"""The MoE micro-benchmark (scripts/gpu_smoke.sh's second step): where a mixture-of-experts step
spends its time, one part at a time, each printed as soon as it is measured.

1. The torch engine (megarl's reference generator) on a random model of the preset: a prefill of
   ``--batch`` sequences, then decode steps of all of them (one new token each). Reported: the
   first decode step's seconds (kernels compiled, caches warmed), the steady step's (median), and
   the seconds of one MoE layer alone inside it (``_experts`` on the step's hidden rows).
2. Megatron-Core's MoE layer as the trainer builds it (models/megatron_model.py: the local layer
   spec's MoELayer -- router, token dispatcher, SequentialMLP experts -- at EP1), forward and
   backward over ``--tokens`` tokens: the first call and the steady one.

Each part prints one JSON line with everything measured so far, so a part cut off by its time
limit leaves the ones before it. The models are random (``random:<preset>``'s shape): speed, not
numbers. On CPU (``--device cpu --preset tiny-moe``) the suite runs it as a dry run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from megarl.bench.timing import seconds


def random_engine_params(spec, dtype, device: str, seed: int = 0) -> dict:
    """SGLang-layout parameters of a random model (TP1): N(0, 0.02) weights, unit norms."""
    import torch

    from megarl.weight_sync.endpoints import allocate_generator_params

    params = allocate_generator_params(spec, 1, 0, dtype, device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, p in params.items():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=g)
    return params


def engine_decode(spec, device: str, batch: int, prompt: int, steps: int) -> dict:
    import torch

    from megarl.generator.torch_engine.model import KVCache, Segment, SglangLayoutModel

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = SglangLayoutModel(
        spec, random_engine_params(spec, dtype, device), cpu_kernels="torch" if device == "cuda" else "auto"
    )
    cache = KVCache(spec.num_layers, batch, model.kv_heads, prompt + steps + 1, spec.head_dim, dtype, device)
    g = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, spec.vocab_size, (batch * prompt,), generator=g).to(device)
    positions = torch.arange(prompt, device=device).repeat(batch)
    segments = [Segment(i, 0, prompt, i * prompt) for i in range(batch)]
    prefill_s = seconds(lambda: model.forward(tokens, positions, segments, cache), device)
    times = []
    for t in range(steps):
        new = torch.randint(0, spec.vocab_size, (batch,), generator=g).to(device)
        pos = torch.full((batch,), prompt + t, device=device)
        step_segments = [Segment(i, prompt + t, 1, i) for i in range(batch)]
        times.append(seconds(lambda: model.forward(new, pos, step_segments, cache), device))
    layer = spec.moe.layers[-1]
    h = torch.randn(batch, spec.hidden_size, dtype=dtype, device=device, generator=None) * 0.5
    moe_s = [seconds(lambda: model._experts(h, f"model.layers.{layer}.", layer), device) for _ in range(max(3, steps))]
    return {
        "engine_batch": batch,
        "engine_prefill_s": prefill_s,
        "engine_first_decode_step_s": times[0],
        "engine_decode_step_s": statistics.median(times[1:] or times),
        "engine_decode_tokens_per_s": batch / statistics.median(times[1:] or times),
        "engine_moe_layer_s": statistics.median(moe_s[1:]),
        "engine_moe_layers": len(spec.moe.layers),
    }


def megatron_moe_layer(spec, device: str, tokens: int, reps: int) -> dict:
    import torch

    from megarl.models.megatron_model import build_model_chunks, transformer_config
    from megarl.parallel_dims import ParallelDims
    from megarl.runtime.distributed import init_distributed, init_megatron

    init_distributed()
    init_megatron(ParallelDims())
    # one MoE layer and a small vocabulary: the layer is what is timed, the rest only builds it
    one = dataclasses.replace(
        spec, num_layers=1, vocab_size=256, moe=dataclasses.replace(spec.moe, layers=(0,)), hf_config={}
    )
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = transformer_config(one, params_dtype=dtype)
    model = build_model_chunks(one, config)[0]
    if device == "cuda":
        model.cuda()
    moe = model.decoder.layers[0].mlp
    g = torch.Generator(device="cpu").manual_seed(2)
    x = (torch.randn(tokens, 1, spec.hidden_size, generator=g) * 0.5).to(device, dtype).requires_grad_()

    def fwd_bwd():
        out = moe(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()

    first = seconds(fwd_bwd, device)
    steady = [seconds(fwd_bwd, device) for _ in range(reps)]
    return {
        "megatron_moe_module": type(moe).__name__,
        "megatron_experts_module": type(moe.experts).__name__,
        "megatron_tokens": tokens,
        "megatron_moe_first_fwd_bwd_s": first,
        "megatron_moe_fwd_bwd_s": statistics.median(steady),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--preset", default=None, help="a MoE preset (default qwen3-moe-mini on a GPU, tiny-moe on CPU)")
    p.add_argument("--batch", type=int, default=None, help="decoding sequences (default 128 on a GPU, 8 on CPU)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--tokens", type=int, default=None, help="Megatron MoE layer tokens (default 4096 / 64 on CPU)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip", choices=["engine", "megatron"], action="append", default=[])
    a = p.parse_args(argv)
    import torch

    from megarl.models.presets import preset_spec

    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    preset = a.preset or ("qwen3-moe-mini" if cuda else "tiny-moe")
    spec = preset_spec(preset)
    if spec.moe is None:
        p.error(f"--preset {preset}: has no experts")
    out = {"preset": preset, "device": torch.cuda.get_device_name() if cuda else "cpu"}
    if "engine" not in a.skip:
        out.update(engine_decode(spec, device, a.batch or (128 if cuda else 8), a.prompt, a.decode_steps))
        print(json.dumps(out), flush=True)
    if "megatron" not in a.skip:
        out.update(megatron_moe_layer(spec, device, a.tokens or (4096 if cuda else 64), a.reps))
        print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
