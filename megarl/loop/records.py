"""What the loop writes per training step: the metrics record and the rollouts log.

``step_record``: one line of metrics.jsonl (and TensorBoard) for training step k: the trainer's
metrics, what its batch cost, and what the generators did meanwhile (async: the next batch).
``rollout_lines``: rollouts.jsonl, every trained sample's text, reward, versions and token ids
(`megarl train --replay` trains on them again, loop/replay.py).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Optional, Sequence

from megarl.loop.batch import Batch
from megarl.loop.routes_json import encode_routes
from megarl.rollout import Sample


def step_record(
    step: int,
    run_mode: str,
    policy_version: int,
    m: dict,
    trained: Batch,
    current: Optional[Batch],
    wall: float,
    sync_s: float,
    last_sync,
    sync_verified: bool,
) -> dict:
    """Training step ``step`` (its batch: ``trained``) and what the generators did meanwhile (``current``)."""
    samples = trained.samples
    gen_s = current.time_generate if current else 0.0
    reward_s = current.time_reward if current else 0.0
    generated = current.generated_tokens if current else 0
    rewards = [s.reward for s in samples]
    time_train = m.get("time_train", 0.0)
    record = {
        "step": step,
        "mode": run_mode,
        "policy_version": policy_version,
        "reward_mean": sum(rewards) / len(rewards),
        # the spread of the samples' rewards: the health watch's standard error of a mean reward
        "reward_std": statistics.pstdev(rewards),
        "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        "samples": len(samples),
        "samples_per_s": len(samples) / wall,
        "tokens_per_s": generated / wall,
        "response_len_mean": trained.generated_tokens / len(samples),
        "time_step": wall,
        "time_generate": gen_s,
        "time_reward": reward_s,
        "time_train": time_train,
        "time_weight_sync": sync_s,
        "idle_trainer": max(0.0, wall - time_train - sync_s),
        "idle_generator": max(0.0, wall - gen_s - reward_s - sync_s),
        "stale_dropped": trained.stale_dropped,
        # what rollout.max_lag cost while the batch was made (executors/generator.py), drops by length
        **trained.lag_counts,
        "reward_timeouts": trained.reward_timeouts,
        "reward_dropped_groups": trained.reward_dropped_groups,
        # rollout.filter_groups: groups of one reward not trained, and the samples refilling cost
        "filtered_groups": trained.filtered_groups,
        "filter_extra_samples": trained.filter_extra_samples,
        "in_flight": current.in_flight if current else 0,
        "weight_sync_verified": sync_verified,
        # the trainer's own rate (its step's tokens / its step's time), the generators' while generating
        "train_tokens_per_s": m.get("tokens_per_s", 0.0),
        "generator_tokens_per_s": (generated / gen_s) if current and gen_s else 0.0,
        # bytes this (first trainer) rank sent in the sync, and the sync's rate
        "weight_sync_bytes": last_sync.bytes_sent if sync_s and last_sync else 0,
        "weight_sync_transfer_s": last_sync.seconds if sync_s and last_sync else 0.0,
        # sync (colocated) mode sends nothing: what its copy wrote into this rank's engine
        "weight_sync_bytes_copied": last_sync.bytes_received if sync_s and last_sync else 0,
    }
    record.update({k: v for k, v in m.items() if k not in record and not isinstance(v, (list, dict))})
    return record


def log_rollouts(path: Path, step: int, version: int, samples: Sequence[Sample]) -> None:
    with open(path, "a") as f:
        for s in samples:
            line = {
                "step": step,
                "group": s.group_id,
                "reward": s.reward,
                "reward_reason": s.reward_reason,
                "answer": s.answer,
                "response": s.response_text,
                "finish_reason": s.finish_reason,
                "trained_version": version,
                "versions": s.policy_versions,
                "behaviour_logprobs": s.behaviour_logprobs,
                # the token ids: `megarl train --replay` trains on them again (replay.py)
                "prompt_tokens": s.prompt_tokens,
                "response_tokens": s.response_tokens,
                "loss_mask": s.loss_mask,
                # log pi of each response token as the trainer's loss saw it: ratios, ESS, replays
                "trainer_logprobs": s.trainer_logprobs,
                # mixture-of-experts: the generator's experts per position and layer (routes_json.py)
                "routed_experts": encode_routes(s.routed_experts),
                # multi-turn samples: turns, tool calls, tool errors, environment seconds, how it ended
                "episode": dataclasses.asdict(s.episode) if s.episode is not None else None,
            }
            f.write(json.dumps(line) + "\n")
