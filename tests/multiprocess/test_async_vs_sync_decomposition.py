"""`megarl bench async-vs-sync`'s decomposition check: measured per-sample times through the planner.

A decomposition, not a prediction: the per-sample times come from the runs whose steps they are
composed into. Every expected number below is worked out by hand from the per-step times the
test gives (LlamaRL s.7: T_sync = B/(N/m) (eta_g + eta_t), T_async = max(B/dp eta_t,
B/r eta_g) + weight sync); the code under test goes through the planner's measured tables and
evaluate_async / evaluate_sync.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


@pytest.mark.slow
def test_bench_end_to_end_tiny(tmp_path):
    """The real bench on tiny_cpu (two ~40 s runs), a decomposition check: the planner's composition
    of the per-sample times the runs measured matches the steps the same runs timed. Each mode's step is one composition of its
    phases (async: max(train, generate) + sync; sync: generate + train), and the responses all run
    to max_new_tokens, so steps do not vary enough to separate the mean of maxima from the maximum
    of means; what the model leaves out (channels, controller work) stays well under 15%."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    cmd = [
        sys.executable,
        "-m",
        "megarl.cli",
        "bench",
        "async-vs-sync",
        "--config",
        "configs/tiny_cpu.yaml",
        "--workdir",
        str(tmp_path),
        "trainer.tp=1",
        "run.steps=4",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE")}
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    dec = out["decomposition"]
    assert dec["async"]["steady_steps"] == [2, 3] and dec["sync"]["steady_steps"] == [2, 3, 4]
    for mode in ("async", "sync"):
        assert dec[mode]["composed_step_s"] == pytest.approx(dec[mode]["measured_step_s"], rel=0.15)
    assert out["composed_ratio"] == pytest.approx(out["measured_ratio"], rel=0.15)
    # the measured ratio is the steady steps' samples/s, recomputed here from metrics.jsonl
    steps = {
        m: [json.loads(x) for x in (tmp_path / m / "metrics.jsonl").read_text().splitlines()] for m in ("async", "sync")
    }
    rate = {
        m: sum(r["samples"] for r in rs) / sum(r["time_step"] for r in rs)
        for m, rs in (("async", steps["async"][1:3]), ("sync", steps["sync"][1:]))
    }
    assert out["measured_ratio"] == pytest.approx(rate["async"] / rate["sync"], abs=1e-4)
    even = max(1, (os.cpu_count() or 1) // 2)  # 2 ranks in each mode, the launcher's split
    assert dec["threads"] == {"async_trainer": even, "async_generator": even, "sync_rank": even}
