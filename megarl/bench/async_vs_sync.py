"""`megarl bench async-vs-sync --config FILE`: the same workload in both modes, one run, one JSON line.

Same model, data, batch and number of steps; the same number of ranks: async
splits them into trainer + generator groups, sync runs every rank as trainer
(data parallel) and generator alternately (LlamaRL's colocated baseline).
The workload's responses vary widely in length (sampling with max_new_tokens
well above the typical answer), which is what makes a synchronous step wait
for its longest sequence.

Reports, for each mode, samples/s and where the time went per step (generate /
train / weight sync / idle), and two ratios of async over sync:

* ``measured_ratio``: samples/s over the steady steps (the first recorded step of
  each mode and the asynchronous pipeline's drain left out), what the planner's
  composition is compared with;
* ``ratio_async_over_sync``: samples/s over each whole run, which also holds the
  asynchronous pipeline's fill, first-call warm-ups and the final checkpoint --
  on a short run these dominate and pull it towards 1.

and a decomposition check, ``composed_ratio``: the per-sample times each mode ran at
(LlamaRL s.7's eta_t, eta_g per replica, at the batch sizes used) fed to the planner's
measured tables and composed with the functions that price the 405B layouts
(megarl/plan/measured_ratio.py), with the inputs under ``decomposition``. It is not a
prediction: its inputs are the phase times of the same two runs, so it checks that
the model's composition accounts for their steps, not that it can price a layout
before it runs.

Each run is written to WORKDIR/async and WORKDIR/sync, replaced on every bench
(a checkpoint left there would be resumed, not rerun).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Dict, Sequence

from megarl.config import load_config
from megarl.errors import ConfigError
from megarl.metrics import read_metrics
from megarl.model_source import prepare_model
from megarl.models.spec import ModelSpec
from megarl.plan.measured_ratio import decompose, layouts_from_config
from megarl.train import train

KEYS = (
    "samples_per_s",
    "wall_s",
    "mean_time_generate",
    "mean_time_train",
    "mean_time_weight_sync",
    "mean_idle_generator",
    "mean_idle_trainer",
    "mean_lag_mean",
)
THREADS_ENV = "OMP_NUM_THREADS"


@contextlib.contextmanager
def _own_thread_split():
    """Each run's launcher splits the cores over its own ranks: it sets OMP_NUM_THREADS only when
    unset (runtime/launch.py), so the first run's split must not stay behind for the second."""
    before = os.environ.get(THREADS_ENV)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(THREADS_ENV, None)
        else:
            os.environ[THREADS_ENV] = before


def rank_threads(cfg, role: str, world: int, cores: int) -> int:
    """Intra-op threads a CPU rank of ``role`` runs with: its cpu_threads, else the launcher's split."""
    configured = cfg.trainer.cpu_threads if role == "trainer" else cfg.generator.cpu_threads
    if configured:
        return configured
    if os.environ.get(THREADS_ENV):
        return int(os.environ[THREADS_ENV])
    return max(1, cores // world)


def run(config: str, overrides: Sequence[str] = (), workdir: str = "runs/bench_async_vs_sync") -> dict:
    cfg = load_config(config, list(overrides) + ["run.mode=async"])
    ranks = cfg.layout().world_size
    trainer = cfg.trainer_dims()
    model_parallel = trainer.world_size // trainer.dp  # TP x PP x CP: one replica
    if ranks % model_parallel:
        raise ConfigError(
            f"async-vs-sync: {ranks} ranks are not a multiple of the trainer's replica {trainer.describe()} "
            f"= {model_parallel} ranks"
        )
    sync_dp = ranks // model_parallel
    # every sync rank does both jobs at the async trainer's TP x PP (the colocated copy handles PP),
    # DP over all the ranks; the launcher splits the cores evenly
    sync_extra = [
        "run.mode=sync",
        f"trainer.dp={sync_dp}",
        "generator.verify_sync=false",
        "trainer.cpu_threads=0",
        "generator.cpu_threads=0",
    ]
    sync_cfg = load_config(config, list(overrides) + sync_extra)
    cores = os.cpu_count() or 1
    threads = {
        "async_trainer": rank_threads(cfg, "trainer", ranks, cores),
        "async_generator": rank_threads(cfg, "generator", ranks, cores),
        "sync_rank": rank_threads(sync_cfg, "trainer", ranks, cores),
    }
    results: Dict[str, dict] = {}
    records: Dict[str, list] = {}
    for mode, extra in (("async", ["run.mode=async"]), ("sync", sync_extra)):
        out = Path(workdir) / mode
        if out.exists():
            shutil.rmtree(out)
        with _own_thread_split():
            results[mode] = train(
                config, list(overrides) + extra + [f"run.output_dir={out}", "run.progress=false", "run.save_every=0"]
            )
        records[mode] = read_metrics(out / "metrics.jsonl")
    result = {
        "config": config,
        "ranks": ranks,
        "steps": cfg.run.steps,
        "samples_per_step": cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt,
        "async": {k: results["async"].get(k) for k in KEYS},
        "sync": {k: results["sync"].get(k) for k in KEYS},
        "samples_async": results["async"]["samples"],
        "samples_sync": results["sync"]["samples"],
        "ratio_async_over_sync": results["async"]["samples_per_s"] / results["sync"]["samples_per_s"],
    }
    decomposition = _decompose(cfg, sync_dp, threads, cores, records)
    result.update(
        measured_ratio=decomposition["measured_ratio"],
        composed_ratio=decomposition["composed_ratio"],
        decomposition=decomposition,
    )
    (Path(workdir) / "decomposition.json").write_text(json.dumps(decomposition, indent=1))
    print(json.dumps(result), flush=True)
    return result


def _decompose(cfg, sync_dp: int, threads: dict, cores: int, records: Dict[str, list]) -> dict:
    layouts = layouts_from_config(cfg, sync_dp, threads, cores)
    spec = ModelSpec.from_dict(prepare_model(cfg.model).spec)
    p = decompose(
        layouts, records["async"], records["sync"], spec, cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
    )
    return {**p.to_dict(), "tables": p.tables}
