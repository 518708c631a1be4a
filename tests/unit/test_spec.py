"""LlamaSpec: reading Hugging Face configs, and the errors for what megarl cannot run."""

import pytest

from megarl.errors import ConfigError, UnsupportedModelError
from megarl.models.megatron_llama import padded_vocab_size
from megarl.models.spec import LlamaSpec
from tests.conftest import TINY_CONFIG


def llama_config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_CONFIG, **overrides}).to_dict()


def test_reads_gqa_untied_llama3_rope():
    spec = LlamaSpec.from_hf_config(llama_config())
    assert (spec.num_layers, spec.hidden_size, spec.ffn_hidden_size) == (4, 64, 96)
    assert (spec.num_attention_heads, spec.num_kv_heads, spec.head_dim, spec.q_per_kv) == (4, 2, 16, 2)
    assert spec.qkv_rows == (4 + 2 * 2) * 16
    assert spec.rope_theta == 500000.0 and not spec.tie_embeddings
    assert spec.rope_scaling.original_max_position_embeddings == 64
    assert LlamaSpec.from_dict(spec.to_dict()) == spec


def test_reads_legacy_rope_fields_of_older_config_json():
    legacy = {k: v for k, v in llama_config().items() if k != "rope_parameters"}
    legacy.update(rope_theta=500000.0, rope_scaling=dict(TINY_CONFIG["rope_scaling"]))
    assert LlamaSpec.from_hf_config(legacy) == LlamaSpec.from_hf_config(llama_config())


def test_parameter_count_matches_transformers(tiny_hf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_hf)
    spec = LlamaSpec.from_hf_config(model.config)
    assert spec.num_parameters() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"model_type": "qwen2"}, "model_type='qwen2'"),
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
        LlamaSpec.from_hf_config(config, source="some/config.json")


def test_tp_that_does_not_divide_heads_names_both_numbers():
    spec = LlamaSpec.from_hf_config(llama_config())
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=3 does not divide num_attention_heads=4"):
        spec.check_parallelism(3, 1)
    spec.check_parallelism(4, 1)  # tp > n_kv: Megatron all-gathers QKV
    wide = LlamaSpec.from_hf_config(llama_config(num_attention_heads=6, num_key_value_heads=2, hidden_size=96))
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=4 does not divide num_attention_heads=6"):
        wide.check_parallelism(4, 1)
    odd = LlamaSpec.from_hf_config(llama_config(num_attention_heads=6, num_key_value_heads=2, hidden_size=96))
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
