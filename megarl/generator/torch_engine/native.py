"""The engine's C kernels (decode_attention.c, decoder_ops.c): built once per machine into one
library, loaded through ctypes.

Built with the machine's C compiler (``$CC`` or cc / gcc) at ``-O3 -march=native
-fopenmp`` into ``$MEGARL_CACHE_DIR/native`` (default ``~/.cache/megarl/native``), under a
name that hashes the source, the flags, the compiler's version and this CPU's flags -- so a
cache shared between machine kinds never hands one CPU another's build. No torch or Python
headers are compiled: a build takes about a second. Where no compiler works, ``load()``
returns None with the reason in ``why_not()`` and the engine keeps torch's SDPA and ops.

The .so links OpenMP by soname (libgomp.so.1); torch has already loaded its own copy by
that name, so the kernel runs on torch's thread pool rather than a second one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

from megarl.runtime.cpu_dtype import read_cpu_flags

SOURCES = [Path(__file__).with_name(name) for name in ("decode_attention.c", "decoder_ops.c")]
HEADERS = [Path(__file__).with_name("native_scalar.h")]  # included by both: part of the build's hash
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
_why_not = ""


def cache_dir() -> Path:
    return Path(os.environ.get("MEGARL_CACHE_DIR", Path.home() / ".cache" / "megarl")) / "native"


def _compiler() -> Optional[str]:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    texts = [source.read_text() for source in SOURCES + HEADERS]
    key = hashlib.sha256("\n".join([*texts, " ".join(FLAGS), version, read_cpu_flags() or ""]).encode())
    target = cache_dir() / f"megarl_native-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # built aside, renamed: concurrent builders are safe
        built = Path(tmp) / target.name
        proc = subprocess.run(
            [cc, *FLAGS, *map(str, SOURCES), "-o", str(built), "-lm"], capture_output=True, text=True, timeout=300
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
        os.replace(built, target)
    return target


@functools.lru_cache(maxsize=None)
def load() -> Optional[ctypes.CDLL]:
    """The built library, or None (and why_not() says why)."""
    global _why_not
    if os.environ.get("MEGARL_NATIVE_KERNELS", "1") == "0":
        _why_not = "MEGARL_NATIVE_KERNELS=0"
        return None
    cc = _compiler()
    if cc is None:
        _why_not = "no C compiler (set CC, or install gcc)"
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        _why_not = f"building {' + '.join(source.name for source in SOURCES)}: {err}"
        return None
    fn = lib.megarl_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [
        ptr,
        i64,
        ptr,
        i64,
        ptr,
        i64,
        ptr,
        ptr,
        ptr,
        ptr,
        ptr,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
    ]
    fn.restype = ctypes.c_int
    f32, cint = ctypes.c_float, ctypes.c_int
    lib.megarl_add_rms_norm.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, f32, cint, cint]
    lib.megarl_add_rms_norm.restype = None
    lib.megarl_rope.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, cint, cint]
    lib.megarl_rope.restype = cint
    lib.megarl_silu_mul.argtypes = [ptr, i64, ptr, i64, i64, cint, cint]
    lib.megarl_silu_mul.restype = None
    return lib


def why_not() -> str:
    return _why_not


def _rows(name: str, t: torch.Tensor, batch: int, heads: int, d: int) -> int:
    """The stride between tokens of a [batch, heads, d] tensor whose heads lie contiguously in each token."""
    if t.shape != (batch, heads, d) or t.stride(2) != 1 or t.stride(1) != d:
        raise ValueError(
            f"decode_attention: {name} must be [{batch}, {heads}, {d}] with each token's heads "
            f"contiguous, got shape {tuple(t.shape)} strides {t.stride()}"
        )
    return t.stride(0)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    new_k: Optional[torch.Tensor] = None,
    new_v: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of one new token per sequence, q [batch, heads, d], against cache slot slots[b]
    (int64 [batch]), keys [0, lengths[b]) of k_cache / v_cache [slots, kv_heads, max_len, d];
    query head j reads KV head j // (heads / kv_heads). ``new_k`` / ``new_v`` [batch, kv_heads, d]
    (optional): this token's key and value, written to position lengths[b] - 1 in the same pass.
    q, new_k and new_v may be row views of a wider tensor (the fused qkv output): no copy. Returns
    [batch, heads, d] in the cache dtype. Call only when load() is not None."""
    lib = load()
    dtype = k_cache.dtype
    tensors = [("k_cache", k_cache), ("q", q), ("v_cache", v_cache)]
    tensors += [(n, t) for n, t in (("new_k", new_k), ("new_v", new_v)) if t is not None]
    bf16 = _dtype_flag("decode_attention", tensors)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape != v_cache.shape:
        raise ValueError("decode_attention: k_cache and v_cache must be contiguous, [slots, kv_heads, max_len, d]")
    batch, heads, d = q.shape
    kv_heads = k_cache.shape[1]
    if k_cache.shape[3] != d or heads % kv_heads:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} does not match the cache {tuple(k_cache.shape)}")
    slots, lengths = slots.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
    if slots.numel() != batch or lengths.numel() != batch:
        raise ValueError(f"decode_attention: {batch} queries, {slots.numel()} slots, {lengths.numel()} lengths")
    q_stride = _rows("q", q, batch, heads, d)
    k_stride = _rows("new_k", new_k, batch, kv_heads, d) if new_k is not None else 0
    v_stride = _rows("new_v", new_v, batch, kv_heads, d) if new_v is not None else 0
    out = torch.empty(batch, heads, d, dtype=dtype)
    rc = lib.megarl_decode_attention(
        q.data_ptr(),
        q_stride,
        new_k.data_ptr() if new_k is not None else None,
        k_stride,
        new_v.data_ptr() if new_v is not None else None,
        v_stride,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        lengths.data_ptr(),
        out.data_ptr(),
        batch,
        kv_heads,
        heads // kv_heads,
        d,
        k_cache.shape[0],
        k_cache.shape[2],
        scale,
        bf16,
        torch.get_num_threads(),
    )
    if rc == -2:
        raise ValueError(f"decode_attention: head_dim {d} is not a multiple of 16")
    if rc == -3:
        raise ValueError(f"decode_attention: a slot outside [0, {k_cache.shape[0]}): {slots.tolist()}")
    if rc != 0:
        raise ValueError(f"decode_attention: a length outside [1, {k_cache.shape[2]}]: {lengths.tolist()}")
    return out


