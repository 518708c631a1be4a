"""`megarl train --config FILE --replay RUN_DIR/rollouts.jsonl`: train on recorded rollouts, no generator.

For debugging a loss or a numerical problem: the trainer ranks alone (world =
trainer TP x PP x DP) take the recorded batches step by step -- the same token
ids, behaviour log-probs, policy versions, rewards and groups, in the recorded
order -- and write their metrics to ``run.output_dir`` like a normal run. Given
the recorded run's config (its ``config.json``) the per-step losses reproduce the
recorded ones; the summary line reports the largest difference from
RUN_DIR/metrics.jsonl. Change the loss, its parameters or the optimizer in the
config to see what they would have done with the same data.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist

from megarl.errors import ConfigError
from megarl.executors.trainer import TrainerExecutor
from megarl.loop.routes_json import decode_routes
from megarl.loop.wiring import concrete_config
from megarl.metrics import MetricsWriter
from megarl.rollout import Sample
from megarl.runtime.distributed import init_distributed, shutdown

TOKEN_FIELDS = ("prompt_tokens", "response_tokens", "behaviour_logprobs", "versions", "reward", "group")


def load_recorded_batches(path: Path) -> Dict[int, dict]:
    """step -> {"samples": [...], "trained_version": v} from a rollouts.jsonl."""
    if not path.is_file():
        raise ConfigError(f"--replay {path}: no such file")
    by_step: Dict[int, dict] = defaultdict(lambda: {"samples": [], "trained_version": None})
    for n, line in enumerate(path.read_text().splitlines(), 1):
        r = json.loads(line)
        missing = [k for k in TOKEN_FIELDS if k not in r]
        if missing:
            raise ConfigError(
                f"{path}:{n}: no {missing[0]!r} (rollouts recorded before token ids were logged cannot be replayed)"
            )
        entry = by_step[r["step"]]
        entry["trained_version"] = r["trained_version"]
        entry["samples"].append(
            Sample(
                r["prompt_tokens"],
                r["response_tokens"],
                r["behaviour_logprobs"],
                r["versions"],
                reward=r["reward"],
                group_id=r["group"],
                finish_reason=r.get("finish_reason"),
                loss_mask=r.get("loss_mask") or [],  # rollouts logged before the mask existed: all trained
                routed_experts=decode_routes(r.get("routed_experts"), f"{path}:{n}"),
            )
        )
    if not by_step:
        raise ConfigError(f"--replay {path}: no rollouts")
    return dict(sorted(by_step.items()))


def replay_rank(cfg_dict: dict, prepared, rollouts: str) -> None:
    cfg = concrete_config(cfg_dict)
    init_distributed()
    batches = load_recorded_batches(Path(rollouts))
    # runs without a job, on CUDA wherever it exists
    trainer = TrainerExecutor(cfg, prepared, None, cfg.layout().lag_bound, on_gpu=torch.cuda.is_available())
    out = Path(cfg.run.output_dir)
    writer = None
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
        writer = MetricsWriter(out, len(batches), 0, progress=cfg.run.progress)
    losses: List[tuple] = []
    for step, batch in batches.items():
        trainer.version = batch["trained_version"]  # the lags are the recorded ones
        metrics = trainer.step(batch["samples"])
        losses.append((step, metrics["loss"]))
        if writer is not None:
            writer.write(
                {"step": step, "replay": True, **{k: v for k, v in metrics.items() if not isinstance(v, (list, dict))}}
            )
    if writer is not None:
        writer.close()
        recorded = {}
        metrics_file = Path(rollouts).parent / "metrics.jsonl"
        if metrics_file.is_file():
            recorded = {m["step"]: m["loss"] for m in map(json.loads, metrics_file.read_text().splitlines())}
        diffs = [abs(loss - recorded[step]) for step, loss in losses if step in recorded]
        summary = {
            "replayed_steps": len(losses),
            "compared_steps": len(diffs),
            "max_abs_loss_diff": max(diffs) if diffs else None,
            "losses": [loss for _, loss in losses],
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
    shutdown()
