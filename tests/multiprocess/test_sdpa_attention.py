"""SdpaDotProductAttention (megarl/models/sdpa_attention.py) against Megatron's own
DotProductAttention: the same outputs and q/k/v gradients, in fp32 to float rounding and
in bf16 to the dtype's rounding, on a packed row under megarl's segment mask (attended per
segment), under a mask that is not block-diagonal (one masked call), and causal."""

import json
import sys

from tests.conftest import WORKERS, run_command


def test_sdpa_core_attention_matches_megatrons_dot_product_attention():
    proc = run_command([sys.executable, WORKERS / "sdpa_attention_checks.py"])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["local_spec_uses_sdpa"]
    # megarl's packed row is found to be 4 causal segments (3 samples + the padding); a mask where one
    # sample also sees another's prefix is not block-diagonal and takes the masked call
    assert out["segments_found"] == [[0, 40], [40, 73], [73, 88], [88, 96]]
    assert out["shared_prefix_segments"] is None
    for tag in ("fp32", "bf16"):
        calls = [c[1:] for c in out["sdpa_calls"] if c[0] == f"segments_{tag}"]
        assert calls == [[40, True, False], [33, True, False], [15, True, False], [8, True, False]]
        assert [c[1:] for c in out["sdpa_calls"] if c[0] == f"shared_prefix_{tag}"] == [[96, False, True]]
        assert [c[1:] for c in out["sdpa_calls"] if c[0] == f"causal_{tag}"] == [[96, True, False]]
    for dtype, tol in (("fp32", 1e-5), ("bf16", 0.02)):
        # the mask matters: ignoring the segments would move the output by ~3.6
        assert out[f"segments_vs_causal_{dtype}"] > 1.0
        for case in ("segments", "shared_prefix", "causal"):
            got = out[f"{case}_{dtype}"]
            assert got["shape"] == [96, 2, 576]
            for what, diff, ref in zip(("output", "dq", "dk", "dv"), got["max_abs"], got["max_ref"]):
                # relative to the largest entry: bf16 keeps 8 bits (one rounding is 0.4%)
                assert diff <= tol * ref, (case, dtype, what, diff, ref)
