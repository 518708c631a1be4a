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
