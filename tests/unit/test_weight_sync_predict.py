"""The weight-sync time model (predict.py) against numbers worked out by hand, and
`megarl bench weight-sync --plan-only --config` (no processes started)."""

import json
from pathlib import Path

import pytest

from megarl.models.spec import ModelSpec
from megarl.parallel_dims import GeneratorDims, ParallelDims
from megarl.weight_sync.planner import build_plan
from megarl.weight_sync.predict import Links, predict
from tests.conftest import TINY_CONFIG


def tiny():
    return ModelSpec.from_hf_config({**TINY_CONFIG, "model_type": "llama"})


def one_to_one(spec):
    return build_plan(spec, ParallelDims(tp=1, pp=1, dp=1), GeneratorDims(tp=1, replicas=1))


# The tiny Llama (vocab 300, hidden 64, ffn 96, 4 layers, 4 heads of 16, 2 KV heads, untied):
# embed + lm_head 2 x 300 x 64 = 38400; per layer q 4096 + k 2048 + v 2048 + o 4096 + gate, up,
# down 3 x 6144 + two norms 128 = 30848, x 4 = 123392; final norm 64: 161856 elements, bf16 on
# the wire: 323712 bytes. At 1 GB/s: 323.712 us.
TINY_BYTES_US = 323.712


def test_per_message_latency_by_hand():
    plan = one_to_one(tiny())
    links = Links(gpus_per_node=1, network_gb_s=1.0, message_latency_us=10.0)  # every pair across nodes
    # Every tensor of this model is far below 1 MiB and the whole model fits one 64 MiB round:
    # one header + one pack = 2 messages each way, 20 us.
    packed = predict(plan, fp8=False, links=links)
    assert packed.busiest.messages == 2
    assert packed.seconds == pytest.approx((TINY_BYTES_US + 20.0) * 1e-6, rel=1e-9)
    # Nothing packed: one message per rectangle. TP1 -> TP1: embed_tokens, lm_head, the final norm,
    # and per layer two norms, o, gate, up, down, and q, k, v as two rectangles each (Megatron's
    # fused QKV is grouped per KV group, 2 groups; SGLang's stacks all q, then k, then v) = 12;
    # 3 + 48 = 51 messages + the header = 52, 520 us.
    direct = predict(plan, fp8=False, links=links, pack_below_bytes=0)
    assert direct.busiest.messages == 52
    assert direct.seconds == pytest.approx((TINY_BYTES_US + 520.0) * 1e-6, rel=1e-9)
    assert direct.busiest.bandwidth_s == pytest.approx(TINY_BYTES_US * 1e-6, rel=1e-9)


def test_sender_fp8_quantisation_by_hand():
    # One layer, head_dim 128, every linear one 128 x 128 block: q, k, v, o, gate, up, down = 7
    # blocks the sender quantises (7 x 16384 elements = 229376 bf16 bytes: 229.376 us at 1 GB/s).
    spec = ModelSpec.from_hf_config(
        {
            **TINY_CONFIG,
            "model_type": "llama",
            "hidden_size": 128,
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "vocab_size": 256,
        }
    )
    plan = one_to_one(spec)
    links = Links(gpus_per_node=1, network_gb_s=1.0, message_latency_us=0.0, fp8_quant_gb_s=1.0)
    p = predict(plan, fp8=True, links=links)
    # On the wire: 7 x (16384 e4m3 + one 4-byte scale) = 114716 bytes; bf16 embed_tokens and
    # lm_head 2 x 256 x 128 x 2 = 131072 and three norms of 128 x 2 = 768: 246556 bytes, 246.556 us
    # each way; the sender adds its quantisation.
    assert p.busiest.rank == 0 and p.busiest.direction == "send"
    assert p.busiest.quantised_bytes == 229376
    assert p.busiest.bandwidth_s == pytest.approx(246.556e-6, rel=1e-9)
    assert p.seconds == pytest.approx((246.556 + 229.376) * 1e-6, rel=1e-9)


def test_plan_only_reads_a_run_config(capsys):
    from megarl.bench.weight_sync import WeightSyncBench, run

    # configs/tiny_cpu.yaml: model random:tiny, trainer TP2, one generator replica at TP1
    result = run(
        WeightSyncBench(plan_only=True, config="configs/tiny_cpu.yaml", dst_replicas=2, message_latency_us=7.0)
    )
    assert result["model"] == "tiny" and result["trainer"].startswith("TP2 x PP1")
    assert result["generator"] == "2 x TP1 = 2 GPUs"  # the flag overrides the config
    assert result["assumptions"]["message_latency_us"] == 7.0 and result["assumptions"]["network_GB_s"] == 50.0
    assert result["kind"].startswith("prediction")
    out = capsys.readouterr().out.strip().splitlines()
    assert "not a measurement" in out[1] and "assumptions" in out[2]
    assert json.loads(out[-1])["predicted_seconds"] == result["predicted_seconds"]


