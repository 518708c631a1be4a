"""Defer executing ``wandb`` until it is used: Megatron-Core imports it at import time.

Why this exists: ``import megatron.core`` reaches
``megatron.core.inference.contexts.dynamic_context`` (through ``inference_params``),
which runs ``import wandb`` at module level when the package is installed, only to
log from the inference engine megarl never starts. Measured with torch 2.13 /
megatron-core 0.16.1 / wandb 0.31 on a 2-core AMD EPYC: ~1 s of a rank's ~6-7 s
of imports (`import megarl, megatron.core`: median 7.0 s of CPU before, 5.9 s after).
Every trainer and generator rank pays it wherever wandb is installed
(a user logging to W&B, the test environment), and a CPU test suite starts hundreds
of rank processes.

What it changes: when, not whether, wandb's code runs. ``import wandb`` still
succeeds exactly where the package is installed (Megatron's ``HAVE_WANDB`` keeps its
value, a missing package still raises ImportError) and binds the same module object;
the module body runs on its first attribute access -- ``wandb.init`` in
megarl/metrics.py, or Megatron's own logging if it ever logs. Nothing megarl or
Megatron computes changes.

How: a one-shot meta-path finder hands the import system wandb's own spec with a loader
that creates the module as a ``_DeferredModule`` and runs nothing; the module's
``__getattr__`` (called only for attributes it does not have yet, so not for the
``__spec__`` every later ``import wandb`` reads -- which would trigger
``importlib.util.LazyLoader``) turns it into a plain module and runs wandb's own loader
in it. Installed by ``import megarl``; does nothing if wandb was imported first.

When it can be deleted: when Megatron-Core imports wandb lazily (where it logs), or
when its inference contexts are no longer imported by ``import megatron.core``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

_MODULE = "wandb"


class _DeferredModule(types.ModuleType):
    """wandb's module before its body ran; the first missing attribute runs it in place."""

    def __getattr__(self, attr):
        loader = self.__dict__.pop("_megarl_real_loader", None)
        if loader is None:  # already run (or running): a genuinely missing attribute
            raise AttributeError(f"module {self.__name__!r} has no attribute {attr!r}")
        self.__class__ = types.ModuleType
        self.__spec__.loader = self.__loader__ = loader
        loader.exec_module(self)
        return getattr(self, attr)


class _DeferringLoader(importlib.abc.Loader):
    def __init__(self, real):
        self.real = real

    def create_module(self, spec):
        return _DeferredModule(spec.name)

    def exec_module(self, module):
        module.__dict__["_megarl_real_loader"] = self.real


class _LazyWandb(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)  # one shot: later imports find the module in sys.modules
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # not installed (ImportError as before), or a loader we cannot defer
        spec.loader = _DeferringLoader(spec.loader)
        return spec


def install() -> None:
    """Install the finder (idempotent); a no-op once wandb is imported."""
    if _MODULE in sys.modules or any(isinstance(f, _LazyWandb) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _LazyWandb())


def is_deferred() -> bool:
    """Whether wandb is imported but its body has not run yet."""
    return isinstance(sys.modules.get(_MODULE), _DeferredModule)
