"""Which GEMM path runs each of the engine's linears on this CPU: picked by measuring.

On x86, torch sends a float32 ``F.linear`` to MKL's sgemm. oneDNN computes the
same product (fp32 inputs, fp32 accumulation; only the summation order
differs) and is much faster on some CPUs and shapes: on an AMD EPYC of this
project's kind MKL ran 11-14 GFLOP/s per core and oneDNN 29-33; on another
machine (AVX2, 2 threads) the tied 576 x 49152 lm_head at 64 rows ran 46 GFLOP/s
through MKL and 80 through oneDNN, while the smaller linears were even. So at
start-up the engine times both paths at each distinct weight shape, at its
decode batch (``max_running`` rows), and keeps oneDNN only where it wins by a
margin. Nothing changes the dtype: a bf16 model stays bf16 on both paths.

oneDNN runs on a prepacked copy of the weight (``mkldnn._reorder_linear_weight``,
what torch.compile's CPU backend uses), so a chosen weight costs its size again
in memory and is repacked after every weight update (``repack``, called by the
engine's ``update_weights``).
"""

from __future__ import annotations

import functools
import time
from typing import Dict, Iterable, Tuple

import torch
import torch.nn.functional as F

PATHS = ("auto", "mkl", "onednn")
ONEDNN_MARGIN = 1.05  # oneDNN must be this much faster to be worth its packed copy
PROBE_ROUNDS = 3


def onednn_linear_available(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and _packs(weight.dtype)
    )


@functools.lru_cache(maxsize=None)
def _packs(dtype: torch.dtype) -> bool:
    """oneDNN refuses some dtypes on some CPUs (bf16 packing needs avx_ne_convert or AVX-512 BW/VL/DQ):
    weights of those stay on F.linear. A property of the dtype and the CPU, so asked once."""
    try:
        _pack(torch.zeros(1, 8, dtype=dtype), 1)
        return True
    except RuntimeError:
        return False


def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def _onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _seconds(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


class LinearKernels:
    """``linear(x, name)``: the product with ``params[name]`` through the path chosen for its shape."""

    def __init__(self, params: Dict[str, torch.Tensor], names: Iterable[str], rows: int, path: str = "auto"):
        """``path``: "auto" (time both, keep the faster), "mkl" (plain F.linear) or "onednn"
        (wherever available: tests and benchmarks compare the two)."""
        if path not in PATHS:
            raise ValueError(f"linear path {path!r}: one of {PATHS}")
        self.params, self.rows = params, max(1, rows)
        self.packed: Dict[str, torch.Tensor] = {}
        self.choice: Dict[Tuple[int, int], str] = {}  # (out, in) -> "mkl" | "onednn"
        self.timings: Dict[Tuple[int, int], Tuple[float, float]] = {}  # (out, in) -> (mkl s, onednn s)
        names = [n for n in names if onednn_linear_available(params[n])]
        if path == "auto":
            self._probe(names)
        elif path == "onednn":
            self.packed = {name: _pack(params[name], self.rows) for name in names}
            self.choice = {tuple(params[n].shape): "onednn" for n in names}

    def _probe(self, names) -> None:
        by_shape: Dict[Tuple[int, int], list] = {}
        for name in names:
            by_shape.setdefault(tuple(self.params[name].shape), []).append(name)
        for shape, group in by_shape.items():
            w = self.params[group[0]]
            x = torch.randn(self.rows, shape[1], dtype=w.dtype)
            packed = _pack(w, self.rows)
            reps = max(2, min(50, int(3e8 / (2 * self.rows * shape[0] * shape[1]))))  # ~0.3 GFLOP a timing
            mkl, onednn = [], []
            for _ in range(PROBE_ROUNDS):  # interleaved, best of each: robust to a neighbour's load
                mkl.append(_seconds(lambda: F.linear(x, w), reps))
                onednn.append(_seconds(lambda: _onednn(x, packed), reps))
            self.timings[shape] = (min(mkl), min(onednn))
            self.choice[shape] = "onednn" if min(onednn) * ONEDNN_MARGIN < min(mkl) else "mkl"
            if self.choice[shape] == "onednn":
                self.packed.update({name: _pack(self.params[name], self.rows) for name in group})

    def repack(self) -> None:
        """After the weights changed in place (a weight sync): the packed copies follow."""
        for name in self.packed:
            self.packed[name] = _pack(self.params[name], self.rows)

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        packed = self.packed.get(name)
        if packed is not None:
            return _onednn(x, packed)
        return F.linear(x, self.params[name])

    def summary(self) -> Dict[str, str]:
        """Per weight shape: the path and both measured times, for logs and benchmarks."""
        return {
            f"{o}x{i}": self.choice[(o, i)]
            + (
                " (mkl {:.2f} ms, onednn {:.2f} ms)".format(*(1e3 * t for t in self.timings[(o, i)]))
                if (o, i) in self.timings
                else ""
            )
            for (o, i) in self.choice
        }
