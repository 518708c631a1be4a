"""What an earlier launch of a run recorded in its run directory, read before this launch starts."""

from __future__ import annotations

import json
from pathlib import Path

from megarl.checkpointing.megatron_checkpoint import TRACKER_FILE
from megarl.runtime.cpu_dtype import DTYPE_FIELDS


def recorded_dtypes(run_dir: Path) -> dict:
    """The concrete dtypes an earlier launch of the run in ``run_dir`` recorded, if it has a checkpoint
    to resume from ({} otherwise: a fresh run decides on this machine)."""
    config = run_dir / "config.json"
    if not config.is_file() or not (run_dir / "checkpoints" / TRACKER_FILE).is_file():
        return {}
    try:
        data = json.loads(config.read_text())
    except ValueError:
        return {}
    out = {}
    for name in DTYPE_FIELDS:
        section, _, key = name.partition(".")
        value = (data.get(section) or {}).get(key)
        if value in ("fp32", "bf16"):
            out[name] = value
    return out
