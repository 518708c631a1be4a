"""Block fp8 for a model's experts: FusedMoE's stacked w13 / w2 quantised expert by expert (SGLang's
Fp8MoEMethod: scales [E, rows/128, cols/128]), the shapes SGLang refuses refused before any rank
starts, and the torch engine serving them = transformers on the same dequantised weights."""

import pytest
import torch

from megarl.errors import ConfigError
from megarl.generator.torch_engine.model import KVCache, Segment, SglangLayoutModel
from megarl.generator.weights import load_generator_params
from megarl.models.hf_checkpoint import SafetensorsCheckpoint
from megarl.models.spec import ModelSpec
from megarl.weight_sync import fp8 as fp8_format
from tests.conftest import make_tiny_family
from tests.sglang_reference import block_fp8

# whole 128 x 128 blocks everywhere, as SGLang's block-fp8 FusedMoE needs of an expert's shard
ALIGNED = dict(
    hidden_size=128,
    head_dim=128,
    num_attention_heads=2,
    num_key_value_heads=2,
    intermediate_size=256,
    moe_intermediate_size=256,
    num_hidden_layers=3,
)


@pytest.mark.parametrize("shape", [(3, 256, 200), (2, 200, 128)])
def test_stacked_experts_quantise_expert_by_expert(shape):
    """[E, R, C] with whole-block rows (one 2-D quantisation of the [E x R, C] view) and without
    (expert by expert): the e4m3 bytes and scales of tests/sglang_reference.py's per-expert blocks."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    w[1] *= 40.0  # experts of different magnitudes: a block shared by two experts would show
    q, scale = fp8_format.quantize(w)
    want_q, want_scale = block_fp8(w)
    assert scale.shape == want_scale.shape == (shape[0], -(-shape[1] // 128), -(-shape[2] // 128))
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    deq = fp8_format.dequantize(q, scale)
    for e in range(shape[0]):
        assert torch.equal(deq[e], fp8_format.dequantize(want_q[e], want_scale[e]))


def test_shapes_sglang_refuses_are_refused_naming_the_field():
    from transformers import Qwen3MoeConfig

    def spec(**kw):
        return ModelSpec.from_hf_config(Qwen3MoeConfig(**{**ALIGNED, "num_experts": 4, "num_experts_per_tok": 2, **kw}))

    fp8_format.check_fp8_experts(spec(), tp=2, ep=1)  # experts' rows 256 / 2 = 128
    fp8_format.check_fp8_experts(spec(), tp=4, ep=2)  # moe_tp 2
    # SGLang's Fp8MoEMethod: "The output_size of gate's and up's weight = 64 is not divisible by ... 128"
    with pytest.raises(
        ConfigError, match=r"generator.fp8: .*moe_intermediate_size 256 / \(tensor_parallel 4 / ep 1\) = 64"
    ):
        fp8_format.check_fp8_experts(spec(), tp=4, ep=1)
    with pytest.raises(ConfigError, match=r"generator.fp8: hidden_size 192 is not a multiple of 128"):
        fp8_format.check_fp8_experts(spec(hidden_size=192), tp=1, ep=1)


def test_engine_serves_fp8_experts_as_transformers_does_their_dequantised_weights(tmp_path):
    """The engine's fp8 experts (each with its own scales) against transformers' Qwen3-MoE whose every
    linear, experts included, is replaced by its block-fp8 value (per expert: tests/sglang_reference.py)."""
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_family("qwen3_moe", tmp_path / "hf", **ALIGNED)
    hf = SafetensorsCheckpoint(model_dir)
    params = load_generator_params(hf, 1, 0, torch.float32, fp8=True)
    assert params["model.layers.1.mlp.experts.w13_weight"].dtype == fp8_format.FP8_DTYPE
    assert params["model.layers.1.mlp.experts.w2_weight_scale_inv"].shape == (4, 1, 2)
    model = SglangLayoutModel(hf.spec, params)
    ids = torch.randint(0, hf.spec.vocab_size, (13,), generator=torch.Generator().manual_seed(1))
    cache = KVCache(hf.spec.num_layers, 1, model.kv_heads, 32, hf.spec.head_dim, torch.float32)
    got = model.forward(ids, torch.arange(len(ids)), [Segment(0, 0, len(ids), 0)], cache)

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager").eval()
    with torch.no_grad():
        exact = ref(ids[None]).logits[0]
        for name, p in ref.named_parameters():
            linear = name.endswith("_proj.weight") or name.endswith(("experts.gate_up_proj", "experts.down_proj"))
            if name.startswith("model.layers.") and linear:
                p.copy_(fp8_format.dequantize(*block_fp8(p)))
        want = ref(ids[None]).logits[0]
    assert (got - want).abs().max() <= 1e-4
    assert (want - exact).abs().max() >= 1e-2  # fp8 moved the logits: the comparison above sees it
