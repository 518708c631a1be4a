"""The generator engines megarl drives (config ``generator.backend``), as the planner prices them.

sglang -- SGLang's server, the production engine. Weights and a paged KV pool
live within ``--mem-fraction-static`` of the GPU (``generator.sglang_mem_fraction``;
the rest holds activations and CUDA graphs); requests beyond what the pool holds
wait, so the sequences in flight are min(max_running, what fits). Block-fp8
GEMMs read one byte per weight at fp8 peak; CUDA graphs leave ~1 ms of overhead
per decode step (``Hardware.decode_step_overhead_ms``).

torch -- megarl's reference engine (megarl/generator/torch_engine), eager PyTorch:
  - the KV cache is ``max_running`` slots x ``max_seq_len`` tokens, allocated at start;
  - fp8 weights are dequantised into the engine dtype inside every matmul
    (``SglangLayoutModel._weight``): a step reads the fp8 weight (1 B), writes and
    reads its bf16 copy (2 + 2 B), and multiplies at bf16 peak; the largest
    matrix's bf16 copy is a workspace;
  - decode attention runs the running slots as one batch padded to the longest
    context, so it reads every slot's cache up to the longest sequence;
  - a decode step issues ``TORCH_OPS_PER_LAYER`` kernels per layer and reads the
    longest position back to the host once per step (``int(starts.max())``), and
    eager Python dispatches every kernel, so every kernel's dispatch
    (``Hardware.eager_op_us``) adds to the step.

The op counts were taken with torch.profiler on one decode step of the engine
(kernel-launching aten ops per layer, views excluded); tests/unit/test_plan.py
counts them again so that an engine change shows up here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megarl.errors import ConfigError

TORCH_OPS_PER_LAYER = {"bf16": 39, "fp8": 67}
BACKENDS = ("sglang", "torch")


@dataclass(frozen=True)
class GeneratorEngine:
    backend: str = "sglang"
    mem_fraction: float = 0.85  # sglang: weights + KV pool, as a fraction of the GPU
    dtype: str = "bf16"  # torch: the dequantised weights' and the KV cache's dtype
    max_seq_len: Optional[int] = None  # torch: tokens per KV slot (None: prompt + longest response)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ConfigError(f"generator.backend={self.backend!r}: the planner prices {list(BACKENDS)}")

    @property
    def torch(self) -> bool:
        return self.backend == "torch"

    def weight_read_bytes(self, stored: float, precision: str) -> float:
        """Bytes of HBM traffic per weight per decode step (stored: bytes per weight as kept)."""
        if self.torch and precision == "fp8":
            return stored + 2 * 2.0  # dequantise: write a bf16 copy, then the GEMM reads it
        return stored

    def compute_precision(self, precision: str) -> str:
        return "bf16" if self.torch else precision

    def ops_per_layer(self, precision: str) -> int:
        return TORCH_OPS_PER_LAYER["fp8" if precision == "fp8" else "bf16"] if self.torch else 0
