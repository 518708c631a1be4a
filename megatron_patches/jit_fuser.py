"""Keep Megatron-Core's import from loading torch.compile's stack on CPU.

Why this exists: ``megatron.core.jit`` sets ``jit_fuser = torch.compile`` when it is
imported, and the fusion modules that ``import megatron.core`` pulls in (fused_bias_geglu,
fused_bias_swiglu, activations, ...) decorate their functions with it at import time,
which imports TorchDynamo and Inductor. Measured with torch 2.13 / megatron-core 0.16.1
on a 2-core AMD EPYC: ``import torch, megatron.core`` costs 9.9-10.9 s of CPU, 7.0-7.5 s
with this patch (``import torch`` alone: 3.4 s). Every rank process pays it, and a CPU
test suite or demo starts hundreds of them.

What it changes: nothing that runs. On CPU megarl turns every fusion off
(``bias_activation_fusion``, ``bias_dropout_fusion``, ``masked_softmax_fusion`` are
``on_gpu`` in megarl/models/megatron_model.py), so no decorated function is called;
were one called, it would run eagerly -- the same ops, unfused. Where CUDA is usable
the hook leaves ``jit_fuser`` alone: GPU runs keep Megatron's fused kernels.

How: a one-shot import hook. When ``megatron.core.jit`` is executed, and CUDA is not
usable, its own ``disable_jit_fuser()`` runs before any fusion module reads
``jit_fuser``. Installed by ``import megarl``; does nothing if Megatron-Core was
imported first.

When it can be deleted: when Megatron-Core decorates lazily (compiles on first call,
not at import), or megarl stops starting rank processes on CPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

_MODULE = "megatron.core.jit"


class _DisableJitFuserOnCpu(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)  # one shot: the module is imported once per process
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_disable(module):
            exec_module(module)
            import torch  # here, not at the top: `import megarl` installs this hook and must not import torch

            if not torch.cuda.is_available():
                module.disable_jit_fuser()

        spec.loader.exec_module = exec_then_disable
        return spec


def install() -> None:
    """Install the hook (idempotent); a no-op once ``megatron.core.jit`` is imported."""
    if _MODULE in sys.modules or any(isinstance(f, _DisableJitFuserOnCpu) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _DisableJitFuserOnCpu())
