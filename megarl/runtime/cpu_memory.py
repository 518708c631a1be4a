"""Keep freed memory in the process on CPU runs: glibc malloc's thresholds raised to 1 GiB.

Why: glibc serves every allocation above its mmap threshold (128 KiB, raised by itself up
to 32 MiB at most) with a fresh mmap and returns it to the kernel on free. A trainer step
on CPU allocates and frees tensors of 50-100 MB per micro-batch (the [tokens, vocabulary]
logits, their fp32 copies and gradients), so every one of them was faulted in again page
by page: 660k page faults per `megarl bench train-step` step, and on this project's VMs a
fault costs ~1.5 us (a fresh 94 MB torch.zeros took 35 ms, filling an existing one 2 ms).
With the thresholds raised, freed blocks stay in the heap and are reused: 1.5k faults per
step, step time 5.44 -> 3.85 s alternated in one process (2026-12-02). It is what a GPU
caching allocator does for device memory; the cost is that the process's resident size
stays at its peak instead of shrinking between steps, and a peak that is higher: glibc
2.36's memalign (torch's CPU allocator) reuses freed blocks only after some growth. On
the demo (configs/demo_cpu.yaml, 3 steps and a checkpoint save) the largest process
peaked at 12.3 GB against 9.0 GB without it, the trainer rank during its checkpoint save
(training alone: 4.6 GB). A save is rare and its buffers are not reused by training, so
``release_freed_memory()`` hands the heap's free pages back after each one.

Set once per process by init_distributed and job ranks on CPU and by a CPU torch engine
(`megarl eval`, `megarl bench generate`); never by the process that only launches ranks,
which stays free of torch. Only glibc has mallopt; elsewhere (musl, macOS) this does nothing. Set MEGARL_MALLOC_KEEP=0
to leave malloc as it is.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30

_applied = None
_libc = None


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); True if they were set."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("MEGARL_MALLOC_KEEP", "1") == "0":
        return False
    global _libc
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
        libc.malloc_trim  # noqa: B018  (glibc has both)
    except (OSError, AttributeError):
        return False
    _libc = libc
    # mallopt returns 1 on success; both or neither (a raised mmap threshold with the default
    # trim threshold would hand the freed heap top back to the kernel all the same)
    _applied = bool(mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
    return _applied


def release_freed_memory() -> None:
    """Where keep_freed_memory() is on: return the heap's free pages to the kernel now (after a
    rare, large episode such as a checkpoint save, whose buffers training would not reuse)."""
    if _applied and _libc is not None:
        _libc.malloc_trim(0)
