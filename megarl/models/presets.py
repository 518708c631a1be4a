"""Named model shapes (Hugging Face config fields) for planning and benchmarks.

Only shapes: nothing here downloads weights. ``llama3-*`` are the published
Llama 3.1 configurations; ``qwen3-*`` the published Qwen3 ones (config.json of
Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, the fields megarl reads);
``llama-mini`` is a ~150M-parameter Llama-shaped model for CPU benchmarks;
``tiny`` matches the test suite's model.
"""

from __future__ import annotations

from megarl.errors import ConfigError
from megarl.models.spec import ModelSpec

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}

PRESETS = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "llama3-70b": dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    "llama3-405b": dict(
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    # Llama 3.2 1B's shape with an untied head (the sync moves both ends): the one-GPU checks' model
    "llama3-1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
    ),
    # head_dim 128 and ffn/TP a multiple of 128 like Llama 3, so block-fp8 boxes align as at scale
    "llama-mini": dict(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
    ),
}


_QWEN3 = dict(
    hidden_act="silu",
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=False,
    head_dim=128,
    vocab_size=151936,
)
_QWEN3_MOE = dict(_QWEN3, model_type="qwen3_moe", num_experts=128, num_experts_per_tok=8, norm_topk_prob=True) | dict(
    decoder_sparse_step=1, mlp_only_layers=[]
)

# whole HF configs (their own family, RoPE and norms), read as config.json is
HF_CONFIGS = {
    # scripts/gpu_check.sh --preset qwen3-moe-mini: Qwen3-30B-A3B's layer shape (hidden 2048, experts of
    # 768, top 8, 32 q / 4 kv heads of 128) with 8 layers and 32 experts: 1.98B parameters, 1.08B active
    "qwen3-moe-mini": dict(
        _QWEN3_MOE,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=4,
        num_experts=32,
    ),
    # configs/tiny_moe_cpu.yaml's model: Qwen3-MoE's structure (q/k norms, a dense first layer, then
    # 4 experts top 2 with renormalised weights) at the test suite's tiny shape
    "tiny-moe": dict(
        _QWEN3,
        model_type="qwen3_moe",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        vocab_size=300,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
    ),
    "qwen3-8b": dict(
        _QWEN3,
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
    "qwen3-30b-a3b": dict(
        _QWEN3_MOE,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
    ),
    "qwen3-235b-a22b": dict(
        _QWEN3_MOE,
        hidden_size=4096,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=94,
        num_attention_heads=64,
        num_key_value_heads=4,
    ),
}


def preset_config(name: str) -> dict:
    if name in HF_CONFIGS:
        return {**HF_CONFIGS[name], "rope_parameters": dict(HF_CONFIGS[name]["rope_parameters"])}
    if name not in PRESETS:
        raise ConfigError(f"model preset {name!r} is unknown; choose one of {sorted(PRESETS) + sorted(HF_CONFIGS)}")
    config = dict(
        model_type="llama",
        hidden_act="silu",
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_parameters=dict(_LLAMA3_ROPE),
        **PRESETS[name],
    )
    if name in ("llama-mini", "tiny"):
        config.update(max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return config


def preset_spec(name: str) -> ModelSpec:
    return ModelSpec.from_hf_config(preset_config(name), source=f"preset {name}")
