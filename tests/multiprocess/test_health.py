"""The health watch through the real loop (`megarl train`): a run that learns is never flagged; a run whose
learning rate climbs to 100x the recipe's collapses, is flagged within 3 steps of its reward's fall, and
with health.action=stop ends there with its checkpoint saved, saying which earlier one was good.

The task is configs/learning_cpu.yaml's tiny model on token ids, rewarded by distinct_low_ids (the distinct
ids below 30 over the response's 16): a policy that collapses onto a few tokens loses it, where the
bench's synthetic_low_ids rewards the collapse (a deterministic policy on one low id scores 1.0). The
judge's own arithmetic: tests/unit/test_health.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import run_command

LEARNING = "configs/learning_cpu.yaml"
REWARD = "reward.function=tests.rewards_for_tests:distinct_low_ids"


def _train(out: Path, *overrides):
    proc = run_command(
        [sys.executable, "-m", "megarl.cli", "train", "--config", LEARNING, f"run.output_dir={out}", REWARD, *overrides]
    )
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    metrics = [r for r in records if not r.get("eval")]  # the config's held-out evaluations are records too
    assert metrics, records
    return proc.stderr, summary, metrics


@pytest.mark.slow
def test_a_run_that_learns_is_never_flagged(tmp_path):
    """The recipe's lr 3e-3, async (KL and ESS move with the lag): the reward climbs and nothing is flagged."""
    stderr, summary, metrics = _train(tmp_path / "run", "run.steps=30", "run.progress=true")
    rewards = [m["reward_mean"] for m in metrics]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.15, rewards  # it learned
    reasons = {m["step"]: m["health_reasons"] for m in metrics if m["health_reasons"]}
    assert [m["health"] for m in metrics] == ["baseline"] * 3 + ["ok"] * 27, reasons
    assert all(m["health_degraded"] == 0 and m["health_flags"] == "" for m in metrics)
    assert summary["health"]["status"] == "ok" and summary["health"]["steps_judged"] == 30
    assert summary["health"]["flagged"] == {} and summary["health"]["first_degraded_step"] is None
    assert "health=ok" in stderr  # the progress line
    assert "megarl: health:" not in stderr


@pytest.mark.slow
def test_a_collapsing_run_is_flagged_within_3_steps_of_the_reward_fall_and_stopped(tmp_path):
    """Sync (on-policy: KL(mu || pi) and ESS see nothing, the reward check has to), the learning rate
    warming up from the recipe's 3e-3 to 0.3 over 30 steps: the policy learns, then its entropy
    collapses and the reward falls. health.reward_drop 0.1: this reward peaks near 0.45, not 1."""
    out = tmp_path / "run"
    save_every = 10
    stderr, summary, metrics = _train(
        out,
        "run.steps=30",
        "run.mode=sync",
        "trainer.dp=2",
        "optimizer.lr=0.3",
        "optimizer.lr_warmup_init=3e-3",
        "optimizer.lr_warmup_iters=30",
        "health.action=stop",
        "health.reward_drop=0.1",
        f"run.save_every={save_every}",
        "run.progress=true",
    )
    steps = [m["step"] for m in metrics]
    rewards = {m["step"]: m["reward_mean"] for m in metrics}
    flagged = [m["step"] for m in metrics if m["health_degraded"]]
    assert flagged, rewards
    first = flagged[0]
    # it learned before it was flagged: the peak before the first flag is well above the first steps
    peak = max((s for s in steps if s < first), key=rewards.get)
    assert rewards[peak] > 2 * (rewards[1] + rewards[2] + rewards[3]) / 3, rewards
    # the fall: the first step after the peak at 60% of it or less; flagged within 3 steps of it, and
    # not while the reward climbed
    fall = next(s for s in steps if s > peak and rewards[s] <= 0.6 * rewards[peak])
    assert peak < first <= fall + 3, (peak, fall, first, rewards)
    for m in metrics:
        if m["step"] < first:
            assert m["health"] == ("baseline" if m["step"] <= 3 else "ok") and m["health_flags"] == "", m
        else:  # flagged to the end: health.patience 2 stopped it after the second flagged step
            assert m["health"] == "degraded" and "reward" in m["health_flags"].split(","), m
            assert m["health_reasons"].startswith("reward: mean "), m
    # stopped at the step boundary, its checkpoint saved, the last good one named
    stop = first + 1
    assert steps[-1] == stop and metrics[-1]["stop_reason"] == "health" and summary["stop_reason"] == "health"
    checkpoint = out / "checkpoints" / f"iter_{stop:07d}"
    assert summary["checkpoint"] == str(checkpoint) and (checkpoint / "megarl_manifest.json").is_file()
    h = summary["health"]
    assert (h["status"], h["first_degraded_step"], h["steps_degraded"]) == ("degraded", first, 2)
    assert h["flagged"]["reward"] == {"first": first, "steps": 2}
    good = (first - 1) // save_every * save_every
    assert f"megarl: health: step {first} degraded: reward: mean" in stderr
    assert f"megarl: health: stopped after step {stop}: degraded 2 steps in a row from step {first} (reward" in stderr
    assert f"checkpoint of step {stop} saved in {checkpoint}" in stderr
    if good:
        assert (
            f"the last checkpoint saved before it: {out / 'checkpoints' / f'iter_{good:07d}'} (step {good})" in stderr
        )
    else:
        assert "no checkpoint was saved before it (run.save_every)" in stderr
    assert "health=DEGRADED:reward" in stderr  # the progress line
