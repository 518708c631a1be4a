"""Run the unmodified Megatron-Core code on CPU processes with gloo.

Why this exists: Megatron-Core assumes CUDA everywhere (``device="cuda"``,
``torch.cuda.current_device()``, ``Tensor.cuda()``, CUDA streams/events, its
CUDA RNG tracker, optimizers asserting ``param.type() == 'torch.cuda.FloatTensor'``).
megarl's tests and CPU demo run the real Megatron GPTModel, schedules, DDP and
distributed optimizer, so instead of forking Megatron we translate those CUDA
requests to CPU at the torch boundary:

* ``CudaToCpuMode`` (a ``TorchFunctionMode``) rewrites ``device=`` arguments and
  ``Tensor.to(<cuda>)`` to CPU, makes ``Tensor.cuda()/pin_memory()`` return the
  tensor itself and ``record_stream()`` a no-op, and makes ``Tensor.type()``
  report the ``torch.cuda.*Tensor`` names Megatron's optimizers assert on.
* ``torch.cuda`` streams, events, synchronisation, NVTX and RNG functions are
  replaced by CPU stand-ins. The "CUDA" RNG *is* the CPU default generator: on a
  CPU build every "cuda" random op runs on the CPU generator anyway, so
  Megatron's RNG tracker forks and restores that one. Its fork() warning that
  the CPU state changed inside a fork is true by construction here and dropped.
* DDP's collectives over a one-rank data-parallel group, identities that gloo
  would run as a full copy of the grad buffer, are skipped
  (``single_rank_grad_sync``).
* Megatron's MoE layers without Transformer Engine (``moe_cpu``), its torch norms
  under sequence parallelism (``torch_norm_sp``) and the uneven all-gather of the
  alltoall dispatcher on gloo (``gloo_uneven_collectives``), and MLA's YaRN RoPE
  (``mla_cpu``): what TP x EP training needs on CPU. Each module says why and when to delete it.

What it never does: activate when CUDA is usable, fake
``torch.cuda.is_available()`` (True would send Megatron into TE-only code), or
change any math -- every numerical op runs exactly as written.

When it can be deleted: when Megatron-Core runs on a CPU device natively.
Written for megatron-core 0.16.1; ``apply()`` warns loudly on any other version.

Pitfalls that are upstream behaviour, not this shim's (measured on 0.16.1):
the mode is thread-local, so Megatron code run in another thread must enter
``cpu_device_mode()`` there; call ``torch.distributed.destroy_process_group()``
at exit or gloo aborts. Scripts that use dist_checkpointing's asynchronous or
multi-process save strategies must guard their entry point with
``if __name__ == "__main__":`` because those strategies spawn processes that
re-import the main module.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings

import torch
from torch.overrides import TorchFunctionMode

from megatron_patches import gloo_uneven_collectives, mla_cpu, moe_cpu, single_rank_grad_sync, torch_norm_sp

# Megatron-Core is imported inside the functions that patch it, which run after _check_megatron_version:
# a missing Megatron-Core is named there with the version to install, and another version is warned
# about before any of it is patched.

WRITTEN_FOR_MEGATRON_CORE = "0.16.1"

_state = threading.local()
_applied = False
_apply_lock = threading.Lock()

# Autograd entry points. The engine runs backward under the torch-function mode
# stack of the thread that started it, but a mode's handler runs with the mode
# popped: a backward started from inside our handler would run Megatron's
# custom backward functions without the mode. Re-entering the mode and calling
# the public function again would dispatch right back to us, so the handler
# marks the thread and the engine entry point re-enters the mode instead.
_BACKWARD_FUNCS = {torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad}
_RETURN_SELF_FUNCS = {torch.Tensor.cuda, torch.Tensor.pin_memory}


def _cpu_device(device):
    """Map a CUDA device spec (str, torch.device or bare GPU index) to CPU."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str):
        return "cpu" if device.startswith("cuda") else device
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # a bare int in a device slot means a CUDA ordinal
    return device


def _is_device_like(value) -> bool:
    return isinstance(value, (torch.device, str)) or (isinstance(value, int) and not isinstance(value, bool))


def _cuda_type_name(name: str) -> str:
    # 'torch.FloatTensor' -> 'torch.cuda.FloatTensor'
    return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests to CPU; see the module docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if func in _RETURN_SELF_FUNCS:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.type:
            if len(args) == 1 and kwargs.get("dtype") is None:
                return _cuda_type_name(func(args[0]))
            args = tuple(a.replace("torch.cuda.", "torch.") if isinstance(a, str) else a for a in args)
            if isinstance(kwargs.get("dtype"), str):
                kwargs["dtype"] = kwargs["dtype"].replace("torch.cuda.", "torch.")
            return func(*args, **kwargs)
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and _is_device_like(args[1]):
            args = (args[0], _cpu_device(args[1])) + tuple(args[2:])
        if func in _BACKWARD_FUNCS:
            _state.backward_mode = self
            try:
                return func(*args, **kwargs)
            finally:
                _state.backward_mode = None
        return func(*args, **kwargs)


def _engine_run_backward_in_mode(*args, **kwargs):
    mode = getattr(_state, "backward_mode", None)
    if mode is None:
        return _ORIGINAL_ENGINE_RUN_BACKWARD(*args, **kwargs)
    _state.backward_mode = None
    with mode:
        return _ORIGINAL_ENGINE_RUN_BACKWARD(*args, **kwargs)


_ORIGINAL_ENGINE_RUN_BACKWARD = torch.autograd.graph._engine_run_backward


