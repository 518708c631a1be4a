"""Routed experts in rollouts.jsonl: one compact JSON value per sample.

A sample's routes are [positions, num_layers, top_k] small integers (-1 on dense layers):
as JSON lists they would be several times the size of everything else on the line, so they
are written as the base64 of their raw bytes, int8 where every expert id fits (Qwen3's 128
experts do) and int16 otherwise (DeepSeek-V3's 256), with the shape beside them.
`megarl train --replay` reads them back (loop/replay.py) and replays them again.
"""

from __future__ import annotations

import base64
from typing import Optional

import torch

from megarl.errors import ConfigError

_DTYPES = {"int8": torch.int8, "int16": torch.int16}


def encode_routes(routes) -> Optional[dict]:
    if routes is None:
        return None
    routes = torch.as_tensor(routes)
    dtype = "int8" if routes.numel() == 0 or int(routes.max()) < 128 else "int16"
    raw = routes.to(_DTYPES[dtype]).contiguous().numpy().tobytes()
    return {"shape": list(routes.shape), "dtype": dtype, "base64": base64.b64encode(raw).decode("ascii")}


def decode_routes(value: Optional[dict], where: str) -> Optional[torch.Tensor]:
    """The int16 tensor ``encode_routes`` wrote; ``where`` names the line of a bad value."""
    if value is None:
        return None
    try:
        dtype, shape = _DTYPES[value["dtype"]], [int(n) for n in value["shape"]]
        flat = torch.frombuffer(bytearray(base64.b64decode(value["base64"])), dtype=dtype)
        return flat.view(shape).to(torch.int16)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(
            f"{where}: routed_experts is not a {{shape, dtype, base64}} value megarl wrote ({e})"
        ) from None
