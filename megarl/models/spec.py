"""LlamaSpec: the shape of a Llama-family model, read from a Hugging Face config.

One small frozen record that every other part (Megatron model builder, name
mapping, weight-sync layouts, capacity planner) derives its shapes from. It is
stored as ``megarl_model.json`` beside every Megatron checkpoint megarl writes,
so a checkpoint can be exported or served without the original HF directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

from megarl.errors import ConfigError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama",)
# Fields whose presence (with a truthy value) means a non-Llama architecture.
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x frequency-dependent RoPE scaling (rope_type 'llama3')."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LlamaSpec:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_embeddings: bool
    rope_scaling: Optional[Llama3RopeScaling] = None
    # Kept so an export can write back the config the model came with.
    hf_config: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused QKV weight: q heads plus one k and one v head per KV group."""
        return (self.num_attention_heads + 2 * self.num_kv_heads) * self.head_dim

    def num_parameters(self) -> int:
        h, f, layers = self.hidden_size, self.ffn_hidden_size, self.num_layers
        per_layer = self.qkv_rows * h + self.num_attention_heads * self.head_dim * h + 3 * h * f + 2 * h
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return layers * per_layer + embeddings + h

    def check_parallelism(self, tp: int, pp: int = 1, vp: Optional[int] = None) -> None:
        """Raise ConfigError naming both numbers when a layout cannot shard this model."""
        for name, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        checks = [
            ("num_attention_heads", self.num_attention_heads, "tensor_model_parallel_size", tp),
            ("intermediate_size", self.ffn_hidden_size, "tensor_model_parallel_size", tp),
            ("num_hidden_layers", self.num_layers, "pipeline_model_parallel_size", pp),
        ]
        if tp <= self.num_kv_heads:
            checks.insert(1, ("num_key_value_heads", self.num_kv_heads, "tensor_model_parallel_size", tp))
        for field, count, par_name, par in checks:
            if count % par:
                raise ConfigError(
                    f"{par_name}={par} does not divide {field}={count}: each rank must hold a "
                    f"whole number of them (choose a {par_name} that divides {count})"
                )
        if tp > self.num_kv_heads and tp % self.num_kv_heads:
            # Megatron-Core runs tp > n_kv (each rank all-gathers QKV and keeps one group),
            # but only when every KV group spans a whole number of ranks.
            raise ConfigError(
                f"tensor_model_parallel_size={tp} is larger than num_key_value_heads={self.num_kv_heads} "
                f"and not a multiple of it"
            )
        if vp is not None and self.num_layers % (pp * vp):
            raise ConfigError(
                f"pipeline_model_parallel_size={pp} x virtual_pipeline_model_parallel_size={vp} "
                f"does not divide num_hidden_layers={self.num_layers}"
            )

    # -- (de)serialisation -------------------------------------------------------------------

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["hf_config"] = dict(self.hf_config)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LlamaSpec":
        d = dict(d)
        if d.get("rope_scaling"):
            d["rope_scaling"] = Llama3RopeScaling(**d["rope_scaling"])
        return cls(**d)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: Path) -> "LlamaSpec":
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def from_hf_config(cls, config: Any, source: str = "config") -> "LlamaSpec":
        """Build from a transformers PretrainedConfig or a config.json dict.

        Raises UnsupportedModelError naming the field for anything that is not a
        plain Llama (biases, MoE, other activations or RoPE variants).
        """
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{source}: unsupported architecture model_type={model_type!r} "
                f"(architectures={cfg.get('architectures')}); megarl runs Llama-family models "
                f"(model_type {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        for field in ("attention_bias", "mlp_bias"):
            if cfg.get(field):
                raise UnsupportedModelError(f"{source}: {field}={cfg[field]} is not supported (Llama has no biases)")
        for field in _MOE_FIELDS:
            if cfg.get(field):
                raise UnsupportedModelError(
                    f"{source}: {field}={cfg[field]}: mixture-of-experts models are not supported"
                )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"{source}: hidden_act={cfg['hidden_act']!r} is not supported (Llama uses 'silu')"
            )
        if cfg.get("pretraining_tp", 1) not in (1, None):
            raise UnsupportedModelError(f"{source}: pretraining_tp={cfg['pretraining_tp']} is not supported")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        for field in required:
            if not isinstance(cfg.get(field), int) or cfg[field] <= 0:
                raise UnsupportedModelError(f"{source}: {field} must be a positive integer, got {cfg.get(field)!r}")
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"{source}: num_key_value_heads={kv_heads} does not divide num_attention_heads={heads}"
            )
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope_theta, rope_scaling = _read_rope(cfg, source)
        return cls(
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg["intermediate_size"],
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            hf_config=_jsonable(cfg),
        )


def _read_rope(cfg: Mapping[str, Any], source: str):
    # transformers >= 5 stores RoPE under rope_parameters (with rope_theta inside);
    # config.json files written by older versions use rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    field = "rope_parameters" if params else "rope_scaling"
    params = {**legacy, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"{source}: {field}.rope_type={rope_type!r} is not supported (supported: 'default', 'llama3')"
        )
    try:
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise UnsupportedModelError(f"{source}: {field} of rope_type 'llama3' lacks {missing}") from None
    if not math.isfinite(scaling.factor) or scaling.factor <= 0:
        raise UnsupportedModelError(f"{source}: {field}.factor must be positive, got {scaling.factor}")
    return float(theta), scaling


def _jsonable(cfg: Mapping[str, Any]) -> dict:
    out = {}
    for key, value in cfg.items():
        try:
            json.dumps(value)
        except TypeError:
            continue
        out[key] = value
    return out
