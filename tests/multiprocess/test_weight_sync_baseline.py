"""The benchmark's baseline (baseline.py, what slime does: TP all-gather, per-stage flattened
buckets broadcast to every generator worker) delivers exactly SGLang's shard.

Real Megatron shards (HF -> convert tool -> Megatron checkpoint -> GPTModel) at TP x PP
layouts with PP > 1 (and DP 2) on 4 trainer ranks; 4 generator workers in a second world
compare what landed with tests/sglang_reference.py's shard of the HF tensors, bitwise.
(Its fp8 path is checked where it runs: `megarl bench weight-sync --fp8` compares the
generator weights both paths leave, `baseline_same_weights`.)
"""

import json

import pytest

from tests.conftest import make_tiny_llama, run_tool, run_two_worlds, server_port

pytestmark = pytest.mark.slow


def converted(base, **overrides):
    hf = make_tiny_llama(base / "hf", **overrides)
    # converted at TP1 (one process, ~2x faster); Megatron's dist checkpoint loads at any TP x PP
    run_tool("convert_hf_to_megatron.py", "--hf-model", hf, "--output", base / "megatron", "--tp", 1, "--pp", 1)
    return base / "megatron"


def run_baseline(models, out, layouts, dst_tps, extra=()):
    out.mkdir(parents=True, exist_ok=True)
    # a 16 KiB bucket: several buckets per stage, tensors of several params in one bucket
    common = [
        "--port",
        server_port(),
        "--generators",
        4,
        "--models",
        *models,
        "--layouts",
        *layouts,
        "--dst-tps",
        *dst_tps,
        "--baseline",
        "--bucket-bytes",
        16384,
        *extra,
    ]
    run_two_worlds(
        (4, "weight_sync_trainer.py", *common), (4, "weight_sync_generator.py", *common, "--trainers", 4, "--out", out)
    )
    return [r for rank in range(4) for r in json.loads((out / f"results_rank{rank}.json").read_text())]


def test_baseline_delivers_sglangs_shard_at_pp2(tmp_path_factory, tmp_path):
    untied = converted(tmp_path_factory.mktemp("untied"))
    tied = converted(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True)
    results = run_baseline([untied, tied], tmp_path / "fp32", ["2x2", "1x2"], ["1", "4"], extra=["--dtypes", "fp32"])
    assert len(results) == 2 * 2 * 2 * 4  # models x layouts (TP2xPP2, TP1xPP2xDP2) x dst TPs x workers
    bad = [(r["case"], r["rank"], r["mismatches"]) for r in results if r["mismatches"]]
    assert not bad, bad[:5]
    # every worker received the whole model (the full tensors it cuts its shard from)
    for r in results:
        whole = "->tp1:" in r["case"]
        assert r["bytes_received"] == r["expected_bytes"] if whole else r["bytes_received"] > r["expected_bytes"], r


def test_baseline_gathers_experts_over_ep_and_etp(tmp_path):
    """slime's expert path: each expert parameter all-gathered over the expert-tensor x expert-model
    parallel group, the stage source broadcasting every expert whole; the workers' FusedMoE shards
    (TP1, TP2's moe_tp 2, TP2 x EP2) equal SGLang's, in bf16 and in block fp8 (whole-block shapes)."""
    from tests.multiprocess.test_weight_sync_families import converted as converted_family

    moe = converted_family(tmp_path / "moe", "qwen3_moe")
    aligned = converted_family(
        tmp_path / "aligned_moe",
        "qwen3_moe",
        hidden_size=128,
        head_dim=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=256,
        moe_intermediate_size=256,
    )
    layouts, dsts = ["1x1e4", "1x1e2t2", "2x1e2", "1x2e2"], ["1", "2", "2e2"]
    bf16 = run_baseline([moe], tmp_path / "bf16", layouts, dsts, extra=["--dtypes", "bf16"])
    fp8 = run_baseline([aligned], tmp_path / "fp8", ["1x1e2t2", "2x1e2"], ["2", "2e2"], extra=["--fp8"])
    assert len(bf16) == 4 * 3 * 4 and len(fp8) == 2 * 2 * 4
    bad = [(r["case"], r["rank"], r["mismatches"] + r["scale_mismatches"]) for r in bf16 + fp8]
    assert not [b for b in bad if b[2]], [b for b in bad if b[2]][:5]
    for r in bf16:  # a TP1 worker keeps every full tensor it was sent: the whole model, once
        whole = "->tp1:" in r["case"]
        assert r["bytes_received"] == r["expected_bytes"] if whole else r["bytes_received"] > r["expected_bytes"], r
