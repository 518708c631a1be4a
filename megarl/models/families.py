"""The model families megarl runs, each read from its Hugging Face config's own fields.

A family is chosen by the config's ``model_type`` and says which architecture
fields exist and what they mean; nothing is guessed from a model's name.

    llama       the base: RMSNorm, RoPE (incl. Llama-3 scaling), GQA, SwiGLU, no biases
    qwen2       Llama + biases on q/k/v (always, in Qwen2Attention); Qwen2.5 is this type
    qwen3       Llama + RMSNorm over each q and k head before RoPE (q_norm / k_norm)
    qwen3_moe   Qwen3 + routed experts (softmax router, top-k, optional renormalisation,
                no shared expert) on the layers decoder_sparse_step / mlp_only_layers name
    deepseek_v3 DeepSeek-V3 / Kimi-K2: multi-head latent attention (q_lora_rank, kv_lora_rank,
                qk_nope_head_dim, qk_rope_head_dim, v_head_dim; default or YaRN RoPE), dense layers
                before first_k_dense_replace, then routed + shared experts behind a sigmoid router
                with expert bias (e_score_correction_bias), group-limited top-k (n_group,
                topk_group), routed_scaling_factor
    glm4_moe    GLM-4.5: grouped-query attention with partial rotary (partial_rotary_factor),
                q/k/v biases (attention_bias) and optional per-head q/k norms (use_qk_norm), and
                DeepSeek-V3's experts and router

The tensor names of each family are in models/hf_mapping.py.

Multi-token-prediction layers (num_nextn_predict_layers, the checkpoint's layers from
num_hidden_layers on) are set aside: RL trains the next-token model only, as transformers
builds it; a conversion reads none of their tensors and an export writes none (its config says
num_nextn_predict_layers 0, so a server does not look for them).

The torch engine and weight sync do not take deepseek_v3 / glm4_moe yet (issue 56: SGLang's MLA
layouts): ``refuse_outside_trainer`` names the family where they would need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from megarl.errors import UnsupportedModelError
from megarl.models.mla_spec import MlaSpec
from megarl.models.moe_spec import MoeSpec

Config = Mapping[str, Any]


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # transformers' (and SGLang's) model class, written into exported configs
    qkv_bias: Callable[[Config, str], bool]
    qk_norm: Callable[[Config, str], bool]  # RMSNorm over each q and k head (not MLA's latent norms)
    moe: Callable[[Config, str], Optional[MoeSpec]]
    mla: Callable[[Config, str], Optional[MlaSpec]] = lambda cfg, source: None
    rotary_percent: Callable[[Config, str], float] = lambda cfg, source: 1.0  # of each head's width


def _always(value: bool) -> Callable[[Config, str], bool]:
    return lambda cfg, source: value


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


def _sigmoid_router_experts(cfg: Config, source: str) -> MoeSpec:
    """DeepSeek-V3's and GLM-4.5's experts (transformers' DeepseekV3MoE / Glm4MoeMoE): sigmoid scores,
    top-k of score + e_score_correction_bias within the best topk_group of n_group groups, the
    chosen scores renormalised and times routed_scaling_factor, plus shared experts."""
    experts = _positive_int(cfg, "n_routed_experts", source)
    top_k = _positive_int(cfg, "num_experts_per_tok", source)
    if top_k > experts:
        raise UnsupportedModelError(f"{source}: num_experts_per_tok={top_k} is more than n_routed_experts={experts}")
    layers = cfg["num_hidden_layers"]
    first_sparse = cfg.get("first_k_dense_replace", 0)
    if not isinstance(first_sparse, int) or not 0 <= first_sparse < layers:
        raise UnsupportedModelError(
            f"{source}: first_k_dense_replace={first_sparse!r} leaves no mixture-of-experts layer of {layers}"
        )
    # fields of the original DeepSeek config.json that transformers does not read: only the values it assumes
    for field, assumed in (("moe_layer_freq", 1), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if cfg.get(field, assumed) != assumed:
            raise UnsupportedModelError(f"{source}: {field}={cfg[field]!r} is not supported (only {assumed!r})")
    # Megatron's sigmoid router renormalises the top k whenever k > 1, and never for k = 1
    if bool(cfg.get("norm_topk_prob", False)) != (top_k > 1):
        raise UnsupportedModelError(
            f"{source}: norm_topk_prob={cfg.get('norm_topk_prob')} with num_experts_per_tok={top_k}: Megatron's "
            f"sigmoid router renormalises the chosen scores exactly when it chooses more than one"
        )
    groups = _positive_int({"n_group": cfg.get("n_group") or 1}, "n_group", source)
    group_topk = _positive_int({"topk_group": cfg.get("topk_group") or groups}, "topk_group", source)
    if experts % groups or group_topk > groups:
        raise UnsupportedModelError(
            f"{source}: n_group={groups} / topk_group={group_topk} do not group n_routed_experts={experts}"
        )
    if group_topk == groups:  # every group kept: no limit
        groups = group_topk = 0
    elif top_k != 2 * group_topk:
        # transformers scores a group by the sum of its top 2; Megatron by its top (k / topk_group)
        raise UnsupportedModelError(
            f"{source}: num_experts_per_tok={top_k} with topk_group={group_topk}: a group's score is the sum of "
            f"its best 2 experts in transformers and of its best {top_k // group_topk} in Megatron-Core"
        )
    scaling = cfg.get("routed_scaling_factor", 1.0)
    if not isinstance(scaling, (int, float)) or isinstance(scaling, bool) or scaling <= 0:
        raise UnsupportedModelError(f"{source}: routed_scaling_factor must be positive, got {scaling!r}")
    moe_width = _positive_int(cfg, "moe_intermediate_size", source)
    shared = _positive_int(cfg, "n_shared_experts", source)
    return MoeSpec(
        num_experts=experts,
        top_k=top_k,
        ffn_hidden_size=moe_width,
        layers=tuple(range(first_sparse, layers)),
        norm_topk_prob=top_k > 1,
        router_score_function="sigmoid",
        router_expert_bias=True,
        shared_expert_ffn_hidden_size=shared * moe_width,  # transformers: one MLP, n_shared_experts wide
        num_groups=groups,
        group_topk=group_topk,
        topk_scaling_factor=float(scaling),
    )


def _latent_attention(cfg: Config, source: str) -> MlaSpec:
    if not cfg.get("rope_interleave", True):
        # Megatron's MLA always de-interleaves the rope part (DeepSeek's checkpoints' layout)
        raise UnsupportedModelError(f"{source}: rope_interleave=False is not supported (MLA's rope is interleaved)")
    q_lora = cfg.get("q_lora_rank")
    rope_width = _positive_int(cfg, "qk_rope_head_dim", source)
    if cfg.get("head_dim") not in (None, rope_width):
        # transformers turns RoPE over head_dim columns; MLA's rope part is qk_rope_head_dim wide
        raise UnsupportedModelError(f"{source}: head_dim={cfg['head_dim']} differs from qk_rope_head_dim={rope_width}")
    return MlaSpec(
        q_lora_rank=None if q_lora is None else _positive_int(cfg, "q_lora_rank", source),
        kv_lora_rank=_positive_int(cfg, "kv_lora_rank", source),
        qk_nope_head_dim=_positive_int(cfg, "qk_nope_head_dim", source),
        qk_rope_head_dim=_positive_int(cfg, "qk_rope_head_dim", source),
        v_head_dim=_positive_int(cfg, "v_head_dim", source),
    )


def _no_attention_bias(cfg: Config, source: str) -> bool:
    if cfg.get("attention_bias"):
        raise UnsupportedModelError(f"{source}: attention_bias=True is not supported for model_type 'deepseek_v3'")
    return False


def _attention_bias(cfg: Config, source: str) -> bool:
    return bool(cfg.get("attention_bias", False))  # Glm4MoeAttention: on q/k/v, never on o_proj


def _partial_rotary(cfg: Config, source: str) -> float:
    # transformers 5 keeps it in rope_parameters; the hub's config.json at the top level
    factor = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise UnsupportedModelError(f"{source}: partial_rotary_factor must be in (0, 1], got {factor!r}")
    return float(factor)


def _no_sliding_window(read: Callable[[Config, str], bool]) -> Callable[[Config, str], bool]:
    def checked(cfg: Config, source: str) -> bool:
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError(f"{source}: use_sliding_window=True is not supported (full attention only)")
        return read(cfg, source)

    return checked


FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", _no_biases, _always(False), moe=_no_experts),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", _no_sliding_window(_qkv_biases), _always(False), moe=_no_experts),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", _no_sliding_window(_no_biases), _always(True), moe=_no_experts),
    "qwen3_moe": Family(
        "qwen3_moe", "Qwen3MoeForCausalLM", _no_sliding_window(_no_biases), _always(True), moe=_qwen3_moe_experts
    ),
    "deepseek_v3": Family(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        _no_attention_bias,
        _always(False),
        moe=_sigmoid_router_experts,
        mla=_latent_attention,
    ),
    "glm4_moe": Family(
        "glm4_moe",
        "Glm4MoeForCausalLM",
        _attention_bias,
        lambda cfg, source: bool(cfg.get("use_qk_norm", False)),
        moe=_sigmoid_router_experts,
        rotary_percent=_partial_rotary,
    ),
}

# The families the trainer and conversion run but the torch engine and weight sync do not yet
TRAINER_ONLY = {"deepseek_v3", "glm4_moe"}

# Known, not built: what each lacks, so the refusal says it
NOT_YET = {
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


def refuse_outside_trainer(model_type: str, part: str) -> None:
    """Raise for a family only conversion and the trainer take so far, naming ``part`` (the torch
    engine, weight sync) and the issue that builds it there."""
    if model_type in TRAINER_ONLY:
        raise UnsupportedModelError(
            f"model_type {model_type!r}: {part} does not run it yet (issue 56: SGLang's layouts of multi-head "
            f"latent attention, shared experts and the router's expert bias); converting it and training it "
            f"in Megatron-Core work"
        )
