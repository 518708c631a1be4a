"""The model families megarl runs, each read from its Hugging Face config's own fields.

A family is chosen by the config's ``model_type`` and says which architecture
fields exist and what they mean; nothing is guessed from a model's name.

    llama       the base: RMSNorm, RoPE (incl. Llama-3 scaling), GQA, SwiGLU, no biases
    qwen2       Llama + biases on q/k/v (always, in Qwen2Attention); Qwen2.5 is this type
    qwen3       Llama + RMSNorm over each q and k head before RoPE (q_norm / k_norm)
    qwen3_moe   Qwen3 + routed experts (softmax router, top-k, optional renormalisation,
                no shared expert) on the layers decoder_sparse_step / mlp_only_layers name

The tensor names of each family are in models/hf_mapping.py. DeepSeek-V3 and
GLM-4.5 MoE (sigmoid router with expert bias, shared experts, MLA for DeepSeek)
have their MoeSpec fields but no family yet: they are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from megarl.errors import UnsupportedModelError
from megarl.models.moe_spec import MoeSpec

Config = Mapping[str, Any]


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # transformers' (and SGLang's) model class, written into exported configs
    qkv_bias: Callable[[Config, str], bool]
    qk_norm: bool
    moe: Callable[[Config, str], Optional[MoeSpec]]


def _no_biases(cfg: Config, source: str) -> bool:
    # Llama's attention_bias puts biases on o_proj too, Qwen3's as well; neither is built
    for field in ("attention_bias", "mlp_bias"):
        if cfg.get(field):
            raise UnsupportedModelError(
                f"{source}: {field}={cfg[field]} is not supported for model_type {cfg.get('model_type')!r}"
            )
    return False


def _qkv_biases(cfg: Config, source: str) -> bool:
    return True  # Qwen2Attention: q/k/v with bias=True, o_proj without; no config field


def _no_experts(cfg: Config, source: str) -> Optional[MoeSpec]:
    for field in ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size"):
        if cfg.get(field):
            raise UnsupportedModelError(
                f"{source}: {field}={cfg[field]}: model_type {cfg.get('model_type')!r} has no experts "
                f"(mixture-of-experts Qwen3 is model_type 'qwen3_moe')"
            )
    return None


def _positive_int(cfg: Config, field: str, source: str) -> int:
    value = cfg.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UnsupportedModelError(f"{source}: {field} must be a positive integer, got {value!r}")
    return value


def _qwen3_moe_experts(cfg: Config, source: str) -> Optional[MoeSpec]:
    # config.json from the hub says num_experts; transformers 5 writes it as num_local_experts
    field = "num_experts" if cfg.get("num_experts") is not None else "num_local_experts"
    experts = _positive_int(cfg, field, source)
    top_k = _positive_int(cfg, "num_experts_per_tok", source)
    if top_k > experts:
        raise UnsupportedModelError(f"{source}: num_experts_per_tok={top_k} is more than {field}={experts}")
    step = _positive_int({"decoder_sparse_step": cfg.get("decoder_sparse_step", 1)}, "decoder_sparse_step", source)
    layers = cfg["num_hidden_layers"]
    dense_only = cfg.get("mlp_only_layers") or []
    bad = [i for i in dense_only if not isinstance(i, int) or not 0 <= i < layers]
    if bad:
        raise UnsupportedModelError(f"{source}: mlp_only_layers {bad} are not layers of a {layers}-layer model")
    # transformers' Qwen3MoeDecoderLayer: sparse where not in mlp_only_layers and (i + 1) % step == 0
    moe_layers = tuple(i for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    if not moe_layers:
        raise UnsupportedModelError(
            f"{source}: no layer is a mixture-of-experts layer (decoder_sparse_step={step}, "
            f"mlp_only_layers={list(dense_only)})"
        )
    if cfg.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError(f"{source}: shared_expert_intermediate_size: qwen3_moe has no shared expert")
    return MoeSpec(
        num_experts=experts,
        top_k=top_k,
        ffn_hidden_size=_positive_int(cfg, "moe_intermediate_size", source),
        layers=moe_layers,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )


def _no_sliding_window(read: Callable[[Config, str], bool]) -> Callable[[Config, str], bool]:
    def checked(cfg: Config, source: str) -> bool:
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError(f"{source}: use_sliding_window=True is not supported (full attention only)")
        return read(cfg, source)

    return checked


FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", _no_biases, qk_norm=False, moe=_no_experts),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", _no_sliding_window(_qkv_biases), qk_norm=False, moe=_no_experts),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", _no_sliding_window(_no_biases), qk_norm=True, moe=_no_experts),
    "qwen3_moe": Family(
        "qwen3_moe", "Qwen3MoeForCausalLM", _no_sliding_window(_no_biases), qk_norm=True, moe=_qwen3_moe_experts
    ),
}

# Known, not built: what each lacks, so the refusal says it
NOT_YET = {
    "deepseek_v3": "multi-head latent attention and a sigmoid router with expert bias and shared experts",
    "glm4_moe": "a sigmoid router with expert bias and shared experts",
    "qwen2_moe": "a shared expert with a sigmoid gate",
    "mixtral": "its block_sparse_moe tensor names (w1/w2/w3)",
}


def family_of(cfg: Config, source: str) -> Family:
    model_type = cfg.get("model_type")
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    why = f" (not built yet: {NOT_YET[model_type]})" if model_type in NOT_YET else ""
    raise UnsupportedModelError(
        f"{source}: unsupported architecture model_type={model_type!r} (architectures="
        f"{cfg.get('architectures')}){why}; megarl runs model_type {', '.join(FAMILIES)}"
    )
