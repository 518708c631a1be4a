"""`megarl train` with the trainer's Megatron knobs: an interleaved (vpp) pipeline, an LR schedule.

Both runs use the tokenizer-free tiny model and the synthetic parity reward, which
a random policy earns about half of the time, so the advantages (and the updates)
are not zero.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
TOKEN_FREE = ["model.tokenizer=none", "data.train=random:64:1:12", "reward.function=synthetic_parity"]


def train(out: Path, *overrides):
    cmd = [
        sys.executable,
        "-m",
        "megarl.cli",
        "train",
        "--config",
        TINY,
        f"run.output_dir={out}",
        *TOKEN_FREE,
        *overrides,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_interleaved_pipeline_trains_async_with_the_weight_sync_verified(tmp_path):
    # TP1 x PP2 x VPP2: each PP rank holds two model chunks (layers 0 and 2, 1 and 3); the sync
    # reads both chunks of each rank and the generator checks every shard's checksum
    metrics = train(
        tmp_path, "trainer.tp=1", "trainer.pp=2", "trainer.vpp=2", "generator.verify_sync=true", "run.steps=3"
    )
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["weight_sync_verified"] for m in metrics)
    assert metrics[0]["kl_mu_pi"] < 1e-6  # step 1: the generator holds exactly the trainer's policy
    assert all(m["grad_norm"] > 0 and not m["skipped"] for m in metrics)  # the policy does move
    assert metrics[-1]["kl_mu_pi"] > 1e-6  # and the generator trails it by up to max_lag versions


LR, MIN_LR, WARMUP, DECAY, INIT = 1e-3, 1e-4, 2, 6, 2e-4
SCHEDULE = [
    f"optimizer.lr={LR}",
    f"optimizer.min_lr={MIN_LR}",
    "optimizer.lr_decay_style=cosine",
    f"optimizer.lr_warmup_iters={WARMUP}",
    f"optimizer.lr_warmup_init={INIT}",
    f"optimizer.lr_decay_iters={DECAY}",
    "run.mode=sync",
    "trainer.tp=1",
    "rollout.prompts_per_step=2",
]


def expected_lr(n: int) -> float:
    """The lr of the update after n updates: linear warmup from INIT, then cosine to MIN_LR (written out)."""
    if n <= WARMUP:
        return INIT + (LR - INIT) * n / WARMUP
    progress = (n - WARMUP) / (DECAY - WARMUP)
    return MIN_LR + 0.5 * (1 + math.cos(math.pi * progress)) * (LR - MIN_LR)


def test_lr_follows_warmup_and_cosine_and_a_resumed_run_continues_it(tmp_path):
    straight = train(tmp_path / "straight", *SCHEDULE, "run.steps=6")
    lrs = [m["lr"] for m in straight]
    assert lrs == pytest.approx([expected_lr(n) for n in range(6)], rel=1e-12)
    # Megatron's own scheduler agrees (the formula above is not its code)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Groups:
        param_groups = [{}]

    scheduler = OptimizerParamScheduler(
        Groups(), INIT, LR, MIN_LR, WARMUP, DECAY, "cosine", 0.0, 0.0, DECAY, "constant"
    )
    megatron = []
    for _ in range(6):
        megatron.append(scheduler.get_lr({}))
        scheduler.step(1)
    assert lrs == pytest.approx(megatron, rel=1e-12)

    # 3 steps, stop, relaunch on the same directory for the other 3: the schedule carries on
    resumed_dir = tmp_path / "resumed"
    assert [m["step"] for m in train(resumed_dir, *SCHEDULE, "run.steps=3")] == [1, 2, 3]
    both = train(resumed_dir, *SCHEDULE, "run.steps=6")  # metrics.jsonl: the first run's lines, then these
    assert [m["step"] for m in both] == [1, 2, 3, 4, 5, 6]
    assert [m["lr"] for m in both] == pytest.approx(lrs, rel=1e-12)
