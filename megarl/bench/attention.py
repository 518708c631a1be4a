"""`megarl bench attention`: the trainer's core attention, Megatron's unfused path vs SDPA.

Forward + backward of one SmolLM2-135M attention layer's core (9 query heads over
3 key/value groups, head dim 64) on one packed row of --seq positions holding
samples of ~100 tokens under megarl's segment mask -- what a CPU training step
runs 30 x micro-batches times: Megatron-Core's ``DotProductAttention`` (baddbmm,
fp32 masked softmax, bmm) against ``SdpaDotProductAttention``
(megarl/models/sdpa_attention.py, the local spec's core attention), both
constructed the same way in one process, alternated, median of the timed calls.
One JSON line: ms per call of each and their ratio, per row length.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Tuple

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.models.sdpa_attention import SdpaDotProductAttention
from megarl.runtime.distributed import init_distributed, init_megatron, shutdown, world_dims
from megarl.trainer.packing import _segments_mask


@dataclass(frozen=True)
class AttentionBench:
    seqs: Tuple[int, ...] = (256, 1024)
    dtype: str = "bf16"
    sample_len: int = 100
    reps: int = 10
    heads: int = 9
    groups: int = 3
    head_dim: int = 64


def core_attention_pair(dtype: torch.dtype, heads: int = 9, groups: int = 3, head_dim: int = 64) -> dict:
    """Megatron's DotProductAttention and SdpaDotProductAttention built alike (one layer's core attention,
    causal, no dropout) -- also what tests/multiprocess/test_sdpa_attention.py compares. Needs Megatron's parallel state."""
    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    return {
        name: cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        for name, cls in (("megatron", DotProductAttention), ("sdpa", SdpaDotProductAttention))
    }


def _call(layer, q, k, v, mask, grad):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    layer(*leaves, attention_mask=mask).backward(grad)


def run(b: AttentionBench) -> dict:
    init_distributed()
    init_megatron(world_dims(1, 1))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[b.dtype]
    layers = core_attention_pair(dtype, b.heads, b.groups, b.head_dim)
    result = {
        "dtype": b.dtype,
        "threads": torch.get_num_threads(),
        "heads": b.heads,
        "groups": b.groups,
        "head_dim": b.head_dim,
        "sample_len": b.sample_len,
    }
    for seq in b.seqs:
        g = torch.Generator().manual_seed(seq)
        q = torch.randn(seq, 1, b.heads, b.head_dim, generator=g).to(dtype)
        k, v = (torch.randn(seq, 1, b.groups, b.head_dim, generator=g).to(dtype) for _ in range(2))
        grad = torch.randn(seq, 1, b.heads * b.head_dim, generator=g).to(dtype)
        mask = _segments_mask(torch.arange(seq) // b.sample_len)
        times = {name: [] for name in layers}
        for layer in layers.values():  # warm-up
            _call(layer, q, k, v, mask, grad)
        for _ in range(b.reps):
            for name, layer in layers.items():  # alternated: drift on a shared machine hits both
                start = time.perf_counter()
                _call(layer, q, k, v, mask, grad)
                times[name].append(time.perf_counter() - start)
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        result[str(seq)] = {
            "megatron_ms": ms["megatron"],
            "sdpa_ms": ms["sdpa"],
            "sdpa_speedup": ms["megatron"] / ms["sdpa"],
        }
        print(
            f"core attention fwd+bwd, {seq}-position row ({b.dtype}): Megatron {ms['megatron']:.2f} ms, "
            f"SDPA {ms['sdpa']:.2f} ms ({ms['megatron'] / ms['sdpa']:.2f}x)",
            flush=True,
        )
    print(json.dumps(result), flush=True)
    shutdown()
    return result
