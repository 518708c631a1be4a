"""Dynamic sampling end to end: rollout.filter_groups keeps groups of one reward away from the trainer."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_no_group_of_identical_rewards_is_trained_and_the_batch_stays_full(tmp_path, mode):
    # even_length: a random response earns 1 about half of the time, so with 2 samples per prompt
    # about half of all groups have one reward for both samples
    cmd = [
        sys.executable,
        "-m",
        "megarl.cli",
        "train",
        "--config",
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        f"run.mode={mode}",
        "run.steps=3",
        "rollout.filter_groups=true",
        "reward.function=tests.rewards_for_tests:even_length",
        f"run.output_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    groups = defaultdict(list)
    for r in rollouts:
        groups[(r["step"], r["group"])].append(r["reward"])
    assert all(len(set(rewards)) == 2 for rewards in groups.values())  # both rewards in every trained group
    assert [m["samples"] for m in metrics] == [8, 8, 8]  # prompts_per_step 4 x 2 samples, as configured
    assert sum(m["filtered_groups"] for m in metrics) > 0
    # each filtered group was replaced by exactly one more group of 2 samples
    assert [m["filter_extra_samples"] for m in metrics] == [2 * m["filtered_groups"] for m in metrics]
