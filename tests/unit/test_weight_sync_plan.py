"""The weight-sync planner on shapes alone: exact coverage, exact byte counts, balance,
fp8 boxes, and the 405B plan of LlamaRL's setting (no processes started)."""

import pytest
import torch

from megarl.models.presets import preset_spec
from megarl.models.spec import ModelSpec
from megarl.parallel_dims import GeneratorDims, ParallelDims, generator_rank
from megarl.weight_sync.fp8 import FP8_LINEARS
from megarl.weight_sync.layouts import sglang_padded_vocab
from megarl.weight_sync.planner import build_plan
from megarl.weight_sync.predict import Links, predict
from megarl.weight_sync.schedule import pair_messages, receiver_quantised_params, sender_quantised_boxes
from megarl.weight_sync.transport import PACK_BELOW_BYTES, payload_specs, wire_rounds
from tests.conftest import TINY_CONFIG


def tiny(**overrides):
    return ModelSpec.from_hf_config({**TINY_CONFIG, "model_type": "llama", **overrides})


@pytest.mark.parametrize(
    "tp, pp, dp, dst_tp, replicas", [(1, 1, 2, 4, 2), (2, 2, 2, 1, 3), (4, 2, 1, 2, 2), (2, 1, 3, 4, 1)]
)
@pytest.mark.parametrize("tied", [False, True])
def test_every_destination_element_is_written_exactly_once(tp, pp, dp, dst_tp, replicas, tied):
    spec = tiny(tie_word_embeddings=tied)
    plan = build_plan(spec, ParallelDims(tp=tp, pp=pp, dp=dp), GeneratorDims(tp=dst_tp, replicas=replicas))
    for dst, layout in plan.dst_layouts.items():
        counts = {
            t.name: torch.zeros(t.shape[0], t.shape[1] if len(t.shape) > 1 else 1, dtype=torch.int32) for t in layout
        }
        for src, transfers in plan.recvs_of(dst).items():
            assert src < tp * pp * dp  # only trainer ranks send
            for t in transfers:
                counts[t.dst_param][t.dst_rows[0] : t.dst_rows[1], t.dst_cols[0] : t.dst_cols[1]] += 1
        for t in layout:
            covered = torch.zeros_like(counts[t.name])
            for b in t.blocks:
                covered[b.local_row : b.local_row + b.num_rows] = 1
            assert torch.equal(counts[t.name], covered), t.name  # once where weights live, never in padding
        assert plan.elements_received()[dst] == sum(t.covered_numel for t in layout)


