"""Weight sync from Megatron TP x PP shards to SGLang-layout TP shards.

The trainer is a torchrun world of 8 CPU ranks running Megatron's GPTModel; the
generators are 4 workers in a second torchrun world (as SGLang's TP workers
are), meeting the trainer over a TCP-store sync group. Every generator shard
is compared with the HF tensors sliced the way SGLang's weight loaders do
(tests/sglang_reference.py).
"""

import json

import pytest

from tests.conftest import make_tiny_llama, run_tool, run_two_worlds, server_port

pytestmark = pytest.mark.slow

LAYOUTS = ["1x1", "2x1", "4x1", "1x2", "2x2", "4x2"]  # TP x PP; DP fills the 8 trainer ranks
DST_TPS = ["1", "2", "4"]  # 4, 2 and 1 generator replicas of 4 workers


def converted(base, **overrides):
    hf = make_tiny_llama(base / "hf", **overrides)
    # converted at TP1 (one process, ~2x faster than four); a dist checkpoint loads at any TP x PP
    run_tool("convert_hf_to_megatron.py", "--hf-model", hf, "--output", base / "megatron", "--tp", 1, "--pp", 1)
    return base / "megatron"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    untied = converted(tmp_path_factory.mktemp("untied"))
    tied = converted(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True)
    return [untied, tied]


def run_sync(models, out, extra=(), layouts=LAYOUTS, dst_tps=DST_TPS, trainers=8, generators=4):
    out.mkdir(parents=True, exist_ok=True)
    common = [
        "--port",
        server_port(),
        "--generators",
        generators,
        "--models",
        *models,
        "--layouts",
        *layouts,
        "--dst-tps",
        *dst_tps,
        *extra,
    ]
    run_two_worlds(
        (trainers, "weight_sync_trainer.py", *common),
        (generators, "weight_sync_generator.py", *common, "--trainers", trainers, "--out", out),
    )
    return [r for rank in range(generators) for r in json.loads((out / f"results_rank{rank}.json").read_text())]


# Transport pack thresholds, used in turn case by case (5 is prime to the 6 dtype x TP
# combinations, so each model and layout meets several): 1 KiB and 4 KiB mix packed small
# payloads with zero-copy / staged large ones, -1 is the default (everything of these
# tiny models packed), 0 packs nothing, 1 GiB packs every round whole.
PACK_BELOW = ["1024", "-1", "0", "4096", str(1 << 30)]


def test_every_generator_shard_is_bitwise_sglangs(models, tmp_path):
    results = run_sync(models, tmp_path, extra=["--pack-below", *PACK_BELOW])
    # 2 models x 6 trainer layouts x 3 generator TPs x 2 dtypes, on each of 4 workers
    assert len(results) == 2 * 6 * 3 * 2 * 4
    bad = [(r["case"], r["rank"], r["mismatches"]) for r in results if r["mismatches"]]
    assert not bad, bad[:5]
    # every worker received exactly its own elements (the replicated KV heads being its own)
    wrong = [
        (r["case"], r["rank"], r["bytes_received"], r["expected_bytes"])
        for r in results
        if r["bytes_received"] != r["expected_bytes"]
    ]
    assert not wrong, wrong[:5]
    assert {r["version"] for r in results} == set(range(1, 2 * 6 * 3 * 2 + 1))
    # packing: nothing packed -> one message per payload; packed -> fewer messages than planned
    by = {p: [r for r in results if r["pack_below"] == p] for p in (0, 1024, None, 1 << 30)}
    assert all(by.values()), {p: len(rs) for p, rs in by.items()}
    assert all(r["wire_messages"] >= r["messages"] for r in by[0])
    for p in (1024, None, 1 << 30):
        assert all(r["wire_messages"] <= r["messages"] for r in by[p])
        assert sum(r["wire_messages"] for r in by[p]) < sum(r["messages"] for r in by[p])


def test_fp8_blocks_and_scales(tmp_path_factory, models, tmp_path):
    # head_dim 128: every 128x128 block of a generator weight has one sender, which quantises it
    aligned = converted(
        tmp_path_factory.mktemp("aligned"),
        hidden_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=1024,
        num_hidden_layers=2,
    )
    # thresholds in turn: fp8 bytes direct with their scales packed (4 KiB), all direct (0), the default
    results = run_sync(
        [aligned, models[0]],
        tmp_path,
        extra=["--fp8", "--pack-below", "4096", "0", "-1", "4096"],
        layouts=["1x1", "2x1", "4x2"],
    )
    assert len(results) == 2 * 3 * 3 * 4
    for r in results:
        assert not r["mismatches"] and not r["scale_mismatches"], r
        assert r["max_fp8_error"] <= 1.0, r  # within e4m3 rounding of the bf16 source
    # sender quantisation halves the wire bytes of the linears vs bf16
    aligned_fp8 = [r for r in results if r["case"].startswith("aligned")]
    assert all(r["bytes_received"] < 0.6 * r["expected_bytes"] for r in aligned_fp8)


def test_colocated_pairs_go_through_shared_memory(models, tmp_path):
    # Every (trainer, generator) pair treated as sharing a device: the path NCCL cannot
    # take on one GPU, exercised here with CPU shared memory instead of CUDA IPC.
    results = run_sync(models[:1], tmp_path, extra=["--ipc"], layouts=["2x2", "4x1"], dst_tps=["1", "4"])
    assert len(results) == 2 * 2 * 2 * 4
    for r in results:
        assert not r["mismatches"] and r["bytes_received"] == r["expected_bytes"], r
    fp8 = run_sync(models[:1], tmp_path / "fp8", extra=["--ipc", "--fp8"], layouts=["2x1"], dst_tps=["2"])
    assert all(not r["mismatches"] and not r["scale_mismatches"] for r in fp8)


def test_smollm2_tp3_to_tp1_and_tp1_to_tp3(smollm2_megatron, tmp_path):
    # converted from the GGUF file at TP3; the reference is the HF tensors transformers read from it
    results = run_sync(
        [smollm2_megatron[0]],
        tmp_path,
        extra=["--dtypes", "bf16"],
        layouts=["3x1", "1x1"],
        dst_tps=["1", "3"],
        trainers=3,
        generators=3,
    )
    assert {r["case"].split(":")[1] for r in results} == {"3x1->tp1", "3x1->tp3", "1x1->tp1", "1x1->tp3"}
    for r in results:
        assert not r["mismatches"], r
        assert r["bytes_received"] == r["expected_bytes"], r
