"""megarl/bench/mfu.py against FLOPs counted by hand for known shapes."""

import dataclasses

import pytest

from megarl.bench import mfu
from megarl.models.presets import preset_spec


def test_dense_train_step_flops_equal_a_hand_count():
    # preset "tiny": hidden 64, ffn 96, 4 layers, 4 heads of 16, 2 KV heads, vocab 300, untied head.
    # One sequence of 10 tokens whose last 6 positions the loss reads.
    spec = preset_spec("tiny")
    assert (spec.hidden_size, spec.ffn_hidden_size, spec.num_layers) == (64, 96, 4)
    assert (spec.num_attention_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (4, 2, 16, 300)
    # multiply-adds per token and layer:
    qkv = 64 * (4 + 2 + 2) * 16  # 8192: q (4 heads) + k and v (2 heads each) of 16
    out_proj = 4 * 16 * 64  # 4096
    mlp = 64 * 96 + 64 * 96 + 96 * 64  # 18432: gate, up, down
    per_token = 4 * (qkv + out_proj + mlp)  # 122880 over the 4 layers
    # core attention, causal: query t meets t + 1 keys: 1 + 2 + ... + 10 = 55 (query, key) pairs,
    # each 16 multiply-adds for Q K^T and 16 for P V, per head and layer
    attention = 55 * (16 + 16) * 4 * 4  # 28160
    logits = 6 * 64 * 300  # 115200: the output layer on the 6 read positions
    # the input embedding is a lookup: no multiply-adds
    hand = 6 * (10 * per_token + attention + logits)  # 2 per multiply-add forward, 4 backward
    assert hand == 8232960
    assert mfu.train_step_flops(spec, [(10, 6)]) == hand
    # two sequences attend each within itself: not one sequence of 20 tokens
    assert mfu.train_step_flops(spec, [(10, 6), (10, 6)]) == 2 * hand
    assert mfu.train_step_flops(spec, [(20, 12)]) != 2 * hand

    # the mistakes this count guards against would each fail it: the old 6 x parameters x tokens
    # (the input embedding as if multiplied, the logits layer at every position, no attention) ...
    assert 6 * spec.num_parameters() * 10 != hand
    # ... or the embedding counted, or a forward-only 2x
    assert mfu.train_step_flops(spec, [(10, 6)]) + 6 * 10 * 64 * 300 != hand
    assert 2 * (10 * per_token + attention + logits) != hand


def test_moe_train_step_flops_count_the_router_and_top_k_experts_only():
    # preset "tiny-moe": as "tiny" but layer 0 dense (mlp_only_layers [0]), layers 1-3 with
    # 4 experts of ffn 32, top 2, a router of 4 outputs
    spec = preset_spec("tiny-moe")
    assert spec.moe.layers == (1, 2, 3) and (spec.moe.num_experts, spec.moe.top_k, spec.moe.ffn_hidden_size) == (
        4,
        2,
        32,
    )
    attention_linears = 4 * (64 * 8 * 16 + 4 * 16 * 64)  # 49152: QKV and out projection, 4 layers
    dense = 3 * 64 * 96  # 18432: layer 0's MLP
    moe = 3 * (64 * 4 + 2 * 3 * 64 * 32)  # 37632: router + 2 experts of gate/up/down, layers 1-3
    assert mfu.layer_matmul_macs_per_token(spec) == attention_linears + dense + moe == 105216
    hand = 6 * (3 * 105216 + (1 + 2 + 3) * 32 * 4 * 4 + 2 * 64 * 300)
    assert mfu.train_step_flops(spec, [(3, 2)]) == hand
    # every expert counted (the model's parameters rather than a token's) would fail the count
    every = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, top_k=4))
    assert mfu.train_step_flops(every, [(3, 2)]) != hand


def test_mfu_and_datasheet_peaks():
    assert mfu.mfu(989e12 * 0.25 * 2.0, 2.0, 989e12) == pytest.approx(0.25, rel=1e-12)
    assert mfu.mfu(1e12, 1.0, None) is None and mfu.mfu(1e12, 0.0, 1e15) is None
    # the first matching name wins: an H200 is not an H20, a PCIe H100 not an SXM one
    assert mfu.datasheet_peak("NVIDIA H200") == 989e12
    assert mfu.datasheet_peak("NVIDIA H20") == 148e12
    assert mfu.datasheet_peak("NVIDIA H100 PCIe") == 756e12
    assert mfu.datasheet_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert mfu.datasheet_peak("cpu") is None
