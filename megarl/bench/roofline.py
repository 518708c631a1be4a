"""This machine's roofline for a Llama-shaped model, measured in seconds, in the same run.

Each linear of the model is timed at its own shape (rows = the decode batch, or
the training rows) through each CPU GEMM path, scaled_dot_product_attention at
the decode and training shapes, and a streaming read for memory bandwidth;
``roofline_from_rates`` then turns the rates into tokens/s:

- decode, per step of ``batch`` sequences at ``context`` keys:
  compute = sum over linears of count * 2 * batch * in * out / rate(linear)
            + 4 * layers * heads * head_dim * context * batch / attention rate;
  memory  = (matmul weights + the KV cache read) bytes / bandwidth;
  tokens/s = batch / max(compute, memory).
- training, per token of rows of ``row_tokens`` (causal):
  6 * count * in * out per linear at its rate at ``train_rows`` rows (backward
  assumed at the forward rate), plus 3 x the causal attention forward.

Non-matmul work (norms, RoPE, softmax over the vocabulary, sampling, the
optimizer) is not counted: the roofline is what the GEMMs and attention alone
allow. ``decode_roofline`` / ``train_roofline`` measure and compute in a few
seconds; other benchmarks call them to report their fraction of it.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from megarl.generator.torch_engine import native

# GEMM paths: fp32 through F.linear (MKL's sgemm on x86), fp32 through oneDNN with
# a weight prepacked for the batch size, bf16 through F.linear (oneDNN's bf16 kernels).
PATHS = ("fp32-mkl", "fp32-onednn", "bf16")
PATH_DTYPE = {"fp32-mkl": torch.float32, "fp32-onednn": torch.float32, "bf16": torch.bfloat16}
DTYPE_PATHS = {"fp32": ("fp32-mkl", "fp32-onednn"), "bf16": ("bf16",)}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# Training shapes: out features above this are timed on a slice (the rate of a
# 2048 x 576 x 4096 GEMM is that of the full 49152-wide head; timing all of it takes seconds).
TRAIN_MAX_OUT = 4096


def linear_shapes(spec) -> list:
    """(name, in_features, out_features, count per token) of every matmul with weights."""
    h, heads, d = spec.hidden_size, spec.num_attention_heads, spec.head_dim
    n = spec.num_layers
    return [
        ("qkv", h, spec.qkv_rows, n),
        ("o", heads * d, h, n),
        ("gate_up", h, 2 * spec.ffn_hidden_size, n),
        ("down", spec.ffn_hidden_size, h, n),
        ("lm_head", h, spec.vocab_size, 1),
    ]


def matmul_params(spec) -> int:
    """Weights multiplied per token: every layer's linears plus the head (tied or not)."""
    return sum(i * o * c for _, i, o, c in linear_shapes(spec))


def decode_attention_flops(spec, batch: int, context: int) -> float:
    """QK^T and PV of one new token per sequence against ``context`` keys, all layers."""
    return 4.0 * spec.num_layers * spec.num_attention_heads * spec.head_dim * context * batch


def causal_attention_flops(spec, rows: int, row_tokens: int) -> float:
    """Forward QK^T and PV of causal rows (token t attends to t + 1 keys), all layers."""
    pairs = row_tokens * (row_tokens + 1) / 2
    return 4.0 * spec.num_layers * spec.num_attention_heads * spec.head_dim * pairs * rows


def _timed_rate(fn, flops: float, min_time: float) -> float:
    """GFLOP/s of fn (one warm-up call, then calls until min_time has passed; best per-call time)."""
    fn()
    best, spent = float("inf"), 0.0
    while spent < min_time:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent = min(best, took), spent + took
    return flops / best / 1e9


class _Threads:
    """torch.set_num_threads for a block, restored after."""

    def __init__(self, threads):
        self.threads, self.saved = threads, torch.get_num_threads()

    def __enter__(self):
        if self.threads:
            torch.set_num_threads(self.threads)

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved)


