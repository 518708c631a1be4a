"""Megatron's DotProductAttention against SdpaDotProductAttention (megarl/models/sdpa_attention.py),
one process, TP1: the same q/k/v (GQA 9 query heads over 3 key/value groups, SmolLM2's), a packed
row of three samples under megarl's segment mask (SDPA per segment), a mask that is not
block-diagonal (two samples share a prefix: one masked SDPA call), and the causal type without a
mask; forward outputs and the gradients of q, k and v. Prints one JSON line of the largest
differences and of the SDPA calls made."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402


def main() -> None:
    import types

    import megarl.models.sdpa_attention as sdpa_module
    from megarl.bench.attention import core_attention_pair
    from megarl.models.megatron_model import layer_spec
    from megarl.models.sdpa_attention import SdpaDotProductAttention
    from megarl.runtime.distributed import init_distributed, init_megatron, shutdown, world_dims
    from megarl.trainer.packing import _segments_mask

    calls = []  # the fused path must be the one taken (Megatron's forward is its fallback): (case, rows, causal, masked)
    fused = torch.nn.functional.scaled_dot_product_attention
    case_now = [None]

    def counted(q, *a, **k):
        calls.append((case_now[0], q.shape[2], bool(k.get("is_causal")), k.get("attn_mask") is not None))
        return fused(q, *a, **k)

    sdpa_module.F = types.SimpleNamespace(scaled_dot_product_attention=counted)
    init_distributed()
    init_megatron(world_dims(1, 1))
    out = {
        "local_spec_uses_sdpa": layer_spec(
            use_transformer_engine=False
        ).submodules.self_attention.submodules.core_attention
        is SdpaDotProductAttention
    }
    heads, groups, dim, s, b = 9, 3, 64, 96, 2
    segments = torch.tensor([0] * 40 + [1] * 33 + [2] * 15 + [3] * 8)  # 3 samples, then padding
    shared_prefix = _segments_mask(segments).clone()
    shared_prefix[..., 40:73, :20] = False  # sample 2 also sees sample 1's first 20 positions
    out["segments_found"] = sdpa_module.causal_segments(_segments_mask(segments))
    out["shared_prefix_segments"] = sdpa_module.causal_segments(shared_prefix)
    for dtype in (torch.float32, torch.bfloat16):
        layers = core_attention_pair(dtype, heads, groups, dim)  # Megatron's and megarl's, built alike
        tag = "bf16" if dtype == torch.bfloat16 else "fp32"
        g = torch.Generator().manual_seed(0)
        q = torch.randn(s, b, heads, dim, generator=g).to(dtype)
        k = torch.randn(s, b, groups, dim, generator=g).to(dtype)
        v = torch.randn(s, b, groups, dim, generator=g).to(dtype)
        grad_out = torch.randn(s, b, heads * dim, generator=g).to(dtype)
        outputs = {}
        for case, mask in (("segments", _segments_mask(segments)), ("shared_prefix", shared_prefix), ("causal", None)):
            case_now[0] = f"{case}_{tag}"
            results = []
            for layer in (layers["megatron"], layers["sdpa"]):
                leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
                context = layer(*leaves, attention_mask=mask)
                context.float().mul(grad_out.float()).sum().backward()
                results.append([context.detach().float()] + [t.grad.float() for t in leaves])
            outputs[case] = results[1][0]
            out[f"{case}_{tag}"] = {
                "shape": list(results[1][0].shape),
                "max_abs": [float((a - c).abs().max()) for a, c in zip(*results)],
                "max_ref": [float(a.abs().max()) for a in results[0]],
            }
        # the segment mask is more than causal: ignoring it would change the output this much
        out[f"segments_vs_causal_{tag}"] = float((outputs["segments"] - outputs["causal"]).abs().max())
    out["sdpa_calls"] = calls
    print(json.dumps(out))
    shutdown()


if __name__ == "__main__":
    main()
