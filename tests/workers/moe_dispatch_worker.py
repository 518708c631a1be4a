"""Rank body for test_moe_cpu: Megatron's MoE GPTModel at expert parallelism 2 on CPU + gloo.

    torchrun --nproc-per-node 2 tests/workers/moe_dispatch_worker.py --out DIR

The same weights and tokens through the alltoall dispatcher (split sizes through megatron_patches/
moe_cpu.py) and the allgather one (no split sizes): each rank writes its outputs' and gradients'
largest differences, and the router's logits and gradients against torch's matmul.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402

from megarl.parallel_dims import ParallelDims  # noqa: E402
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown  # noqa: E402


def build(dispatcher: str):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_token_dispatcher_type=dispatcher,
        moe_router_load_balancing_type="none",
        expert_model_parallel_size=2,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        add_bias_linear=False,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        hidden_dropout=0.0,  # the two runs must see the same function
        attention_dropout=0.0,
    )
    return GPTModel(cfg, get_gpt_layer_local_spec(num_experts=4), vocab_size=64, max_sequence_length=32)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank = init_distributed()
    init_megatron(ParallelDims(tp=1, pp=1, dp=2, ep=2))
    from megatron.core.transformer.moe import moe_utils

    from megatron_patches import moe_cpu

    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(rank))  # differ per rank
    positions = torch.arange(16).expand(2, 16)
    results, grads = {}, {}
    models = {d: build(d) for d in ("alltoall", "allgather")}
    models["allgather"].load_state_dict(models["alltoall"].state_dict())
    for name, model in models.items():
        out = model(tokens, positions, None)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        results[name] = out.detach()
        grads[name] = {n: q.grad for n, q in model.named_parameters()}
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(7), requires_grad=True)
    w = torch.randn(4, 32, generator=torch.Generator().manual_seed(8), requires_grad=True)
    logits = moe_utils.router_gating_linear(x, w, None, torch.float32)
    logits.sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (x @ w.t()).sum().backward()
    own = moe_cpu.megatron_functions["maybe_move_tensor_to_cpu"](torch.tensor([3, 5]), as_numpy=True)
    report = {
        "output_max_diff": (results["alltoall"] - results["allgather"]).abs().max().item(),
        "output_max": results["alltoall"].abs().max().item(),
        "grad_max_diff": max(
            (grads["alltoall"][n] - grads["allgather"][n]).abs().max().item() for n in grads["alltoall"]
        ),
        "expert_grads": sorted(n for n, g in grads["alltoall"].items() if "experts" in n and g.abs().sum() > 0),
        "router_logits_diff": (logits - x.detach() @ w.detach().t()).abs().max().item(),
        "router_grad_diff": max((gx - x.grad).abs().max().item(), (gw - w.grad).abs().max().item()),
        "have_te": moe_utils.HAVE_TE,
        "megatron_returns_tensor_splits": torch.is_tensor(own),
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    shutdown()


if __name__ == "__main__":
    main()
