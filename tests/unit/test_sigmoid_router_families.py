"""DeepSeek-V3 and GLM-4.5 read from transformers' own configs: the ModelSpec, the Megatron-Core options it
becomes (by Megatron-LM's names), and the refusals for what the two cannot express alike. (The
conversion and the logits against transformers: tests/multiprocess/test_conversion_families.py.)"""

import pytest

from megarl.errors import UnsupportedModelError
from megarl.models.spec import ModelSpec
from tests.conftest import FAMILY_CONFIGS, TINY_CONFIG


def config(family, **overrides):
    import transformers

    cls = {"deepseek_v3": transformers.DeepseekV3Config, "glm4_moe": transformers.Glm4MoeConfig}[family]
    shape = {k: TINY_CONFIG[k] for k in ("vocab_size", "hidden_size", "intermediate_size")}
    shape.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return cls(**{**shape, **FAMILY_CONFIGS[family], **overrides}).to_dict()


def test_deepseek_v3_spec_and_its_megatron_options():
    from megarl.models.megatron_model import transformer_config

    spec = ModelSpec.from_hf_config(config("deepseek_v3"))
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    assert (spec.mla.q_lora_rank, spec.mla.kv_lora_rank, spec.mla.q_head_dim, spec.mla.v_head_dim) == (40, 22, 22, 20)
    assert spec.moe.layers == (1, 2) and spec.moe.shared_expert_ffn_hidden_size == 48
    c = transformer_config(spec, tp=2, ep=2, etp=1)
    assert type(c).__name__ == "MLATransformerConfig" and c.multi_latent_attention and c.qk_layernorm
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim) == (40, 22, 12, 10, 20)
    assert (c.rope_type, c.rotary_scaling_factor, c.original_max_position_embeddings) == ("yarn", 4.0, 64)
    assert (c.mscale, c.mscale_all_dim, c.beta_fast, c.beta_slow) == (1.0, 0.8, 32.0, 1.0)
    assert c.moe_layer_freq == [0, 1, 1] and c.num_moe_experts == 8 and c.moe_router_topk == 4
    assert (c.moe_router_score_function, c.moe_router_enable_expert_bias, c.moe_router_bias_update_rate) == (
        "sigmoid",
        True,
        0.0,  # frozen during RL
    )
    assert (c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    assert c.moe_shared_expert_intermediate_size == 48 and c.moe_router_dtype == "fp32"


def test_glm4_moe_spec_and_its_megatron_options():
    from megarl.models.megatron_model import transformer_config

    spec = ModelSpec.from_hf_config(config("glm4_moe"))
    assert spec.mla is None and spec.qkv_bias and spec.qk_norm and spec.rotary_percent == 0.5
    assert (spec.moe.num_groups, spec.moe.group_topk, spec.moe.topk_scaling_factor) == (3, 1, 1.5)
    c = transformer_config(spec, ep=2, etp=1)
    assert c.add_qkv_bias and c.qk_layernorm and c.moe_shared_expert_intermediate_size == 24
    # a model whose every group is kept routes without a group limit
    ungrouped = ModelSpec.from_hf_config(config("glm4_moe", n_group=1, topk_group=1))
    assert ungrouped.moe.num_groups == 0 and transformer_config(ungrouped).moe_router_num_groups is None


def test_parameter_count_matches_transformers():
    import transformers

    for family, cls in (("deepseek_v3", "DeepseekV3"), ("glm4_moe", "Glm4Moe")):
        cfg = getattr(transformers, f"{cls}Config")(**config(family))
        model = getattr(transformers, f"{cls}ForCausalLM")(cfg)
        # the router's expert bias is a buffer in transformers, a tensor of the checkpoint all the same
        bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
        assert ModelSpec.from_hf_config(cfg).num_parameters() == sum(p.numel() for p in model.parameters()) + bias


@pytest.mark.parametrize(
    "family, overrides, field",
    [
        ("deepseek_v3", {"norm_topk_prob": False}, "norm_topk_prob=False"),
        ("deepseek_v3", {"num_experts_per_tok": 6}, "best 2 experts in transformers and of its best 3"),
        ("deepseek_v3", {"rope_interleave": False}, "rope_interleave"),
        ("deepseek_v3", {"attention_bias": True}, "attention_bias"),
        ("deepseek_v3", {"head_dim": 16}, "head_dim=16 differs from qk_rope_head_dim=10"),
        ("deepseek_v3", {"first_k_dense_replace": 3}, "first_k_dense_replace=3"),
        (
            "deepseek_v3",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale_all_dim": 1.0}}
            | {"max_position_embeddings": 256, "original_max_position_embeddings": 64},
            "mscale and mscale_all_dim together",
        ),
        ("glm4_moe", {"n_shared_experts": 0}, "n_shared_experts"),
        ("glm4_moe", {"n_group": 4}, "n_group=4"),
    ],
)
def test_what_megatron_cannot_route_alike_is_refused(family, overrides, field):
    cfg = config(family)
    cfg.update(overrides)
    if "original_max_position_embeddings" in overrides:
        cfg["rope_parameters"]["original_max_position_embeddings"] = cfg.pop("original_max_position_embeddings")
    with pytest.raises(UnsupportedModelError, match=field):
        ModelSpec.from_hf_config(cfg, source="some/config.json")


def test_weight_sync_and_the_torch_engine_refuse_them_by_name():
    from megarl.weight_sync.layouts import logical_shapes, sglang_rank_layout

    spec = ModelSpec.from_hf_config(config("deepseek_v3"))
    for build in (logical_shapes, lambda s: sglang_rank_layout(s, tp=1, rank=0)):
        with pytest.raises(UnsupportedModelError, match="model_type 'deepseek_v3': weight sync .*issue 56"):
            build(spec)
    from megarl.generator.torch_engine.engine import TorchEngine

    with pytest.raises(UnsupportedModelError, match="model_type 'glm4_moe': the torch engine .*issue 56"):
        TorchEngine(ModelSpec.from_hf_config(config("glm4_moe")), params={})