class _CpuStream(torch.Stream):
    """Stand-in for torch.cuda.Stream: CPU ops are already ordered.

    A torch.Stream (of the CPU device) so that ``Tensor.record_stream(stream)``
    passes torch's argument parser before the mode turns it into a no-op.
    """

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls, device="cpu")

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event or _CpuEvent()
        event.record()
        return event

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CpuEvent:
    """Stand-in for torch.cuda.Event; elapsed_time uses the wall clock."""

    def __init__(self, *args, enable_timing: bool = False, **kwargs):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return 1000.0 * ((end._t or 0.0) - (self._t or 0.0))


_DEFAULT_STREAM = _CpuStream()


def _stand_in(name, body):
    """A distinct function object per replaced name.

    torch._dynamo keys its trace rules on the identity of torch.cuda functions
    and refuses one object registered under two names with different rules.
    """

    def stand_in(*args, **kwargs):
        return body(*args, **kwargs)

    stand_in.__name__ = stand_in.__qualname__ = name
    stand_in.__doc__ = f"CPU stand-in for torch.cuda.{name} (megatron_patches.cpu_backend)."
    return stand_in


def _nothing(*args, **kwargs):
    return None


def _get_rng_state(device="cuda", *args, **kwargs):
    return torch.default_generator.get_state()


def _set_rng_state(new_state, device=-1, *args, **kwargs):
    torch.default_generator.set_state(new_state)


def _manual_seed(seed, *args, **kwargs):
    torch.default_generator.manual_seed(int(seed))


def _patch_autograd_entry():
    torch.autograd.graph._engine_run_backward = _engine_run_backward_in_mode
    torch.autograd._engine_run_backward = _engine_run_backward_in_mode


def _patch_torch_cuda():
    cuda = torch.cuda
    bodies = {
        "current_device": lambda *a, **k: 0,
        "set_device": _nothing,
        "synchronize": _nothing,
        "current_stream": lambda *a, **k: _DEFAULT_STREAM,
        "default_stream": lambda *a, **k: _DEFAULT_STREAM,
        "set_stream": _nothing,
        "stream": lambda stream=None: contextlib.nullcontext(stream),
        "get_rng_state": _get_rng_state,
        "set_rng_state": _set_rng_state,
        "manual_seed": _manual_seed,
        "manual_seed_all": _manual_seed,
    }
    for name, body in bodies.items():
        setattr(cuda, name, _stand_in(name, body))
    cuda.Stream = _CpuStream
    cuda.Event = _CpuEvent
    for name in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all"):
        setattr(cuda.random, name, getattr(cuda, name))
    for name in ("range_push", "range_pop", "mark"):
        setattr(cuda.nvtx, name, _stand_in(f"nvtx.{name}", _nothing))
    cuda.nvtx.range = _stand_in("nvtx.range", lambda *a, **k: contextlib.nullcontext())


def _patch_megatron_rng():
    # Megatron's own helpers would queue the state change through
    # torch.cuda._lazy_call, which on a CPU build silently never runs.
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._get_cuda_rng_state = _stand_in("_get_cuda_rng_state", _get_rng_state)
    mcore_random._set_cuda_rng_state = _stand_in("_set_cuda_rng_state", _set_rng_state)
    logging.getLogger(mcore_random.__name__).addFilter(_drop_cpu_rng_changed_warning)


def _drop_cpu_rng_changed_warning(record: logging.LogRecord) -> bool:
    # CudaRNGStatesTracker.fork() warns when the CPU generator's state changed inside the fork,
    # because on a GPU that means CPU randomness ran where only CUDA randomness should. Here the
    # "CUDA" generator IS the CPU one, so every draw inside a fork (expert weights' init under the
    # expert-parallel tracker, dropout) changes it by construction, and fork() restores the state
    # it saved on exit (tests/unit/test_cpu_rng_fork.py). True on a GPU, noise here: dropped.
    return record.getMessage() != "CPU RNG state changed within GPU RNG context"


def _check_megatron_version():
    try:
        from megatron.core.package_info import __version__ as found
    except ImportError:  # pragma: no cover - megatron-core is a hard dependency
        raise ImportError("megatron_patches needs megatron-core; install megatron-core==0.16.1") from None
    if found != WRITTEN_FOR_MEGATRON_CORE:
        warnings.warn(
            f"megatron_patches.cpu_backend was written for megatron-core "
            f"{WRITTEN_FOR_MEGATRON_CORE} but found {found}; the CPU backend may miss new CUDA "
            f"call sites. Pin megatron-core=={WRITTEN_FOR_MEGATRON_CORE} or re-validate the patch.",
            RuntimeWarning,
            stacklevel=3,
        )
    return found


def cuda_usable() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def is_active() -> bool:
    return bool(getattr(_state, "mode", None))


def _install_patches() -> None:
    global _applied
    with _apply_lock:
        if not _applied:
            _check_megatron_version()
            _patch_torch_cuda()
            _patch_autograd_entry()
            _patch_megatron_rng()
            single_rank_grad_sync.apply()
            moe_cpu.apply()
            torch_norm_sp.apply()
            gloo_uneven_collectives.apply()
            mla_cpu.apply()
            _applied = True


def apply() -> bool:
    """Activate the CPU backend in this process's calling thread. Idempotent.

    Returns True when the backend is active, False when CUDA is usable (then
    nothing is patched: real GPUs never go through this shim).
    """
    if cuda_usable():
        return False
    _install_patches()
    if not is_active():
        mode = CudaToCpuMode()
        mode.__enter__()
        _state.mode = mode
    return True


@contextlib.contextmanager
def cpu_device_mode():
    """Run a block under the CPU backend in the current thread (the mode is thread-local)."""
    if cuda_usable() or is_active():
        yield
        return
    _install_patches()
    _state.mode = CudaToCpuMode()
    try:
        with _state.mode:
            yield
    finally:
        _state.mode = None
