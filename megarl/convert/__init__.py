"""Checkpoint conversion between Hugging Face and Megatron layouts."""

from __future__ import annotations

from typing import Optional

import torch

from megarl.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str) -> Optional[torch.dtype]:
    """--dtype value -> torch dtype; None for 'auto' (keep what is stored)."""
    if name == "auto":
        return None
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r}: choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]
