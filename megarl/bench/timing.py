"""Wall time of a call on a device: a CUDA call returns before its kernels finish, so the device is
synchronised before and after (a no-op on CPU). One place for the GPU-window benchmarks' timers."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict


def synchronize(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def seconds(fn: Callable[[], object], device: str) -> float:
    """One call's seconds, the device idle before it starts and after it ends."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def best_seconds(fn: Callable[[], object], device: str, reps: int) -> float:
    """The fastest of ``reps`` calls after one warm-up: what the hardware reaches (peaks)."""
    fn()
    return min(seconds(fn, device) for _ in range(reps))


def median_ms_alternated(calls: Dict[str, Callable[[], object]], reps: int, device: str) -> Dict[str, float]:
    """Median ms of each call, the calls alternated (drift on a shared machine hits all), after a warm-up."""
    for call in calls.values():
        call()
    times = {name: [] for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            times[name].append(seconds(call, device))
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}