def test_plan_only_plans_the_configs_virtual_stages(tmp_path, monkeypatch):
    # trainer.vpp interleaves layers over the PP ranks (rank 0 of PP2 x VPP2 holds layers 0 and 2
    # of the tiny model's 4), so the plan must be built with it, not with one chunk per rank.
    import megarl.bench.weight_sync as weight_sync_bench
    import megarl.weight_sync.planner as planner
    from megarl.bench.weight_sync import WeightSyncBench, run
    from megarl.errors import ConfigError

    text = Path("configs/tiny_cpu.yaml").read_text()
    text = text.replace("trainer:\n  tp: 2\n", "trainer:\n  tp: 1\n  pp: 2\n  vpp: 2\n")
    config = tmp_path / "vpp.yaml"
    config.write_text(text)
    seen = []
    real = planner.build_plan
    monkeypatch.setattr(weight_sync_bench, "build_plan", lambda spec, t, g, *a: seen.append(t) or real(spec, t, g, *a))
    result = run(WeightSyncBench(plan_only=True, config=str(config)))
    assert result["trainer"] == "TP1 x PP2 x DP1 x VPP2 = 2 GPUs"
    assert [(t.pp, t.vpp) for t in seen] == [(2, 2)]
    # the measured run builds one chunk per PP rank: refused, naming the flag, before any process starts
    with pytest.raises(ConfigError, match="--src-vpp 2"):
        run(WeightSyncBench(model="tiny", src_tp=1, src_pp=2, src_vpp=2))


def test_plan_only_plans_the_configs_experts(tmp_path, monkeypatch):
    # configs/tiny_moe_cpu.yaml: trainer EP2 over DP2, one generator replica at TP2 with SGLang's
    # --ep-size 2. The plan must be built at those expert layouts, and every receiving GPU gets
    # exactly its SGLang shard: the bytes of tests/sglang_reference.py's shards of the HF tensors.
    import transformers
    from safetensors.torch import load_file

    import megarl.bench.weight_sync as weight_sync_bench
    import megarl.weight_sync.planner as planner
    from megarl.bench.weight_sync import WeightSyncBench, run
    from megarl.models.presets import preset_config
    from tests.sglang_reference import sglang_shard

    seen = []
    real = planner.build_plan
    monkeypatch.setattr(
        weight_sync_bench, "build_plan", lambda spec, t, g, *a: seen.append((t, g)) or real(spec, t, g, *a)
    )
    result = run(WeightSyncBench(plan_only=True, config="configs/tiny_moe_cpu.yaml"))
    assert result["model"] == "tiny-moe"
    assert result["trainer"] == "TP1 x PP1 x DP2 x EP2 = 2 GPUs" and result["generator"] == "1 x TP2 (EP2) = 2 GPUs"
    assert [(t.ep, t.expert_tp, g.ep) for t, g in seen] == [(2, 1, 2)]

    config = preset_config("tiny-moe")
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    hf.save_pretrained(tmp_path)  # the hub layout (one tensor per expert), as SGLang loads it
    full = {n: t for f in sorted(tmp_path.glob("*.safetensors")) for n, t in load_file(f).items()}

    def received(rank):  # bf16 bytes of the shard, less SGLang's vocabulary padding (no trainer holds it)
        total = 0
        for name, t in sglang_shard(full, config, tp=2, rank=rank, ep=2).items():
            rows = t.shape[0]
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                rows = max(0, min(rows, config["vocab_size"] - rank * rows))
            total += rows * t[0].numel() * 2
        return total

    shard_bytes = [received(r) for r in (0, 1)]
    assert shard_bytes[0] > shard_bytes[1]  # 300 rows of 320: rank 1 holds the 20 padding rows
    assert result["min_bytes_per_receiving_gpu"] == min(shard_bytes)
    assert result["max_bytes_per_receiving_gpu"] == max(shard_bytes)

    from megarl.errors import ConfigError

    # a measured layout that cannot shard the experts is refused before any process starts
    with pytest.raises(ConfigError, match=r"--dst-ep=3 must divide --dst-tp=2"):
        run(WeightSyncBench(model="tiny-moe", src_tp=1, src_dp=2, src_ep=2, dst_tp=2, dst_ep=3, dst_replicas=1))
    # fp8: SGLang's block-fp8 FusedMoE refuses tiny-moe's 32-row expert shards; qwen3-moe-mini's experts
    # (768 rows) are planned in fp8: they are 61% of its weights, so counted bf16 the fp8 plan would
    # move 0.96 of the bf16 bytes, counted fp8 0.66
    with pytest.raises(ConfigError, match=r"--fp8: each expert's intermediate shard .* = 32 rows"):
        run(WeightSyncBench(plan_only=True, config="configs/tiny_moe_cpu.yaml", fp8=True))
    layout = dict(plan_only=True, model="qwen3-moe-mini", src_tp=1, src_dp=2, src_ep=2, dst_tp=2, dst_ep=2)
    bf16, fp8 = (run(WeightSyncBench(**layout, fp8=f))["max_bytes_per_receiving_gpu"] for f in (False, True))
    assert fp8 < 0.75 * bf16
