"""ModelSpec: reading Hugging Face configs, and the errors for what megarl cannot run."""

import pytest

from megarl.errors import ConfigError, UnsupportedModelError
from megarl.models.megatron_model import padded_vocab_size
from megarl.models.spec import ModelSpec
from tests.conftest import TINY_CONFIG


def llama_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_CONFIG, **overrides}).to_dict()


def test_reads_gqa_untied_llama3_rope():
    spec = ModelSpec.from_hf_config(llama_config())
    assert (spec.num_layers, spec.hidden_size, spec.ffn_hidden_size) == (4, 64, 96)
    assert (spec.num_attention_heads, spec.num_kv_heads, spec.head_dim, spec.q_per_kv) == (4, 2, 16, 2)
    assert spec.qkv_rows == (4 + 2 * 2) * 16
    assert spec.rope_theta == 500000.0 and not spec.tie_embeddings
    assert spec.rope_scaling.original_max_position_embeddings == 64
    assert ModelSpec.from_dict(spec.to_dict()) == spec


def test_reads_legacy_rope_fields_of_older_config_json():
    legacy = {k: v for k, v in llama_config().items() if k != "rope_parameters"}
    legacy.update(rope_theta=500000.0, rope_scaling=dict(TINY_CONFIG["rope_scaling"]))
    assert ModelSpec.from_hf_config(legacy) == ModelSpec.from_hf_config(llama_config())


def test_parameter_count_matches_transformers(tiny_hf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    spec = ModelSpec.from_hf_config(model.config)
    assert spec.num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"model_type": "mistral"}, "model_type='mistral'"),
        ({"model_type": "qwen2_moe"}, "not built yet: a shared expert"),
        ({"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window"),
        ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
        ({"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 8}, "num_experts_per_tok"),
        (
            {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8}
            | {"mlp_only_layers": [0, 1, 2, 3]},
            "no layer is a mixture-of-experts layer",
        ),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_local_experts": 8}, "num_local_experts"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type='yarn'"),
    ],
)
def test_unsupported_architectures_name_the_field(overrides, field):
    config = {**llama_config(), **overrides}
    with pytest.raises(UnsupportedModelError, match=field.replace("(", r"\(").replace("[", r"\[")):
        ModelSpec.from_hf_config(config, source="some/config.json")


def test_qwen3_moe_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    # transformers' rule: sparse where the layer is not in mlp_only_layers and (i + 1) % step == 0
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True,
    )  # fmt: skip
    spec = ModelSpec.from_hf_config(cfg)
    sparse = tuple(i for i in range(6) if isinstance(Qwen3MoeDecoderLayer(cfg, i).mlp, Qwen3MoeSparseMoeBlock))
    assert spec.moe.layers == sparse == (1, 5)
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.ffn_hidden_size, spec.moe.norm_topk_prob) == (4, 2, 8, True)
    assert spec.qk_norm and not spec.qkv_bias
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ConfigError, match=r"expert_model_parallel_size=3 does not divide num_experts=4"):
        spec.check_parallelism(1, 1, ep=3)
    with pytest.raises(ConfigError, match=r"expert_tensor_parallel_size=3 does not divide moe_intermediate_size=8"):
        spec.check_parallelism(2, 1, ep=2, etp=3)
    spec.check_parallelism(2, 1, ep=4, etp=1)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_family_parameter_counts_match_transformers(family):
    import transformers

    shape = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4)
    shape.update(num_key_value_heads=2, head_dim=16, tie_word_embeddings=family == "qwen2")
    if family == "qwen3_moe":
        shape.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12, mlp_only_layers=[1])
    config = transformers.AutoConfig.for_model(family, **shape)
    model = transformers.AutoModelForCausalLM.from_config(config)
    spec = ModelSpec.from_hf_config(config)
    assert spec.model_type == family and spec.qkv_bias == (family == "qwen2")
    assert spec.num_parameters() == sum(p.numel() for p in model.parameters())


def test_tp_that_does_not_divide_heads_names_both_numbers():
    spec = ModelSpec.from_hf_config(llama_config())
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=3 does not divide num_attention_heads=4"):
        spec.check_parallelism(3, 1)
    spec.check_parallelism(4, 1)  # tp > n_kv: Megatron all-gathers QKV
    wide = ModelSpec.from_hf_config(llama_config(num_attention_heads=6, num_key_value_heads=2, hidden_size=96))
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=4 does not divide num_attention_heads=6"):
        wide.check_parallelism(4, 1)
    odd = ModelSpec.from_hf_config(llama_config(num_attention_heads=6, num_key_value_heads=2, hidden_size=96))
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=3 is larger than num_key_value_heads=2"):
        odd.check_parallelism(3, 1)
    with pytest.raises(ConfigError, match=r"pipeline_model_parallel_size=3 does not divide num_hidden_layers=4"):
        spec.check_parallelism(1, 3)
    spec.check_parallelism(2, 4)


def test_megatron_vocab_padding():
    assert padded_vocab_size(300, tp=1) == 384
    assert padded_vocab_size(300, tp=2) == 512
    assert padded_vocab_size(128256, tp=8) == 129024  # Llama 3 at TP8
    assert padded_vocab_size(49152, tp=3) == 49152


@pytest.mark.parametrize(
    "name, total, active",
    # Qwen's published counts (model cards: 8.2B; 30.5B total / 3.3B activated; 235B / 22B)
    [("qwen3-8b", 8.2e9, 8.2e9), ("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9)],
)
def test_qwen3_presets_have_the_published_parameter_counts(name, total, active):
    """64 experts instead of 128 (15.7B), top-4 instead of top-8 (2.2B active) or a missing q/k norm
    family each leave the 1% / 3% bounds."""
    from megarl.models.presets import preset_spec

    spec = preset_spec(name)
    assert abs(spec.num_parameters() / total - 1) < 0.01
    assert abs(spec.num_active_parameters() / active - 1) < 0.03
    assert spec.qk_norm and spec.model_type == ("qwen3" if name == "qwen3-8b" else "qwen3_moe")
