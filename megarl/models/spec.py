"""ModelSpec: the shape of a decoder-only model, read from a Hugging Face config.

One small frozen record that every other part (Megatron model builder, name
mapping, weight-sync layouts, capacity planner, reference engine) derives its
shapes from. It is stored as ``megarl_model.json`` beside every Megatron
checkpoint megarl writes, so a checkpoint can be exported or served without
the original HF directory.

The family (``model_type``) decides which architecture fields are read and how
(models/families.py): Llama, Qwen2/2.5 (QKV bias), Qwen3 (per-head q/k RMSNorm),
Qwen3-MoE (routed experts), DeepSeek-V3 (latent attention, sigmoid router, shared experts)
and GLM-4.5 (partial rotary, DeepSeek-V3's experts). Every setting comes from the HF config's own
fields; nothing is guessed from a model's name.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from megarl.errors import ConfigError, UnsupportedModelError
from megarl.models.families import family_of
from megarl.models.mla_spec import MlaSpec
from megarl.models.moe_spec import MoeSpec


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.x frequency-dependent RoPE scaling (rope_type 'llama3')."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (rope_type 'yarn') as DeepSeek-V3 configures it: Megatron-Core's YarnRotaryEmbedding
    inside MLA, with the same names (rotary_scaling_factor = factor)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0  # scales cos / sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    mscale_all_dim: float = 0.0  # and the softmax scale by mscale(factor, mscale_all_dim) ** 2


@dataclass(frozen=True)
class ModelSpec:
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
    rope_scaling: Optional[Union[Llama3RopeScaling, YarnRopeScaling]] = None
    model_type: str = "llama"  # the HF config's; selects the family (models/families.py)
    qkv_bias: bool = False  # biases on q/k/v (Qwen2): Megatron's add_qkv_bias
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3): qk_layernorm
    moe: Optional[MoeSpec] = None  # routed experts (Qwen3-MoE); None: every layer dense
    mla: Optional[MlaSpec] = None  # multi-head latent attention (DeepSeek-V3) in place of q/k/v
    rotary_percent: float = 1.0  # the share of each head's width RoPE turns (GLM-4.5: 0.5)
    # Kept so an export can write back the config the model came with.
    hf_config: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_kv_heads

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused QKV weight: q heads plus one k and one v head per KV group."""
        return (self.num_attention_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe.layers) if self.moe else 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(layer)

    def _attention_parameters(self) -> int:
        h = self.hidden_size
        if self.mla:
            return self.mla.parameters(h, self.num_attention_heads) + 2 * h
        biases = self.qkv_rows if self.qkv_bias else 0
        norms = 2 * self.head_dim if self.qk_norm else 0
        return self.qkv_rows * h + self.num_attention_heads * self.head_dim * h + biases + norms + 2 * h

    def _moe_layer_parameters(self, experts: int) -> int:
        m, h = self.moe, self.hidden_size
        shared = 3 * h * m.shared_expert_ffn_hidden_size
        bias = m.num_experts if m.router_expert_bias else 0
        return experts * 3 * h * m.ffn_hidden_size + m.num_experts * h + bias + shared

    def num_parameters(self) -> int:
        h = self.hidden_size
        total = self.num_layers * self._attention_parameters() + self.num_dense_layers * 3 * h * self.ffn_hidden_size
        if self.moe:
            total += self.num_moe_layers * self._moe_layer_parameters(self.moe.num_experts)
        embeddings = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return total + embeddings + h

    def num_active_parameters(self) -> int:
        """Parameters one token goes through: the top-k experts of each MoE layer, not all."""
        if not self.moe:
            return self.num_parameters()
        every, active = self.moe.num_experts, self.moe.top_k
        return self.num_parameters() - self.num_moe_layers * (
            self._moe_layer_parameters(every) - self._moe_layer_parameters(active)
        )

    def check_parallelism(
        self, tp: int, pp: int = 1, vp: Optional[int] = None, ep: int = 1, etp: Optional[int] = None
    ) -> None:
        """Raise ConfigError naming both numbers when a layout cannot shard this model.

        ``etp`` (expert_tensor_parallel_size) defaults to ``tp``, as in Megatron-Core."""
        etp = tp if etp is None else etp
        sizes = (
            ("tensor_model_parallel_size", tp),
            ("pipeline_model_parallel_size", pp),
            ("expert_model_parallel_size", ep),
            ("expert_tensor_parallel_size", etp),
        )
        for name, value in sizes:
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if not self.moe and (ep, etp) != (1, tp):
            raise ConfigError(
                f"expert_model_parallel_size={ep} / expert_tensor_parallel_size={etp}: the model "
                f"(model_type {self.model_type!r}) has no experts; leave them at 1 / the TP size"
            )
        checks = [
            ("num_attention_heads", self.num_attention_heads, "tensor_model_parallel_size", tp),
            ("num_hidden_layers", self.num_layers, "pipeline_model_parallel_size", pp),
        ]
        if self.num_dense_layers:
            checks.insert(1, ("intermediate_size", self.ffn_hidden_size, "tensor_model_parallel_size", tp))
        if self.moe:
            checks += [
                ("num_experts", self.moe.num_experts, "expert_model_parallel_size", ep),
                ("moe_intermediate_size", self.moe.ffn_hidden_size, "expert_tensor_parallel_size", etp),
            ]
            if self.moe.shared_expert_ffn_hidden_size:
                width = self.moe.shared_expert_ffn_hidden_size
                checks.append(("n_shared_experts x moe_intermediate_size", width, "tensor_model_parallel_size", tp))
        if self.mla:
            # Megatron's local spec splits the down projections' outputs over TP too (then gathers them)
            if self.mla.q_lora_rank is not None:
                checks.append(("q_lora_rank", self.mla.q_lora_rank, "tensor_model_parallel_size", tp))
            kv_down = self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
            checks.append(("kv_lora_rank + qk_rope_head_dim", kv_down, "tensor_model_parallel_size", tp))
        if self.mla is None and tp <= self.num_kv_heads:
            checks.insert(1, ("num_key_value_heads", self.num_kv_heads, "tensor_model_parallel_size", tp))
        for field, count, par_name, par in checks:
            if count % par:
                raise ConfigError(
                    f"{par_name}={par} does not divide {field}={count}: each rank must hold a "
                    f"whole number of them (choose a {par_name} that divides {count})"
                )
        if self.mla is None and tp > self.num_kv_heads and tp % self.num_kv_heads:
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
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelSpec":
        d = dict(d)
        if d.get("rope_scaling"):
            kind = YarnRopeScaling if "beta_fast" in d["rope_scaling"] else Llama3RopeScaling
            d["rope_scaling"] = kind(**d["rope_scaling"])
        if d.get("mla"):
            d["mla"] = MlaSpec(**d["mla"])
        if d.get("moe"):
            moe = dict(d["moe"])
            d["moe"] = MoeSpec(**{**moe, "layers": tuple(moe["layers"])})
        return cls(**d)

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: Path) -> "ModelSpec":
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def from_hf_config(cls, config: Any, source: str = "config") -> "ModelSpec":
        """Build from a transformers PretrainedConfig or a config.json dict.

        Raises UnsupportedModelError naming the field for anything the model's family
        (models/families.py) does not run: an unknown model_type, biases it lacks, sliding
        windows, other activations or RoPE variants.
        """
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        family = family_of(cfg, source)
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"{source}: hidden_act={cfg['hidden_act']!r} is not supported ({family.model_type} uses 'silu')"
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
        mla = family.mla(cfg, source)
        if mla is not None:
            head_dim = mla.qk_rope_head_dim  # transformers' DeepseekV3Config.head_dim: RoPE's width
        rope_theta, rope_scaling = _read_rope(cfg, source, yarn=mla is not None)
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
            model_type=family.model_type,
            qkv_bias=family.qkv_bias(cfg, source),
            qk_norm=family.qk_norm(cfg, source),
            moe=family.moe(cfg, source),
            mla=mla,
            rotary_percent=family.rotary_percent(cfg, source),
            hf_config=_jsonable(cfg),
        )