# -- decoder_ops.c: the layer's elementwise steps ------------------------------------------------


def _dtype_flag(op: str, named: list) -> int:
    """1 for bf16, 0 for fp32; refuses other dtypes, mixed dtypes and non-CPU tensors, naming them."""
    dtype = named[0][1].dtype
    if dtype not in (torch.bfloat16, torch.float32) or any(
        t.dtype != dtype or t.device.type != "cpu" for _, t in named
    ):
        raise ValueError(
            f"{op}: bf16 or fp32 CPU tensors of one dtype, got "
            + ", ".join(f"{n} {t.dtype} on {t.device}" for n, t in named)
        )
    return int(dtype == torch.bfloat16)


def _row_major(op: str, name: str, t: torch.Tensor, width: int) -> int:
    """The row stride of a 2-D tensor whose rows hold at least ``width`` contiguous values."""
    if t.dim() != 2 or t.stride(1) != 1 or t.shape[1] < width or (t.shape[0] > 1 and t.stride(0) < width):
        raise ValueError(
            f"{op}: {name} must be 2-D with contiguous rows of >= {width} values, "
            f"got shape {tuple(t.shape)} strides {t.stride()}"
        )
    return t.stride(0)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``x += delta`` in place (when given), then ``weight * RMSNorm(x)`` (transformers' LlamaRMSNorm,
    rounded where its ops round). x [rows, hidden] with contiguous rows; delta [rows, hidden] contiguous."""
    rows, hidden = x.shape if x.dim() == 2 else (-1, -1)
    named = [("x", x), ("weight", weight)] + ([("delta", delta)] if delta is not None else [])
    bf16 = _dtype_flag("add_rms_norm", named)
    x_stride = _row_major("add_rms_norm", "x", x, hidden)
    if weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"add_rms_norm: weight must be contiguous [{hidden}], got {tuple(weight.shape)}")
    if delta is not None and (delta.shape != x.shape or not delta.is_contiguous()):
        raise ValueError(f"add_rms_norm: delta must be contiguous {tuple(x.shape)}, got {tuple(delta.shape)}")
    out = torch.empty(rows, hidden, dtype=x.dtype)
    load().megarl_add_rms_norm(
        x.data_ptr(),
        x_stride,
        delta.data_ptr() if delta is not None else None,
        weight.data_ptr(),
        out.data_ptr(),
        rows,
        hidden,
        eps,
        bf16,
        torch.get_num_threads(),
    )
    return out


def rope_(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotates the first ``heads`` heads of each row of ``qkv`` [rows, >= heads * head_dim] in place:
    ``x * cos + swap_halves(x) * signed_sin`` (cos, signed_sin: [rows, head_dim] contiguous, or any
    shape of that many values per row, in qkv's dtype), rounded as those three torch ops round."""
    bf16 = _dtype_flag("rope_", [("qkv", qkv), ("cos", cos), ("signed_sin", signed_sin)])
    stride = _row_major("rope_", "qkv", qkv, heads * head_dim)
    rows = qkv.shape[0]
    for name, t in (("cos", cos), ("signed_sin", signed_sin)):
        if t.numel() != rows * head_dim or not t.is_contiguous():
            raise ValueError(
                f"rope_: {name} must be contiguous with {head_dim} values per row of qkv "
                f"({rows} rows), got shape {tuple(t.shape)}"
            )
    if load().megarl_rope(
        qkv.data_ptr(),
        stride,
        cos.data_ptr(),
        signed_sin.data_ptr(),
        rows,
        heads,
        head_dim,
        bf16,
        torch.get_num_threads(),
    ):
        raise ValueError(f"rope_: head_dim {head_dim} must be even and at most 1024")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a fused [rows, 2 * inter] gate_up output (gate first), as [rows, inter]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up must be [rows, 2 * inter], got {tuple(gate_up.shape)}")
    bf16 = _dtype_flag("silu_mul", [("gate_up", gate_up)])
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    stride = _row_major("silu_mul", "gate_up", gate_up, 2 * inter)
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    load().megarl_silu_mul(gate_up.data_ptr(), stride, out.data_ptr(), rows, inter, bf16, torch.get_num_threads())
    return out
