"""scripts/gpu_check.sh's driver, run on CPU: two processes, a sync in the middle of generation."""

import pytest

from megarl.bench import gpu_check
from megarl.weight_sync.layouts import sglang_rank_layout


@pytest.mark.slow
def test_gpu_check_runs_on_cpu_and_reports_version_spans():
    result = gpu_check.main(["--device", "cpu", "--preset", "tiny", "--prompt-len", "16", "--response-len", "16",
                             "--train-samples", "8", "--train-steps", "2", "--prompts", "96", "--batch", "16",
                             "--max-new-tokens", "96"])
    spec = gpu_check._preset("tiny")
    # every element of the generator's shard crossed once, in bf16 on the wire
    assert result["sync_GB"] * 1e9 == pytest.approx(sum(t.covered_numel for t in sglang_rank_layout(spec, 1, 0)) * 2)
    assert result["version_spans_appear"]
    (v0, s0, e0), (v1, s1, e1) = result["version_spans_example"]
    assert (v0, s0, v1, e1) == (0, 0, 1, 96) and e0 == s1
    assert result["generated_tokens"] == 96 * 96 and result["trainer_tokens_per_s"] > 0
