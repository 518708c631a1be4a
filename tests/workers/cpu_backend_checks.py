"""Checks of megatron_patches.cpu_backend, run in a fresh process per scenario.

    python tests/workers/cpu_backend_checks.py {basic|fake_cuda|other_version}

Prints one JSON object of observations; tests/multiprocess/test_cpu_backend.py asserts on it.
"""

import json
import os
import sys
import threading
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torch  # noqa: E402


def basic() -> dict:
    import megatron_patches.cpu_backend as cpu_backend

    a, b = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), torch.randn(8, 8)
    before = a @ b
    out = {"first_apply": cpu_backend.apply()}
    depth = torch._C._len_torch_function_stack()
    out["second_apply"] = cpu_backend.apply()
    out["idempotent"] = torch._C._len_torch_function_stack() == depth
    out["math_unchanged"] = torch.equal(a @ b, before)
    out["is_available"] = torch.cuda.is_available()
    out["zeros_device"] = str(torch.zeros(2, device="cuda").device)
    out["int_device"] = str(torch.empty(2, device=torch.cuda.current_device()).device)
    x = torch.ones(3)
    out["cuda_is_self"] = x.cuda() is x and x.pin_memory() is x and x.cuda(non_blocking=True) is x
    out["to_cuda"] = str(x.to("cuda").device) + "," + str(x.to(torch.device("cuda", 0)).device)
    out["type_names"] = [x.type(), x.bfloat16().type(), x.type("torch.cuda.HalfTensor").dtype.__repr__()]
    x.record_stream(torch.cuda.current_stream())
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    end.record()
    out["event_elapsed_ms_nonneg"] = start.elapsed_time(end) >= 0

    class CudaInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * torch.full((1,), 2.0, device="cuda")

        @staticmethod
        def backward(ctx, g):
            return g * torch.full((1,), 3.0, device="cuda")

    w = torch.ones(4, requires_grad=True)
    CudaInBackward.apply(w).sum().backward()
    grads = [w.grad.tolist()]
    (g,) = torch.autograd.grad(CudaInBackward.apply(w).sum(), w)
    grads.append(g.tolist())
    out["backward_grads"] = grads

    # Megatron's RNG tracker forks the "CUDA" generator: same seed, same numbers.
    from megatron.core.tensor_parallel import random as mcore_random

    tracker = mcore_random.CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    with tracker.fork("model-parallel-rng"):
        r1 = torch.randn(3, device="cuda")
    tracker2 = mcore_random.CudaRNGStatesTracker()
    tracker2.add("model-parallel-rng", 1234)
    outside = torch.get_rng_state()
    with tracker2.fork("model-parallel-rng"):
        r2 = torch.randn(3, device="cuda")
    out["tracker_reproducible"] = torch.equal(r1, r2)
    out["tracker_restores_outside_state"] = torch.equal(outside, torch.get_rng_state())

    errors = {}

    def in_thread(use_mode):
        try:
            if use_mode:
                with cpu_backend.cpu_device_mode():
                    torch.zeros(1, device="cuda")
            else:
                torch.zeros(1, device="cuda")
            errors[use_mode] = None
        except (RuntimeError, AssertionError) as err:
            errors[use_mode] = type(err).__name__

    for use_mode in (False, True):
        t = threading.Thread(target=in_thread, args=(use_mode,))
        t.start()
        t.join()
    out["thread_without_mode_fails"] = errors[False] is not None
    out["thread_with_mode_works"] = errors[True] is None
    return out


def fake_cuda() -> dict:
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    original = torch.cuda.current_device
    import megatron_patches.cpu_backend as cpu_backend

    return {
        "applied": cpu_backend.apply(),
        "untouched": torch.cuda.current_device is original,
        "mode_active": cpu_backend.is_active(),
    }


def other_version() -> dict:
    import megatron.core.package_info as info

    info.__version__ = "0.17.0"
    import megatron_patches.cpu_backend as cpu_backend

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        applied = cpu_backend.apply()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    return {"applied": applied, "messages": messages}


if __name__ == "__main__":
    print(json.dumps({"basic": basic, "fake_cuda": fake_cuda, "other_version": other_version}[sys.argv[1]]()))
