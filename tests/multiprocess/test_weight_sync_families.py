"""Weight sync of Qwen2 (q/k/v biases), Qwen3 (q/k norms) and Qwen3-MoE (router and experts) from
Megatron's shards, at TP, PP and EP / ETP, into SGLang's layout (FusedMoE's w13/w2, its --ep-size
inside TP). Four trainer ranks run Megatron's GPTModel loaded from the converted checkpoint; two
generator workers compare every tensor with tests/sglang_reference.py, written from SGLang's
loaders, and count the bytes they received against the elements SGLang's loader writes."""

import pytest

from tests.conftest import make_tiny_family, run_tool
from tests.multiprocess.test_weight_sync import run_sync

pytestmark = pytest.mark.slow


def converted(base, family, **overrides):
    hf = make_tiny_family(family, base / "hf", **overrides)
    run_tool("convert_hf_to_megatron.py", "--hf-model", hf, "--output", base / "megatron")
    return base / "megatron"


def check(results, cases):
    assert len(results) == cases * 2  # every case on both workers
    bad = [(r["case"], r["rank"], r["mismatches"]) for r in results if r["mismatches"]]
    assert not bad, bad[:5]
    wrong = [(r["case"], r["rank"], r["bytes_received"], r["expected_bytes"]) for r in results]
    assert all(got == want for _, _, got, want in wrong), [w for w in wrong if w[2] != w[3]][:5]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_dense_families(family, tmp_path):
    model = converted(tmp_path / family, family)
    layouts, dsts = ["2x1", "1x2", "2x2"], ["1", "2"]
    results = run_sync([model], tmp_path / "out", layouts=layouts, dst_tps=dsts, trainers=4, generators=2)
    check(results, len(layouts) * len(dsts) * 2)


def test_experts_at_ep_and_etp(tmp_path):
    """EP4 over DP4, EP2 x ETP2, PP2 x EP2 and plain DP4 (every rank holds every expert) into
    generator TP1, TP2 (moe_tp 2: expert rows split) and TP2 x EP2 (experts split)."""
    model = converted(tmp_path / "moe", "qwen3_moe")
    layouts, dsts = ["1x1e4", "1x1e2t2", "1x2e2", "2x1e2", "2x1", "1x1"], ["1", "2", "2e2"]
    results = run_sync([model], tmp_path / "out", layouts=layouts, dst_tps=dsts, trainers=4, generators=2)
    check(results, len(layouts) * len(dsts) * 2)


def test_fp8_experts_blocks_and_scales(tmp_path):
    """Block fp8 into FusedMoE's w13 / w2 and their per-expert weight_scale_inv, quantised by the
    senders: TP2 x EP2 -> TP2 (SGLang's EP2 inside it), EP2 x PP2 -> TP2 x EP2, ETP2 -> TP1, and
    EP4 -> TP2 (each expert's rows split over SGLang's moe_tp 2); ETP4's 64-row expert shards fill
    one 128-row block from two senders, so those arrive bf16 and the receiver quantises them
    (bytes not checked for it). Shapes of whole 128 x 128 blocks
    (hidden and head_dim 128, experts of 256 rows, a dense first layer), as SGLang's block-fp8
    FusedMoE requires of each expert's shard; every fp8 tensor and scale equals
    tests/sglang_reference.py's per-expert quantisation, and the bytes received are exactly the
    e4m3 bytes, the fp32 scales and the bf16 rest, counted from the reference's shapes."""
    model = converted(
        tmp_path / "aligned_moe",
        "qwen3_moe",
        hidden_size=128,
        head_dim=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=256,
        moe_intermediate_size=256,
    )
    layouts, dsts = ["2x1e2", "1x2e2", "1x1e2t2", "1x1e4", "1x1e1t4"], ["1", "2", "2e2"]
    results = run_sync(
        [model],
        tmp_path / "out",
        extra=["--fp8", "--pack-below", "4096", "0", "-1"],
        layouts=layouts,
        dst_tps=dsts,
        trainers=4,
        generators=2,
    )
    assert len(results) == len(layouts) * len(dsts) * 2
    for r in results:
        assert not r["mismatches"] and not r["scale_mismatches"], r
        assert r["max_fp8_error"] <= 1.0, r  # within e4m3 rounding of the bf16 source
    senders_quantise = [r for r in results if ":1x1e1t4->" not in r["case"]]
    assert len(senders_quantise) == (len(layouts) - 1) * len(dsts) * 2
    wrong = [(r["case"], r["rank"], r["bytes_received"], r["expected_fp8_bytes"]) for r in senders_quantise]
    assert all(got == want for _, _, got, want in wrong), [w for w in wrong if w[2] != w[3]][:5]
