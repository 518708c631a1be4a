"""Per-step metrics: metrics.jsonl (one JSON object per step), TensorBoard events, optionally
Weights & Biases, a progress bar.

Written by one rank (the trainer's first). Numbers only in the TensorBoard
scalars and W&B; the jsonl keeps everything. TensorBoard and W&B get the same
metric names (the record's keys) against the same x-axis ``step``. Where the
``tensorboard`` package is missing (a GPU check on a machine with only
PyTorch) the events are skipped with a notice; metrics.jsonl is always written.

W&B (``run.wandb``) is optional: ``wandb`` is imported only when configured,
and a config that asks for it without the package is refused when loaded.
W&B's own step counter is not used: a relaunch that fell back to an older
checkpoint logs steps it has logged before, which ``wandb.log(step=...)``
would drop; every metric is plotted against the logged ``step`` instead.
"""

from __future__ import annotations

import json
import math
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Optional

from megarl.config import check_wandb_config
from megarl.errors import ConfigError
from megarl.health import progress_text

PROGRESS_KEYS = ("reward_mean", "accuracy", "lag_mean", "samples_per_s")
WANDB_RUN_FILE = "wandb_run_id.txt"  # a relaunch continues the same W&B run


def _numbers(record: dict) -> Dict[str, float]:
    """The scalars TensorBoard and W&B get: finite numbers, under the record's own keys."""
    return {
        k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class WandbLogger:
    """One W&B run per output directory; its id is kept there so a relaunch continues it."""

    def __init__(self, section: Dict[str, Any], out_dir: Path, run_config: Optional[dict] = None):
        section = check_wandb_config(section)
        import wandb  # lazily: an optional dependency

        id_file = out_dir / WANDB_RUN_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        try:
            self.run = wandb.init(
                project=section["project"],
                entity=section["entity"],
                name=section["name"] or out_dir.resolve().name,
                mode=section["mode"],
                dir=str(out_dir),
                id=run_id,
                resume="allow",
                config=run_config,
            )
        except Exception as e:  # wandb's own errors (no API key, no network) name no megarl field
            raise ConfigError(
                f"run.wandb: wandb.init failed in mode {section['mode']!r}: {e} (mode: offline logs without a network)"
            ) from e
        id_file.write_text(run_id + "\n")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, record: dict) -> None:
        self.run.log(_numbers(record))

    def close(self) -> None:
        self.run.finish()


class MetricsWriter:
    def __init__(
        self,
        out_dir: Path,
        total_steps: int,
        start_step: int = 0,
        progress: bool = True,
        wandb: Optional[Dict[str, Any]] = None,
        run_config: Optional[dict] = None,
        time_budget_s: float = 0.0,
        budget_spent_s: float = 0.0,
    ):
        out_dir.mkdir(parents=True, exist_ok=True)
        # first: a W&B run that cannot start stops the job before anything is written
        self.wandb = WandbLogger(wandb, out_dir, run_config) if wandb and wandb.get("mode") != "disabled" else None
        self.jsonl = open(out_dir / "metrics.jsonl", "a")
        try:  # optional: the GPU check runs where tensorboard is not installed (tests/multiprocess/test_gpu_check.py)
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"))
        except ImportError:
            print(
                "megarl: the tensorboard package is not installed: metrics go to metrics.jsonl only",
                file=sys.stderr,
                flush=True,
            )
            self.tb = None
        self.bar = None
        # run.time_budget_min: with a budget, the run ends on it rather than at run.steps (the bar's
        # total), so the bar also shows the budget's minutes left (from this launch's start)
        self.budget_end = time.monotonic() + time_budget_s - budget_spent_s if time_budget_s else None
        if progress:  # tqdm only for a bar: the GPU check runs without it (and with run.progress false)
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="megarl train", unit="step", dynamic_ncols=True)

    def write(self, record: dict) -> None:
        self.jsonl.write(json.dumps(record, sort_keys=True) + "\n")
        self.jsonl.flush()
        step = record["step"]
        if self.tb is not None:
            for key, value in _numbers(record).items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(record)
        if self.bar is not None and not record.get("eval"):  # evaluation records are not steps
            self.bar.set_postfix(self.progress_fields(record), refresh=False)
            self.bar.update(1)

    def progress_fields(self, record: dict) -> Dict[str, str]:
        fields = {k: f"{record[k]:.3g}" for k in PROGRESS_KEYS if k in record}
        health = progress_text(record)  # megarl/health.py: ok | baseline | DEGRADED:<checks>
        if health is not None:
            fields["health"] = health
        if self.budget_end is not None:
            fields["budget_left"] = f"{max(0.0, self.budget_end - time.monotonic()) / 60:.1f}min"
        return fields

    def say(self, line: str) -> None:
        """A line on stderr that leaves the progress bar whole."""
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()


def read_metrics(path: Path) -> list:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def summarize(records: list, wall_s: float, samples: int) -> dict:
    def mean(key: str) -> Optional[float]:
        vals = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None

    return {
        "steps": len(records),
        "wall_s": wall_s,
        "samples": samples,
        "samples_per_s": samples / wall_s if wall_s else 0.0,
        **{
            f"mean_{k}": mean(k)
            for k in (
                "time_generate",
                "time_train",
                "time_weight_sync",
                "idle_generator",
                "idle_trainer",
                "reward_mean",
                "lag_mean",
            )
        },
    }
