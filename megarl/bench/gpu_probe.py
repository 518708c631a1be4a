"""What this machine is and what its device can do, in seconds: scripts/gpu_smoke.sh's first step.

One JSON line: the versions megarl's GPU path depends on (Python, torch, CUDA, cuDNN, NCCL, triton,
megatron-core, Transformer Engine, SGLang, transformers: None where absent), the device and its
memory, and two measured peaks that the later steps are read against:

- ``matmul_tflops``: bf16 square matmuls (the best of a few sizes, each the best of several calls
  after a warm-up) -- what a GEMM-bound step can reach here; MFU "against the measured peak" uses it;
- ``copy_GB_per_s``: a device-to-device copy (bytes read + written), and host-to-device /
  device-to-host from pinned memory -- what a weight copy or an offload can reach.

On a CPU (``--device cpu``, the suite's dry run) the same measurements run at small sizes: the
figures then describe the CPU, and nothing is compared with a datasheet.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import platform
import sys

from megarl.bench.timing import best_seconds


def _version(dist: str, module: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:  # a package put on PYTHONPATH as a copy has no dist-info
        return getattr(importlib.import_module(module), "__version__", "present")
    except Exception:
        return None


def versions() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
    }
    for dist, module in (
        ("triton", "triton"),
        ("megatron-core", "megatron.core"),
        ("transformer-engine", "transformer_engine"),
        ("sglang", "sglang"),
        ("transformers", "transformers"),
    ):
        out[dist] = _version(dist, module)
    return out


def matmul_tflops(device: str, sizes, reps: int = 5) -> dict:
    """bf16 n x n x n matmul TFLOP/s per size (2 n^3 per call, best call)."""
    import torch

    out = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
        seconds = best_seconds(lambda a=a, b=b, c=c: torch.matmul(a, b, out=c), device, reps)
        out[n] = 2.0 * n**3 / seconds / 1e12
    return out


def copy_rates(device: str, nbytes: int, reps: int = 5) -> dict:
    """GB/s of a device-to-device copy (2 x bytes: read and write) and of pinned host <-> device."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    out = {"copy_GB_per_s": 2 * nbytes / best_seconds(lambda: dst.copy_(src), device, reps) / 1e9}
    if device == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out["h2d_GB_per_s"] = nbytes / best_seconds(lambda: src.copy_(host, non_blocking=True), device, reps) / 1e9
        out["d2h_GB_per_s"] = nbytes / best_seconds(lambda: host.copy_(src, non_blocking=True), device, reps) / 1e9
    return out


def probe(device: str, sizes, copy_mb: int) -> dict:
    import torch

    from megarl.bench.mfu import datasheet_peak

    out = {"versions": versions()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name = torch.cuda.get_device_name()
        out.update(
            device=name,
            device_count=torch.cuda.device_count(),
            memory_GB=props.total_memory / 1e9,
            sm_count=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
        )
    else:
        name = "cpu"
        out.update(device=name, cpu_threads=torch.get_num_threads())
    rates = matmul_tflops(device, sizes)
    out["matmul_tflops_by_size"] = {str(n): r for n, r in rates.items()}
    out["matmul_tflops"] = max(rates.values())
    peak = datasheet_peak(name)
    out["datasheet_tflops"] = peak / 1e12 if peak else None
    out["matmul_fraction_of_datasheet"] = out["matmul_tflops"] * 1e12 / peak if peak else None
    out.update(copy_rates(device, copy_mb << 20))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--sizes", type=int, nargs="+", help="matmul sizes (default 4096 8192 16384 on a GPU, 256 on CPU)")
    p.add_argument("--copy-mb", type=int, help="bytes copied (default 1024 MiB on a GPU, 16 on CPU)")
    a = p.parse_args(argv)
    import torch

    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    result = probe(device, a.sizes or ([4096, 8192, 16384] if cuda else [256]), a.copy_mb or (1024 if cuda else 16))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
