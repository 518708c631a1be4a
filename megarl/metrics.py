"""Per-step metrics: metrics.jsonl (one JSON object per step), TensorBoard events, a progress bar.

Written by one rank (the trainer's first). Numbers only in the TensorBoard
scalars; the jsonl keeps everything. Where the ``tensorboard`` package is
missing (a GPU check on a machine with only PyTorch) the events are skipped
with a notice; metrics.jsonl is always written.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

PROGRESS_KEYS = ("reward_mean", "accuracy", "lag_mean", "samples_per_s")


class MetricsWriter:
    def __init__(self, out_dir: Path, total_steps: int, start_step: int = 0, progress: bool = True):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(out_dir / "metrics.jsonl", "a")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"))
        except ImportError:
            print("megarl: the tensorboard package is not installed: metrics go to metrics.jsonl only",
                  file=sys.stderr, flush=True)
            self.tb = None
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="megarl train", unit="step", dynamic_ncols=True)

    def write(self, record: dict) -> None:
        self.jsonl.write(json.dumps(record, sort_keys=True) + "\n")
        self.jsonl.flush()
        step = record["step"]
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.bar is not None:
            self.bar.set_postfix({k: f"{record[k]:.3g}" for k in PROGRESS_KEYS if k in record}, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> list:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def summarize(records: list, wall_s: float, samples: int) -> dict:
    def mean(key: str) -> Optional[float]:
        vals = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None

    return {"steps": len(records), "wall_s": wall_s, "samples": samples,
            "samples_per_s": samples / wall_s if wall_s else 0.0,
            **{f"mean_{k}": mean(k) for k in ("time_generate", "time_train", "time_weight_sync",
                                            "idle_generator", "idle_trainer", "reward_mean", "lag_mean")}}