def expected_sglang_elements(spec: ModelSpec, tp: int, rank: int) -> int:
    """Elements SGLang's loaders write on TP rank ``rank`` (computed from the config alone)."""
    h, f, d = spec.hidden_size, spec.ffn_hidden_size, spec.head_dim
    kv_per_rank = max(1, spec.num_kv_heads // tp)
    per_layer = (spec.num_attention_heads // tp + 2 * kv_per_rank) * d * h  # qkv_proj
    per_layer += h * spec.num_attention_heads * d // tp + 3 * h * f // tp + 2 * h  # o, gate_up, down, norms
    rows = sglang_padded_vocab(spec.vocab_size, tp) // tp
    real_rows = max(0, min(spec.vocab_size, (rank + 1) * rows) - rank * rows)
    vocab = real_rows * h * (1 if spec.tie_embeddings else 2)
    return spec.num_layers * per_layer + vocab + h


def test_llama3_405b_plan_at_1024_gpus():
    spec = preset_spec("llama3-405b")
    trainer = ParallelDims(tp=16, pp=9, dp=4)  # 576 GPUs, TP16 over 8 KV heads
    generator = GeneratorDims(tp=8, replicas=56)  # 448 GPUs, fp8
    plan = build_plan(spec, trainer, generator)
    received = plan.elements_received()
    for replica in (0, 55):
        for r in range(8):
            assert received[generator_rank(trainer, generator, replica, r)] == expected_sglang_elements(spec, 8, r)
    sent = plan.elements_sent()
    assert len(sent) == trainer.world_size and max(sent.values()) / min(sent.values()) < 1.2  # every rank sends, evenly
    p = predict(plan, fp8=True, links=Links())
    # by bandwidth alone, the busiest generator GPU receives ~51 GB of fp8 over a 50 GB/s NIC
    assert p.busiest_bandwidth_only.bandwidth_s == pytest.approx(
        max(received.values()) * (1 + 4 / 128**2) / 50e9, rel=0.05
    )
    # each of the 576 senders quantises 56 replicas' share of the linears: ~80 GB of bf16 at 90 GB/s
    linear = 56 * (spec.num_parameters() - 2 * spec.vocab_size * spec.hidden_size) / 576
    assert p.busiest.direction == "send" and p.busiest.quantised_bytes == pytest.approx(2 * linear, rel=0.05)
    assert p.busiest.quantise_s == pytest.approx(2 * linear / 90e9, rel=0.05)
    assert p.seconds == pytest.approx(p.busiest.bandwidth_s + p.busiest.latency_s + p.busiest.quantise_s)


def test_fp8_senders_quantise_every_block_of_llama_shapes():
    spec = preset_spec("llama3-405b")
    plan = build_plan(spec, ParallelDims(tp=16, pp=9, dp=1), GeneratorDims(tp=8, replicas=1))
    boxes = sender_quantised_boxes(plan)
    for r in range(8):
        assert not receiver_quantised_params(plan, 144 + r, boxes)  # head_dim 128: no block has two senders


def test_fp8_boxes_fall_back_to_the_receiver_for_unaligned_toy_shapes():
    spec = tiny()
    plan = build_plan(spec, ParallelDims(tp=2, pp=1, dp=1), GeneratorDims(tp=1, replicas=1))
    boxes = sender_quantised_boxes(plan)
    late = receiver_quantised_params(plan, 2, boxes)
    assert "model.layers.0.self_attn.qkv_proj.weight" in late  # k heads of 16 rows from two senders in one block
    kinds = {m.kind for src in (0, 1) for m in pair_messages(plan, src, 2, True, boxes)}
    assert kinds == {"copy"}


def test_tp_beyond_kv_heads_on_both_sides():
    spec = preset_spec("llama3-8b")
    plan = build_plan(spec, ParallelDims(tp=16, pp=2, dp=1), GeneratorDims(tp=16, replicas=1))
    assert plan.elements_received()[32] == expected_sglang_elements(spec, 16, 0)


@pytest.mark.parametrize("fp8", [False, True])
def test_wire_rounds_pack_small_payloads_densely(fp8):
    # llama-mini TP4 -> 2 x TP2: norms, fp8 scales and thin rectangles below 1 MiB, q/o/mlp pieces above
    spec = preset_spec("llama-mini")
    plan = build_plan(spec, ParallelDims(tp=4, pp=1, dp=1), GeneratorDims(tp=2, replicas=2))
    boxes = sender_quantised_boxes(plan) if fp8 else {}
    total, packed_any, direct_any = 0, False, False
    for src, dst in plan.transfers:
        messages = pair_messages(plan, src, dst, fp8, boxes)
        rounds = wire_rounds(messages, torch.bfloat16, bucket_bytes=8 << 20)
        assert [m for r in rounds for m in r.messages] == messages
        for r in rounds:
            assert (
                sum(_bytes(s) for m in r.messages for s in payload_specs(m, torch.bfloat16)) <= 8 << 20
                or len(r.messages) == 1
            )
            items = {(i, j) for i, m in enumerate(r.messages) for j in range(len(payload_specs(m, torch.bfloat16)))}
            packed = [(i, j) for i, j, _ in r.packed]
            assert sorted(packed + list(r.direct)) == sorted(items)  # every payload exactly once
            offset = 0
            for i, j, at in r.packed:  # dense, in order, each offset aligned for its dtype
                spec_ = payload_specs(r.messages[i], torch.bfloat16)[j]
                assert at == offset and at % spec_[1].itemsize == 0 and _bytes(spec_) < PACK_BELOW_BYTES
                offset += _bytes(spec_)
            assert r.pack_bytes == offset and len(r.packed) != 1
            small_direct = [
                ij
                for ij in r.direct
                if _bytes(payload_specs(r.messages[ij[0]], torch.bfloat16)[ij[1]]) < PACK_BELOW_BYTES
            ]
            assert not small_direct or (len(small_direct) == 1 and not r.packed)
            total += r.pack_bytes + sum(_bytes(payload_specs(r.messages[i], torch.bfloat16)[j]) for i, j in r.direct)
            packed_any |= bool(r.packed)
            direct_any |= bool(r.direct)
    assert packed_any and direct_any
    # exactly the minimum on the wire: every worker's own elements (fp8: one byte + a scale per block)
    minimum = sum(
        t.numel * (1 if fp8 and t.dst_param.endswith(FP8_LINEARS) else 2) for ts in plan.transfers.values() for t in ts
    )
    scales = sum(
        s[0][0] * s[0][1] * 4
        for (src, dst) in plan.transfers
        for m in pair_messages(plan, src, dst, fp8, boxes)
        if m.kind == "fp8"
        for s in payload_specs(m, torch.bfloat16)[1:]
    )
    assert total == minimum + scales


def _bytes(spec):
    (h, w), dtype = spec
    return h * w * dtype.itemsize


def tiny_moe(**overrides):
    """A Qwen3-MoE config: 4 experts, top 2, a dense first layer (the mixed kind)."""
    moe = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    return ModelSpec.from_hf_config({**TINY_CONFIG, **moe, "mlp_only_layers": [0], **overrides})


@pytest.mark.parametrize(
    "trainer, generator",
    [
        (ParallelDims(tp=1, dp=4, ep=4), GeneratorDims(tp=2, replicas=1, ep=2)),
        (ParallelDims(tp=2, dp=2, ep=2), GeneratorDims(tp=4, replicas=2, ep=2)),
        (ParallelDims(tp=2, pp=2, dp=2, ep=2, etp=1), GeneratorDims(tp=2, replicas=3)),
        (ParallelDims(tp=1, dp=4, ep=2, etp=2), GeneratorDims(tp=1, replicas=2)),
    ],
)
def test_every_expert_element_is_written_exactly_once(trainer, generator):
    """Experts partitioned over EP and split over ETP on the trainer, over SGLang's EP inside TP on
    the generators: every destination element once, none twice, the padding never."""
    spec = tiny_moe()
    plan = build_plan(spec, trainer, generator)
    for dst, layout in plan.dst_layouts.items():
        counts = {
            t.name: torch.zeros(
                t.numel // t.shape[-1] if len(t.shape) > 1 else t.numel,
                t.shape[-1] if len(t.shape) > 1 else 1,
                dtype=torch.int32,
            )
            for t in layout
        }
        for transfers in plan.recvs_of(dst).values():
            for t in transfers:
                counts[t.dst_param][t.dst_rows[0] : t.dst_rows[1], t.dst_cols[0] : t.dst_cols[1]] += 1
        for t in layout:
            covered = torch.zeros_like(counts[t.name])
            for b in t.blocks:
                covered[b.local_row : b.local_row + b.num_rows, :] = 1
            assert torch.equal(counts[t.name], covered), t.name
        assert any("w13_weight" in t.name for t in layout)


def expected_qwen3_moe_elements(spec: ModelSpec, tp: int, ep: int, rank: int) -> int:
    """Elements SGLang's loaders write on one TP rank of a Qwen3-MoE (every layer sparse; from the
    published shapes alone): attention and norms as for a dense model, the router whole, E/ep
    experts of 3 x h x I/(tp/ep) each."""
    h, d, moe = spec.hidden_size, spec.head_dim, spec.moe
    kv_per_rank = max(1, spec.num_kv_heads // tp)
    per_layer = (spec.num_attention_heads // tp + 2 * kv_per_rank) * d * h + h * spec.num_attention_heads * d // tp
    per_layer += 2 * h + 2 * d  # the layer norms, q_norm and k_norm
    per_layer += moe.num_experts * h + moe.num_experts // ep * 3 * h * moe.ffn_hidden_size // (tp // ep)
    rows = sglang_padded_vocab(spec.vocab_size, tp) // tp
    real_rows = max(0, min(spec.vocab_size, (rank + 1) * rows) - rank * rows)
    return spec.num_layers * per_layer + real_rows * h * 2 + h


def test_qwen3_30b_a3b_plan_sends_each_receiver_its_experts_only():
    """Trainer TP2 x PP4 x EP8 (64 GPUs, DP8) into SGLang TP4 x EP4 replicas: each generator rank
    receives exactly its 32 experts' shards of every layer and its attention shard: the minimum."""
    spec = preset_spec("qwen3-30b-a3b")
    trainer = ParallelDims(tp=2, pp=4, dp=8, ep=8)
    generator = GeneratorDims(tp=4, replicas=2, ep=4)
    plan = build_plan(spec, trainer, generator)
    received = plan.elements_received()
    for replica in range(2):
        for r in range(4):
            assert received[generator_rank(trainer, generator, replica, r)] == expected_qwen3_moe_elements(
                spec, 4, 4, r
            )
