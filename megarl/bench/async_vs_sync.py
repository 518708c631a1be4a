"""`megarl bench async-vs-sync --config FILE`: the same workload in both modes, one run, one JSON line.

Same model, data, batch and number of steps; the same number of ranks: async
splits them into trainer + generator groups, sync runs every rank as trainer
(data parallel) and generator alternately (LlamaRL's colocated baseline).
The workload's responses vary widely in length (sampling with max_new_tokens
well above the typical answer), which is what makes a synchronous step wait
for its longest sequence. Reports samples/s of each, the ratio, and where each
mode's time went (generate / train / weight sync / idle, per step).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from megarl.errors import ConfigError

KEYS = ("samples_per_s", "wall_s", "mean_time_generate", "mean_time_train", "mean_time_weight_sync",
        "mean_idle_generator", "mean_idle_trainer", "mean_lag_mean")


def run(config: str, overrides: Sequence[str] = (), workdir: str = "runs/bench_async_vs_sync") -> dict:
    from megarl.config import load_config
    from megarl.train import train

    cfg = load_config(config, list(overrides) + ["run.mode=async"])
    ranks = cfg.world_size()
    model_parallel = cfg.trainer.tp * cfg.trainer.pp
    if ranks % model_parallel:
        raise ConfigError(f"async-vs-sync: {ranks} ranks are not a multiple of trainer TP x PP = {model_parallel}")
    sync_dp = ranks // model_parallel
    results = {}
    for mode, extra in (("async", ["run.mode=async"]),
                        # every sync rank does both jobs at the async trainer's TP x PP (the colocated
                        # copy handles PP), DP over all the ranks; the launcher splits the cores evenly
                        ("sync", ["run.mode=sync", f"trainer.dp={sync_dp}", "generator.verify_sync=false",
                                  "trainer.cpu_threads=0", "generator.cpu_threads=0"])):
        out = str(Path(workdir) / mode)
        results[mode] = train(config, list(overrides) + extra + [f"run.output_dir={out}", "run.progress=false",
                                                                "run.save_every=0"])
    result = {"config": config, "ranks": ranks, "steps": cfg.run.steps,
              "samples_per_step": cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt,
              "async": {k: results["async"].get(k) for k in KEYS},
              "sync": {k: results["sync"].get(k) for k in KEYS},
              "samples_async": results["async"]["samples"], "samples_sync": results["sync"]["samples"],
              "ratio_async_over_sync": results["async"]["samples_per_s"] / results["sync"]["samples_per_s"]}
    print(json.dumps(result), flush=True)
    return result
