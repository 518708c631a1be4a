"""--dtype values of the conversion tools as torch dtypes."""

from __future__ import annotations

from typing import Optional

import torch

from megarl.convert import DTYPE_NAMES
from megarl.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(DTYPES) == DTYPE_NAMES


def parse_dtype(name: str) -> Optional[torch.dtype]:
    """--dtype value -> torch dtype; None for 'auto' (keep what is stored)."""
    if name == "auto":
        return None
    if name not in DTYPES:
        raise ConfigError(f"--dtype {name!r}: choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]
