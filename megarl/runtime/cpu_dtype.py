"""``model.dtype: auto`` / ``generator.dtype: auto``: bf16 where the hardware multiplies it natively.

bf16 halves the memory and, on hardware with bf16 matrix units, doubles the
matmul rate; elsewhere PyTorch emulates it and it is much *slower* than fp32.
Measured on this project's 2-core AMD EPYC (AVX2, no AVX512-BF16): one core's
bf16 ``F.linear`` ran at ~9 GFLOP/s against 45-70 for fp32. So ``auto`` is:

- CUDA: bf16 (what Megatron-Core and SGLang train and serve in);
- x86 CPU: bf16 only with ``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo's flags
  (oneDNN's native bf16 dot products / tiles), and only where ``ONEDNN_MAX_CPU_ISA``
  (or its old name ``DNNL_MAX_CPU_ISA``) does not cap oneDNN below them: capped, PyTorch
  takes its emulated bf16 GEMM (1.2 GFLOP/s against 790 uncapped on an AVX512-BF16 EPYC),
  which is how the suite is run as an AVX2-only machine would run it (docs/testing.md);
  else fp32;
- aarch64 CPU: bf16 only with the ``bf16`` feature (ARMv8.6 BFDOT / BFMMLA, which
  PyTorch's oneDNN + ACL kernels use), else fp32; ``sve`` alone is not bf16 math;
- anything else (no /proc/cpuinfo: macOS, Windows): fp32, the safe choice.

``megarl train`` resolves ``auto`` once, in the launcher, before any rank starts,
logs the choice and why, and the ranks see (and RUN_DIR/config.json records) the
concrete dtype, so `megarl eval` and a resume read what actually ran. A relaunch
of a run that has a checkpoint keeps the dtype it started with (its config.json):
moving a run to another machine does not switch its precision halfway.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import List, Mapping, Optional, Tuple

X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA's values) that still allow its native bf16 kernels; every
# lower cap (SSE41, AVX, AVX2, AVX2_VNNI, AVX2_VNNI_2, AVX512_CORE, AVX512_CORE_VNNI) leaves bf16
# matmuls to PyTorch's emulation.
ONEDNN_BF16_ISAS = (
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX512_CORE_FP16",
    "AVX10_1_512_AMX",
    "AVX512_CORE_AMX",
    "AVX10_1_512_AMX_FP16",
    "AVX512_CORE_AMX_FP16",
    "ALL",
)
ONEDNN_ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
ARM_BF16_FEATURES = ("bf16",)
DTYPE_FIELDS = ("model.dtype", "generator.dtype")


def read_cpu_flags(path: str = "/proc/cpuinfo") -> Optional[str]:
    """The first CPU's ``flags`` (x86) or ``Features`` (aarch64) line of /proc/cpuinfo; None if unreadable."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            return value.strip()
    return ""


def onednn_isa_cap(environ: Optional[Mapping[str, str]] = None) -> Optional[Tuple[str, str]]:
    """(variable, value) of the oneDNN ISA cap set in the environment, or None."""
    environ = os.environ if environ is None else environ
    for name in ONEDNN_ISA_VARIABLES:
        if environ.get(name):
            return name, environ[name]
    return None


def cpu_bf16_native(
    flags: Optional[str] = None, machine: Optional[str] = None, environ: Optional[Mapping[str, str]] = None
) -> Tuple[bool, str]:
    """Whether this CPU multiplies bf16 natively, and why. ``flags``: /proc/cpuinfo's flags or
    Features line (read when None); ``machine``: platform.machine() (read when None); ``environ``:
    where a oneDNN ISA cap is read from (when None: os.environ if the flags are this machine's,
    none if they describe another CPU)."""
    machine = (machine if machine is not None else platform.machine()).lower()
    if environ is None:
        environ = os.environ if flags is None else {}
    if flags is None:
        flags = read_cpu_flags()
        if flags is None:
            return False, "no /proc/cpuinfo to read the CPU's features from"
    have = set(flags.split())
    if machine in ("x86_64", "amd64", "i686", "i386", "x86"):
        found = [f for f in X86_BF16_FLAGS if f in have]
        cap = onednn_isa_cap(environ)
        if found and cap and cap[1].strip().upper() not in ONEDNN_BF16_ISAS:
            return False, (
                f"this x86 CPU has {' and '.join(found)}, but {cap[0]}={cap[1]} caps oneDNN below its bf16 "
                f"kernels: PyTorch would emulate bf16 matmuls, several times slower than fp32"
            )
        if found:
            return True, f"this x86 CPU has {' and '.join(found)} (native bf16 dot products)"
        return False, (
            f"this x86 CPU has neither {' nor '.join(X86_BF16_FLAGS)}: PyTorch would emulate bf16 "
            f"matmuls, several times slower than fp32"
        )
    if machine in ("aarch64", "arm64"):
        found = [f for f in ARM_BF16_FEATURES if f in have]
        if found:
            return True, "this Arm CPU has the bf16 feature (BFDOT / BFMMLA, used by PyTorch's oneDNN + ACL)"
        return False, (
            "this Arm CPU lacks the bf16 feature"
            + (" (it has sve, which is not bf16 math)" if "sve" in have else "")
            + ": PyTorch would emulate bf16 matmuls, slower than fp32"
        )
    return False, f"unknown CPU architecture {machine!r}"


def resolve_dtype(
    name: str, value: str, cuda: bool, flags: Optional[str] = None, machine: Optional[str] = None
) -> Tuple[str, Optional[str]]:
    """(concrete dtype, why) of field ``name`` = ``value``; why is None when ``value`` was not auto."""
    if value != "auto":
        return value, None
    if cuda:
        return "bf16", f"{name}: auto -> bf16 (CUDA)"
    native, why = cpu_bf16_native(flags, machine)
    return ("bf16" if native else "fp32"), f"{name}: auto -> {'bf16' if native else 'fp32'} ({why})"


def resolve_auto_dtypes(
    cfg,
    cuda: Optional[bool] = None,
    flags: Optional[str] = None,
    machine: Optional[str] = None,
    recorded: Optional[dict] = None,
) -> List[str]:
    """Replace ``auto`` in cfg.model.dtype / cfg.generator.dtype by a concrete dtype (in place);
    returns one line per resolved field saying what and why. ``recorded``: an earlier launch's
    concrete dtypes (checkpointing.recorded.recorded_dtypes), which a resumed run keeps."""
    lines = []
    for name in DTYPE_FIELDS:
        section, _, key = name.partition(".")
        owner = getattr(cfg, section)
        if getattr(owner, key) != "auto":
            continue
        if recorded and name in recorded:
            value = recorded[name]
            why = f"{name}: auto -> {value} (the dtype this run started in, from its config.json: a resume keeps it)"
        else:
            if cuda is None:  # asked only here: a config without `auto` never imports torch in the launcher
                import torch

                cuda = torch.cuda.is_available()
            value, why = resolve_dtype(name, "auto", cuda, flags, machine)
        setattr(owner, key, value)
        lines.append(why)
    return lines
