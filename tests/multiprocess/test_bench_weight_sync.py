"""`megarl bench weight-sync`, measured on the tiny model: both paths must leave the same generator
weights, and the bytes each moves are counted here from the model's shapes and the two layouts
(Megatron's and SGLang's sharding rules written out), not read from the benchmark's counters."""

from __future__ import annotations

import json
import math

import pytest

from megarl.bench.weight_sync import WeightSyncBench, run

# the tiny preset (megarl/models/presets.py): untied embeddings, head_dim 16
H, F, HEADS, KV_HEADS, HEAD_DIM, VOCAB, LAYERS = 64, 96, 4, 2, 16, 300, 4


NORMS = (2 * LAYERS + 1) * H  # two RMSNorms per layer and the final one


BF16 = 2


def hf_numel() -> int:
    """Every Hugging Face tensor of the model once: what a baseline worker receives whole."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    per_layer = q * H + 2 * kv * H + H * q + 3 * F * H
    return LAYERS * per_layer + 2 * VOCAB * H + NORMS


def megatron_sharded_numel(tp: int) -> int:
    """Megatron's TP-sharded parameters over the whole model (QKV, proj, fc1, fc2, embedding and
    output layer), the vocabulary padded to a multiple of 128 x TP (make_vocab_size_divisible_by)."""
    padded = math.ceil(VOCAB / (128 * tp)) * 128 * tp
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    per_layer = (q + 2 * kv) * H + H * q + 2 * F * H + H * F
    return LAYERS * per_layer + 2 * padded * H


def sglang_shards_numel(tp: int) -> int:
    """What the generator ranks of one replica hold between them: every HF element once (the KV heads
    split, not replicated, while tp <= KV_HEADS; vocabulary padding rows are not weights), plus the
    norms every TP rank keeps whole."""
    assert tp <= KV_HEADS
    return hf_numel() + (tp - 1) * NORMS


def fp8_shard_bytes(tp: int) -> int:
    """One replica's shards in block fp8: the linear weights at a byte per element plus one fp32 scale
    per 128 x 128 block of each rank's shard; norms, embedding and output layer stay bf16."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shards = [((q + 2 * kv) // tp, H), (H, q // tp), (2 * F // tp, H), (H, F // tp)]  # qkv, o, gate_up, down
    linear = sum(r * c + 4 * math.ceil(r / 128) * math.ceil(c / 128) for r, c in shards)
    return tp * LAYERS * linear + BF16 * (2 * VOCAB * H + tp * NORMS)


@pytest.mark.slow
def test_bf16_same_weights_and_both_byte_counts(capsys):
    # trainer TP2 (the baseline all-gathers) -> one generator replica at TP2 (shards, replicated norms)
    out = run(WeightSyncBench(model="tiny", src_tp=2, src_pp=1, src_dp=1, dst_tp=2, dst_replicas=1, iters=1))
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(out))
    assert out["baseline_same_weights"] is True and out["same_wire_format"] is True
    assert out["wire_formats"] == {"megarl": "bf16", "baseline": "bf16"} and "note" not in out
    # megarl: every generator rank receives its own shard once, in bf16
    assert out["bytes_moved"] == out["min_bytes"] == BF16 * sglang_shards_numel(2)
    # the baseline: each TP rank all-gathers the other rank's half of every sharded tensor (one DP
    # replica, one stage), then each of the 2 workers receives every full HF tensor
    assert out["baseline_gathered_bytes"] == BF16 * megatron_sharded_numel(2)
    assert out["baseline_broadcast_bytes_received"] == 2 * BF16 * hf_numel()
    assert out["baseline_bytes_moved"] == out["baseline_gathered_bytes"] + out["baseline_broadcast_bytes_received"]
    assert out["speedup_vs_gather_broadcast"] == out["baseline_seconds"] / out["seconds"]


@pytest.mark.slow
def test_fp8_on_tiny_says_the_formats_differ_and_still_compares_the_weights(capsys):
    # head_dim 16: SGLang's TP2 shards are not whole 128 x 128 blocks, so the baseline sends bf16.
    # The trainer at TP1 x PP2 holds every layer whole on one rank, so megarl's sender quantises
    # every generator weight itself: fp8 and block scales on the wire.
    out = run(WeightSyncBench(model="tiny", src_tp=1, src_pp=2, src_dp=1, dst_tp=2, dst_replicas=1, iters=1, fp8=True))
    assert out["wire_formats"] == {"megarl": "fp8", "baseline": "bf16"} and out["same_wire_format"] is False
    assert out["note"].startswith("not the same bytes") and "not the same bytes" in capsys.readouterr().err
    assert out["baseline_same_weights"] is True  # megarl's fp8 = the baseline's bf16 shards quantised
    assert out["bytes_moved"] == fp8_shard_bytes(2)
    assert out["baseline_gathered_bytes"] == 0  # TP1: nothing to gather
    assert out["baseline_broadcast_bytes_received"] == 2 * BF16 * hf_numel()


# the tiny-moe preset (megarl/models/presets.py HF_CONFIGS): the tiny shape with Qwen3's q/k norms, a
# dense first layer, then 3 MoE layers of 4 experts (intermediate 32) and a router each
E, MOE_F, MOE_LAYERS, QK_NORMS = 4, 32, 3, 2 * HEAD_DIM * LAYERS


def moe_hf_numel() -> int:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    attention = LAYERS * (q * H + 2 * kv * H + H * q) + QK_NORMS
    mlp = 3 * F * H + MOE_LAYERS * (E * H + E * 3 * MOE_F * H)
    return attention + mlp + 2 * VOCAB * H + NORMS


@pytest.mark.slow
def test_experts_megarl_shard_to_shard_baseline_gathers_over_ep():
    # trainer EP2 (each rank 2 of the 4 experts) -> one replica at TP2 x EP2 (each rank 2 experts whole)
    out = run(
        WeightSyncBench(model="tiny-moe", src_tp=1, src_dp=2, src_ep=2, dst_tp=2, dst_ep=2, dst_replicas=1, iters=1)
    )
    assert out["baseline_same_weights"] is True and out["same_wire_format"] is True
    # megarl: each worker its shard once; norms, q/k norms and routers are whole on both workers
    replicated = NORMS + QK_NORMS + MOE_LAYERS * E * H
    assert out["bytes_moved"] == out["min_bytes"] == BF16 * (moe_hf_numel() + replicated)
    # the baseline: each EP rank all-gathers the other's 2 experts of every MoE layer (TP1: nothing
    # dense), then both workers receive every full HF tensor
    assert out["baseline_gathered_bytes"] == BF16 * MOE_LAYERS * E * 3 * MOE_F * H
    assert out["baseline_broadcast_bytes_received"] == 2 * BF16 * moe_hf_numel()