def _read_rope(cfg: Mapping[str, Any], source: str, yarn: bool = False):
    """(rope_theta, scaling): Llama 3 scaling for any family, YaRN where Megatron-Core has it (MLA)."""
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
    if yarn and rope_type == "yarn":
        return float(theta), _read_yarn(params, field, source)
    if rope_type != "llama3" or yarn:  # MLA builds its own RoPE: default or YaRN
        supported = "'default', 'yarn'" if yarn else "'default', 'llama3'"
        raise UnsupportedModelError(
            f"{source}: {field}.rope_type={rope_type!r} is not supported (supported: {supported})"
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


def _read_yarn(params: Mapping[str, Any], field: str, source: str) -> YarnRopeScaling:
    for unknown in ("attention_factor", "truncate"):
        # Megatron derives the cos / sin factor from mscale / mscale_all_dim and always truncates
        if params.get(unknown) not in (None, True if unknown == "truncate" else None):
            raise UnsupportedModelError(f"{source}: {field}.{unknown}={params[unknown]!r} is not supported")
    if ("mscale" in params) != ("mscale_all_dim" in params):
        # transformers then falls back to 0.1 ln(factor) + 1; Megatron divides by mscale_all_dim's
        raise UnsupportedModelError(f"{source}: {field} of rope_type 'yarn' gives mscale and mscale_all_dim together")
    try:
        scaling = YarnRopeScaling(
            factor=float(params["factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=float(params.get("mscale", 1.0)),
            mscale_all_dim=float(params.get("mscale_all_dim", 0.0)),
        )
    except (KeyError, TypeError) as missing:
        raise UnsupportedModelError(f"{source}: {field} of rope_type 'yarn' lacks {missing}") from None
    if not math.isfinite(scaling.factor) or scaling.factor <= 0:
        raise UnsupportedModelError(f"{source}: {field}.factor must be positive, got {scaling.factor}")
    return scaling


def _jsonable(cfg: Mapping[str, Any]) -> dict:
    out = {}
    for key, value in cfg.items():
        try:
            json.dumps(value)
        except TypeError:
            continue
        out[key] = value
    return out