def gemm_gflops(path: str, rows: int, k: int, n: int, threads=None, min_time: float = 0.1, seed: int = 0) -> float:
    """GFLOP/s (2 * rows * k * n per call) of y = x @ w.T through ``path``."""
    g = torch.Generator().manual_seed(seed)
    dtype = PATH_DTYPE[path]
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    if path == "fp32-onednn":
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)

        def fn():
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    else:

        def fn():
            return F.linear(x, w)

    with _Threads(threads):
        return _timed_rate(fn, 2.0 * rows * k * n, min_time)


def attention_gflops(
    spec, dtype: str, batch: int, queries: int, keys: int, causal: bool, threads=None, min_time: float = 0.1
) -> float:
    """GFLOP/s of scaled_dot_product_attention (grouped-query) at the given shape, useful FLOPs only.

    At decode (one query per sequence) the faster of two forms of the same product: SDPA's
    ``enable_gqa`` with one query per head, and the torch engine's (generator/torch_engine/model.py),
    each KV head's query heads as that head's queries, with its key mask, and the engine's own C kernel
    where it builds (torch_engine/native.py). On a CPU with native
    bf16 (torch 2.13, AVX512-BF16) the first ran at ~4 GFLOP/s in bf16 against ~30 in fp32, while
    the engine's form did not slow down: a roofline from the first alone was no bound on the engine."""
    g = torch.Generator().manual_seed(1)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    d = spec.head_dim
    q = torch.randn(batch, spec.num_attention_heads, queries, d, generator=g).to(dt)
    kv = [torch.randn(batch, spec.num_kv_heads, keys, d, generator=g).to(dt) for _ in range(2)]
    if causal:
        assert queries == keys
        pairs = keys * (keys + 1) / 2
    else:
        pairs = queries * keys
    flops = 4.0 * batch * spec.num_attention_heads * d * pairs

    if queries == 1 and not causal:
        forms = list(decode_attention_forms(spec, q, kv[0], kv[1]).values())
    else:
        forms = [lambda: F.scaled_dot_product_attention(q, kv[0], kv[1], is_causal=causal, enable_gqa=True)]
    with _Threads(threads):
        return max(_timed_rate(f, flops, min_time) for f in forms)


