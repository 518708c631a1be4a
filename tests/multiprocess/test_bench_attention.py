"""`megarl bench attention` runs end to end at small rows and reports both paths (no timing asserted:
speed claims live in the benchmark's output, not in tests)."""

import json
import sys

from tests.conftest import run_command


def test_bench_attention_reports_both_paths_per_row_length():
    proc = run_command(
        [
            sys.executable,
            "-m",
            "megarl.cli",
            "bench",
            "attention",
            "--seq",
            "64",
            "128",
            "--dtype",
            "fp32",
            "--reps",
            "2",
        ]
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the arguments reach the benchmark: the dtype and exactly the row lengths asked for
    assert out["dtype"] == "fp32" and (out["heads"], out["groups"]) == (9, 3)
    assert sorted(k for k in out if k.isdigit()) == ["128", "64"]
    assert all(set(out[seq]) == {"megatron_ms", "sdpa_ms", "sdpa_speedup"} for seq in ("64", "128"))
