"""SdpaDotProductAttention (megarl/models/sdpa_attention.py) against Megatron's own
DotProductAttention: the same outputs and q/k/v gradients, in fp32 to float rounding and
in bf16 to the dtype's rounding, on a packed row under megarl's segment mask and causal."""

import json
import sys

from tests.conftest import WORKERS, run_command


def test_sdpa_core_attention_matches_megatrons_dot_product_attention():
    proc = run_command([sys.executable, WORKERS / "sdpa_attention_checks.py"])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["local_spec_uses_sdpa"]
    assert out["sdpa_calls"] == 4  # 2 dtypes x 2 masks, all through the fused kernel
    for dtype, tol in (("fp32", 1e-5), ("bf16", 0.02)):
        # the mask matters: ignoring the segments would move the output by ~3.6
        assert out[f"segments_vs_causal_{dtype}"] > 1.0
        for case in ("segments", "causal"):
            got = out[f"{case}_{dtype}"]
            assert got["shape"] == [96, 2, 576]
            for what, diff, ref in zip(("output", "dq", "dk", "dv"), got["max_abs"], got["max_ref"]):
                # relative to the largest entry: bf16 keeps 8 bits (one rounding is 0.4%)
                assert diff <= tol * ref, (case, dtype, what, diff, ref)