def decode_attention_forms(spec, q, k, v) -> dict:
    """One decode step's attention (q: [batch, heads, 1, head_dim]; k, v: [batch, kv_heads, keys,
    head_dim]) in each form timed, as functions returning [batch, heads, 1, head_dim]."""
    batch, keys, d = q.shape[0], k.shape[2], spec.head_dim
    grouped = q.reshape(batch, spec.num_kv_heads, spec.num_attention_heads // spec.num_kv_heads, d)
    mask = torch.ones(batch, 1, 1, keys, dtype=torch.bool)
    forms = {
        "sdpa_gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "engine_grouped": lambda: F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask).reshape(q.shape),
    }
    if native.load() is not None and d % 16 == 0 and k.is_contiguous() and v.is_contiguous():
        slots, lengths = torch.arange(batch), torch.full((batch,), keys)
        flat = q.reshape(batch, spec.num_attention_heads, d)
        forms["engine_native"] = lambda: native.decode_attention(flat, k, v, slots, lengths, 1.0 / d**0.5).reshape(
            q.shape
        )
    return forms


def bandwidth_gb_s(threads=None, megabytes: int = 256, repeats: int = 5) -> float:
    """Streaming read (sum) of an fp32 tensor far larger than any cache: best of ``repeats``."""
    x = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    with _Threads(threads):
        x.sum()
        for _ in range(repeats):
            start = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def linear_rates(spec, path: str, rows: int, threads=None, max_out=None, min_time: float = 0.1) -> dict:
    """{linear name: GFLOP/s} at ``rows`` rows; out features capped at ``max_out`` (a slice) if given."""
    return {
        name: gemm_gflops(path, rows, k, min(n, max_out or n), threads, min_time)
        for name, k, n, _ in linear_shapes(spec)
    }


def decode_from_rates(
    spec, rates: dict, attention_rate: float, bandwidth: float, dtype: str, batch: int, context: int
) -> dict:
    """Decode tokens/s allowed by measured rates (GFLOP/s per linear, attention GFLOP/s, GB/s)."""
    gemm_s = sum(c * 2.0 * batch * k * n / (rates[name] * 1e9) for name, k, n, c in linear_shapes(spec))
    attn_flops = decode_attention_flops(spec, batch, context)
    attn_s = attn_flops / (attention_rate * 1e9)
    elem = DTYPE_BYTES[dtype]
    weight_bytes = matmul_params(spec) * elem
    kv_bytes = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * context * batch * elem
    memory_s = (weight_bytes + kv_bytes) / (bandwidth * 1e9)
    step_s = max(gemm_s + attn_s, memory_s)
    gemm_flops = 2.0 * batch * matmul_params(spec)
    return {
        "batch": batch,
        "context": context,
        "matmul_params": matmul_params(spec),
        "flops_per_token": (gemm_flops + attn_flops) / batch,
        "gemm_gflops": gemm_flops / gemm_s / 1e9,
        "attention_gflops": attention_rate,
        "bandwidth_gb_s": bandwidth,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "compute_s_per_step": gemm_s + attn_s,
        "memory_s_per_step": memory_s,
        "bound": "compute" if gemm_s + attn_s >= memory_s else "memory",
        "tokens_per_s": batch / step_s,
    }


def train_from_rates(spec, rates: dict, attention_rate: float, row_tokens: int) -> dict:
    """Training tokens/s allowed by the rates: 6 x the matmul FLOPs + 3 x causal attention per token."""
    gemm_s = sum(c * 6.0 * k * n / (rates[name] * 1e9) for name, k, n, c in linear_shapes(spec))
    attn_flops = 3.0 * causal_attention_flops(spec, 1, row_tokens) / row_tokens
    attn_s = attn_flops / (attention_rate * 1e9)
    return {
        "row_tokens": row_tokens,
        "matmul_params": matmul_params(spec),
        "flops_per_token": 6.0 * matmul_params(spec) + attn_flops,
        "gemm_gflops": 6.0 * matmul_params(spec) / gemm_s / 1e9,
        "attention_gflops": attention_rate,
        "tokens_per_s": 1.0 / (gemm_s + attn_s),
    }


def _best(candidates: dict) -> tuple:
    path = max(candidates, key=lambda p: candidates[p]["tokens_per_s"])
    return path, candidates[path]


def decode_roofline(spec, dtype: str, batch: int, context: int, threads=None, min_time: float = 0.05) -> dict:
    """Measure (a few seconds) and return decode tokens/s of ``dtype``'s fastest GEMM path on this machine."""
    with _Threads(threads):
        bandwidth = bandwidth_gb_s(repeats=3)
        attention = attention_gflops(spec, dtype, batch, 1, context, False, min_time=min_time)
        per_path = {
            p: decode_from_rates(
                spec, linear_rates(spec, p, batch, min_time=min_time), attention, bandwidth, dtype, batch, context
            )
            for p in DTYPE_PATHS[dtype]
        }
        path, best = _best(per_path)
        return {
            "dtype": dtype,
            "path": path,
            "threads": torch.get_num_threads(),
            **best,
            "tokens_per_s_by_path": {p: r["tokens_per_s"] for p, r in per_path.items()},
        }


def train_roofline(
    spec, dtype: str, tokens_per_row: int, train_rows: int = 2048, threads=None, min_time: float = 0.05
) -> dict:
    """Measure (a few seconds) and return training tokens/s of ``dtype``'s fastest GEMM path on this machine."""
    with _Threads(threads):
        rows = max(1, train_rows // tokens_per_row)
        attention = attention_gflops(spec, dtype, rows, tokens_per_row, tokens_per_row, True, min_time=min_time)
        per_path = {
            p: train_from_rates(
                spec,
                linear_rates(spec, p, train_rows, max_out=TRAIN_MAX_OUT, min_time=min_time),
                attention,
                tokens_per_row,
            )
            for p in DTYPE_PATHS[dtype]
        }
        path, best = _best(per_path)
        return {
            "dtype": dtype,
            "path": path,
            "threads": torch.get_num_threads(),
            "gemm_rows": train_rows,
            **best,
            "tokens_per_s_by_path": {p: r["tokens_per_s"] for p, r in per_path.items()},
        }
