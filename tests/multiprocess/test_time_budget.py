"""run.time_budget_min: the job stops at the first step boundary after the budget, saves, exits 0.

The budget is the run's, counted over its launches through the checkpoints: a
relaunch of the same command with the same budget trains nothing more (and says
so), and one with a larger budget continues from the checkpoint with what is left.
A tiny async run (1 trainer + 1 generator rank, token-id prompts, synthetic reward)
of 200 steps with a budget of 1.8 seconds, then 3.6.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def train(out: Path, budget_min: float):
    cmd = [
        sys.executable,
        "-m",
        "megarl.cli",
        "train",
        "--config",
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        "trainer.tp=1",
        "run.steps=200",
        "model.tokenizer=none",
        "data.train=random:64:1:12",
        "reward.function=synthetic_parity",
        f"run.time_budget_min={budget_min}",
        f"run.output_dir={out}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def metrics(out: Path):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def latest(out: Path) -> int:
    return int((out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())


def test_the_budget_stops_the_run_saves_and_a_relaunch_trains_only_what_is_left(tmp_path):
    out = tmp_path / "run"
    first = train(out, 0.03)
    found = re.search(
        r"time budget of 0\.03 min reached after step (\d+) \(([\d.]+) min of training\); "
        r"checkpoint of step \1 saved in (\S+)\.",
        first.stderr,
    )
    assert found, first.stderr[-3000:]
    k = int(found.group(1))
    assert 1 <= k < 200 and float(found.group(2)) >= 0.03
    assert found.group(3) == str(out / "checkpoints" / f"iter_{k:07d}") and latest(out) == k
    records = metrics(out)
    assert [m["step"] for m in records] == list(range(1, k + 1))
    assert records[-1]["stop_reason"] == "time_budget" and all("stop_reason" not in m for m in records[:-1])
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["stop_reason"] == "time_budget" and summary["steps"] == k and "preempted" not in summary

    # the same command again: the budget is spent, nothing is trained, the checkpoint stays
    again = train(out, 0.03)
    assert "time budget of 0.03 min already spent by this run" in again.stderr
    assert f"up to step {k});" in again.stderr and "nothing trained" in again.stderr
    assert len(metrics(out)) == k and latest(out) == k
    assert json.loads(again.stdout.strip().splitlines()[-1])["stop_reason"] == "time_budget"

    # a larger budget: the run resumes from step k and trains for what is left of it
    more = train(out, 0.06)
    found = re.search(
        r"time budget of 0\.06 min reached after step (\d+) \([\d.]+ min of training, "
        r"[\d.]+ in this launch\)",
        more.stderr,
    )
    assert found, more.stderr[-3000:]
    k2 = int(found.group(1))
    assert k < k2 < 200 and latest(out) == k2
    assert [m["step"] for m in metrics(out)] == list(range(1, k2 + 1))
