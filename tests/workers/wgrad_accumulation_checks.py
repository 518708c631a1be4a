"""megatron_patches.cpu_wgrad_accumulation and single_rank_grad_sync against Megatron's own CPU path.

One process, TP1 DP1. For tied and untied embeddings, in fp32 and bf16: two copies of a tiny
Llama GPTModel with the same initial weights; one wrapped in Megatron's DistributedDataParallel as
Megatron builds it (each weight gradient a tensor of its own, added to main_grad by DDP's hook), the
other through megarl's wrap_ddp (fusion on). Both take the same three micro-batches of
forward + backward (gradients accumulate across them), then DDP's grad sync. Prints one JSON line:
the largest difference of every main_grad relative to the largest entry of Megatron's, which ops ran
(dense embedding backward, gloo reduce-scatter), and what the sync did to the buffer."""

import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def build(tied: bool, dtype: torch.dtype):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from transformers import LlamaConfig

    from megarl.models.megatron_model import build_model_chunks, transformer_config
    from megarl.models.spec import ModelSpec
    from tests.conftest import TINY_CONFIG

    spec = ModelSpec.from_hf_config(LlamaConfig(**{**TINY_CONFIG, "tie_word_embeddings": tied}))
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    (model,) = build_model_chunks(spec, transformer_config(spec, params_dtype=dtype))
    model.config.calculate_per_token_loss = True  # as wrap_ddp sets it: sums over DP, no scaling
    return model


def megatron_ddp(model):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return DistributedDataParallel(
        model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True), model
    )


def micro_batches(vocab: int):
    from megarl.trainer.packing import _segments_mask

    g = torch.Generator().manual_seed(1)
    out = []
    for lengths in ((40, 24), (64,), (30, 20, 14)):
        ids = torch.randint(0, vocab, (1, sum(lengths)), generator=g)
        ids[0, :3] = 7  # a token repeated within a micro-batch: its embedding rows sum
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        weights = torch.randn(1, sum(lengths), generator=g)
        out.append((ids, pos, _segments_mask(seg), weights))
    return out


@contextlib.contextmanager
def megatron_grad_sync():
    """Megatron's own start_grad_sync / start_param_sync in place of single_rank_grad_sync's."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as BucketGroup

    from megatron_patches import single_rank_grad_sync

    ours = {name: getattr(BucketGroup, name) for name in single_rank_grad_sync.megatron_methods}
    for name, method in single_rank_grad_sync.megatron_methods.items():
        setattr(BucketGroup, name, method)
    try:
        yield
    finally:
        for name, method in ours.items():
            setattr(BucketGroup, name, method)


def step(ddp, batches) -> dict:
    ddp.zero_grad_buffer()
    ops = {}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for ids, pos, mask, weights in batches:
            logits = ddp(ids, pos, mask)
            (logits.float().log_softmax(-1)[..., 5] * weights).sum().backward()
        before_sync = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
        ddp.finish_grad_sync()
    for event in prof.key_averages():
        ops[event.key] = event.count
    grads = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
    return {"grads": grads, "ops": ops, "sync_changed": any(not torch.equal(before_sync[n], grads[n]) for n in grads)}


def main() -> None:
    from megarl.runtime.distributed import init_distributed, init_megatron, shutdown, world_dims
    from megarl.trainer.setup import wrap_ddp

    init_distributed()
    init_megatron(world_dims(1, 1))
    out = {}
    for tied in (True, False):
        for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            reference, fused = build(tied, dtype), build(tied, dtype)
            assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), fused.parameters()))
            batches = micro_batches(reference.vocab_size)
            with megatron_grad_sync():
                ref = step(megatron_ddp(reference), batches)
            new = step(wrap_ddp([fused])[0], batches)
            case = f"{'tied' if tied else 'untied'}_{tag}"
            out[case] = {
                "relative_diff": {
                    n: float((new["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
                    for n, g in ref["grads"].items()
                },
                "zero_grads": [n for n, g in ref["grads"].items() if not g.abs().max() > 0],
                "dense_embedding_backward": [r["ops"].get("aten::embedding_dense_backward", 0) for r in (ref, new)],
                "reduce_scatter": [sum(c for k, c in r["ops"].items() if "reduce_scatter" in k) for r in (ref, new)],
                "sync_changed": [ref["sync_changed"], new["sync_changed"]],
            }
            if tied and tag == "fp32":  # trainer.gradient_accumulation_fusion: false -- Megatron's unfused path
                off = step(wrap_ddp([build(tied, dtype)], wgrad_fusion=False)[0], batches)
                out[case]["fusion_off"] = {
                    "max_relative_diff": max(
                        float((off["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
                        for n, g in ref["grads"].items()
                    ),
                    "dense_embedding_backward": off["ops"].get("aten::embedding_dense_backward", 0),
                }
    print(json.dumps(out))
    shutdown()


if __name__ == "__main__":
    main()
