"""ModelSpec -> Megatron-Core TransformerConfig and GPTModel.

The model is Megatron's own GPTModel. With Transformer Engine and CUDA present
it uses the TE layer spec (fused layernorm-linear, TE attention); otherwise
Megatron's local spec, which is what every CPU run and test uses. Both specs
save checkpoints under the same (TE-style) keys, so a checkpoint moves freely
between a CPU test and a GPU cluster.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Optional

import torch
import torch.nn.functional as F

from megarl.models.spec import Llama3RopeScaling, ModelSpec, YarnRopeScaling
from megatron_patches import mla_cpu, moe_cpu
from megatron_patches.tp_attributes import mark_tensor_parallel_weights

# Megatron-Core (and sdpa_attention, which imports it) only inside the functions that build a model:
# the weight-sync layouts import this module for padded_vocab_size in processes that never build one
# -- generator ranks on GPUs, SGLang's TP workers (generator/sglang/worker_receiver.py), `megarl plan`'s
# dry run, every `megarl` command (cli.py -> convert/cli.py) -- and Megatron-Core's import costs
# 1.3-1.5 s of CPU beyond torch's (measured 2026-12-03).

DEFAULT_VOCAB_DIVISIBLE_BY = 128


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY) -> int:
    """Megatron-LM's padding: round up to a multiple of divisible_by x TP.

    Checkpoints stay loadable at another TP: Megatron marks the embedding and
    output layer ``allow_shape_mismatch`` and loads the overlapping rows; the
    pad rows are zeros and never exported.
    """
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


# MEGARL_TRANSFORMER_ENGINE=0 builds the local spec where TE imports (scripts/cluster_check.sh runs
# both specs on one node to compare them); =1 insists on TE; unset or "auto": TE wherever it is usable
TE_SWITCH = "MEGARL_TRANSFORMER_ENGINE"


def transformer_engine_usable() -> bool:
    wanted = os.environ.get(TE_SWITCH, "auto")
    if wanted not in ("0", "1", "auto"):
        raise ValueError(f"{TE_SWITCH}={wanted!r}: 0 (local spec), 1 (Transformer Engine) or auto")
    available = torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
    if wanted == "1" and not available:
        raise RuntimeError(
            f"{TE_SWITCH}=1: Transformer Engine is not usable here (it needs a CUDA GPU and transformer_engine "
            f"importable; CUDA available: {torch.cuda.is_available()})"
        )
    return available and wanted != "0"


def transformer_config(
    spec: ModelSpec,
    tp: int = 1,
    pp: int = 1,
    vp: Optional[int] = None,
    params_dtype: torch.dtype = torch.float32,
    ep: int = 1,
    etp: Optional[int] = None,
    **overrides: Any,
):
    """The TransformerConfig of the model at the given parallel layout (``ep`` / ``etp``: Megatron's
    expert_model_parallel_size / expert_tensor_parallel_size, ``etp`` None meaning TP as in Megatron).

    ``overrides`` are passed through to TransformerConfig (e.g. sequence parallelism, recomputation,
    or the MoE training knobs: moe_router_load_balancing_type, moe_aux_loss_coeff, ...).
    """
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    spec.check_parallelism(tp, pp, vp, ep, etp)
    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,  # Qwen2: biases on q/k/v only
        qk_layernorm=spec.qk_norm,  # Qwen3: RMSNorm over each q and k head (eps: layernorm_epsilon)
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # Fused kernels exist only on GPUs; the unfused paths compute the same math.
        bias_activation_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=on_gpu,
        apply_rope_fusion=False,
        # Apex / TE's persistent LayerNorm kernel: only with Transformer Engine (the local spec's
        # WrappedTorchNorm asserts it off; found by the first GPU check, which has no TE)
        persist_layer_norm=transformer_engine_usable(),
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not on_gpu,
        # megarl's losses return (sum, token count) and Megatron divides the gradients by the step's
        # token count (trainer/aggregation.py). Set here, not only before DDP is built: Megatron's
        # routers read it when they are built, to scale the aux / z losses for that division
        calculate_per_token_loss=True,
    )
    if spec.mla:
        kwargs.update(_latent_attention_settings(spec))
    if spec.moe:
        kwargs.update(_moe_settings(spec, ep, etp))
    if pp > 1 and vp:
        # Over gloo, batched p2p pairs same-peer messages in arrival order and
        # silently swaps micro-batches of the interleaved schedule.
        kwargs.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    kwargs.update(overrides)
    return (MLATransformerConfig if spec.mla else TransformerConfig)(**kwargs)


def _latent_attention_settings(spec: ModelSpec) -> dict:
    """MLATransformerConfig's fields from the model's MlaSpec and RoPE (DeepSeek-V3's names -> Megatron-LM's)."""
    mla, scaling = spec.mla, spec.rope_scaling
    settings = dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        # q_a_layernorm / kv_a_layernorm: MLA's latent norms are Megatron's q / kv "layernorm"
        qk_layernorm=True,
        rotary_base=spec.rope_theta,
        rope_type="rope",
    )
    if isinstance(scaling, YarnRopeScaling):
        settings.update(
            rope_type="yarn",
            rotary_scaling_factor=scaling.factor,
            original_max_position_embeddings=scaling.original_max_position_embeddings,
            beta_fast=scaling.beta_fast,
            beta_slow=scaling.beta_slow,
            mscale=scaling.mscale,
            mscale_all_dim=scaling.mscale_all_dim,
        )
    else:
        # the softmax scale is 1 / sqrt(q_head_dim) times mscale(rotary_scaling_factor, mscale_all_dim)^2,
        # which mscale_all_dim 0 makes 1 whatever the factor
        settings.update(mscale_all_dim=0.0)
    return settings


# megarl's defaults for the trainer's MoE training fields (TrainerConfig, by Megatron-LM's names): the
# alltoall dispatcher EP runs use, no aux or z loss unless configured, SequentialMLP experts
MOE_TRAINING_DEFAULTS = dict(
    moe_router_load_balancing_type="none",
    moe_aux_loss_coeff=0.0,
    moe_z_loss_coeff=None,
    moe_token_dispatcher_type="alltoall",
    moe_grouped_gemm=False,
)


def _moe_settings(spec: ModelSpec, ep: int, etp: Optional[int]) -> dict:
    """Megatron's MoE fields from the model's MoeSpec (the HF config's): which layers have experts,
    and a router computing what the family's router computes."""
    moe = spec.moe
    settings = dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.top_k,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        # a list, also when every layer has experts: Megatron then keys each layer's tensors
        # by its number (not layer-stacked) in dist checkpoints, the same for every MoE model
        moe_layer_freq=[int(spec.is_moe_layer(i)) for i in range(spec.num_layers)],
        # Qwen3-MoE: softmax over all experts, then top-k; renormalising the k (norm_topk_prob)
        # equals Megatron's top-k of the logits then softmax over the k (use_pre_softmax False)
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_score_function=moe.router_score_function,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        **MOE_TRAINING_DEFAULTS,  # the trainer's config overrides them (executors/trainer.py)
    )
    if moe.router_score_function == "sigmoid":
        # DeepSeek-V3 / GLM-4.5: sigmoid scores, the top k chosen by score + expert bias (its
        # renormalisation of the chosen scores is built into Megatron's sigmoid router), in fp32 as
        # transformers' router computes them
        settings.update(moe_router_pre_softmax=False, moe_router_dtype="fp32")
    if moe.router_expert_bias:
        # The bias is loaded from the checkpoint and frozen: Megatron would move it by
        # moe_router_bias_update_rate x sign(load imbalance) after each step, which in RL drifts the
        # policy's routing away from the generator's and from the reference (slime sets 0 too)
        settings.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    if moe.num_groups:
        settings.update(moe_router_num_groups=moe.num_groups, moe_router_group_topk=moe.group_topk)
    if moe.topk_scaling_factor != 1.0:
        settings.update(moe_router_topk_scaling_factor=moe.topk_scaling_factor)
    if moe.shared_expert_ffn_hidden_size:
        settings.update(moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size)
    return settings


def layer_spec(
    spec: Optional[ModelSpec] = None, config=None, use_transformer_engine: Optional[bool] = None, vp_stage=None
):
    """Megatron's spec for the model's layers: TE on GPUs with TE, local otherwise (its core
    attention through SDPA). A dense model gets one layer spec; a mixture-of-experts one Megatron's
    block spec (a spec per layer of this pipeline stage: dense or MoE as moe_layer_freq says)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_transformer_engine is None:
        use_transformer_engine = transformer_engine_usable()
    qk_layernorm = bool(spec and spec.qk_norm)
    if spec is not None and spec.moe:
        block = gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_transformer_engine, normalization="RMSNorm", vp_stage=vp_stage
        )
        layers = block.layer_specs
    elif use_transformer_engine:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    else:
        block = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk_layernorm)
        layers = [block]
    if not use_transformer_engine:
        from megarl.models.sdpa_attention import SdpaDotProductAttention

        # Megatron's local core attention with its products fused by SDPA (models/sdpa_attention.py)
        for layer in layers:
            layer.submodules.self_attention.submodules.core_attention = SdpaDotProductAttention
            if config is not None and config.multi_latent_attention:
                # The TE spec fuses MLA's latent norms into the up projections and (dense layers) the
                # pre-MLP norm into fc1; save the local spec's separate norms under TE's keys
                layer.submodules.sharded_state_dict_keys_map = {
                    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
                    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
                }
            if layer.submodules.mlp.module.__name__ == "MoELayer":
                # The TE spec keeps a MoE layer's pre-MLP norm as its own TENorm, saved as
                # pre_mlp_layernorm.weight; the local spec would rename it to the dense layers'
                # mlp.linear_fc1.layer_norm_weight. Keep TE's key so checkpoints move between them.
                keys = dict(layer.submodules.sharded_state_dict_keys_map)
                keys.pop("pre_mlp_layernorm.", None)
                layer.submodules.sharded_state_dict_keys_map = keys
    return block


def build_model_chunks(
    spec: ModelSpec,
    config,
    vocab_divisible_by: int = DEFAULT_VOCAB_DIVISIBLE_BY,
    use_transformer_engine: Optional[bool] = None,
) -> list:
    """This rank's GPTModel chunks (one, or one per virtual pipeline stage).

    Megatron's parallel state must already be initialised with the layout in
    ``config``.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt import GPTModel

    if spec.moe:
        moe_cpu.define_te_general_gemm()  # without TE every router forward raises NameError (any device)
    if spec.mla:
        mla_cpu.mark_te_absent()  # without TE MLA's constructor raises TypeError (any device)
    vp = config.virtual_pipeline_model_parallel_size
    padded = padded_vocab_size(spec.vocab_size, config.tensor_model_parallel_size, vocab_divisible_by)
    chunks = []
    for vp_stage in range(vp or 1):
        stage = vp_stage if vp else None
        block = layer_spec(spec, config, use_transformer_engine, vp_stage=stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=padded,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=spec.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
            rotary_percent=spec.rotary_percent,  # GLM-4.5: RoPE on the first half of each head
            rope_scaling=isinstance(spec.rope_scaling, Llama3RopeScaling),
            rope_scaling_factor=spec.rope_scaling.factor if spec.rope_scaling else 8.0,
            vp_stage=stage,
        )
        _apply_llama3_rope_parameters(model, spec)
        # The local spec's torch norms ignore params_dtype and stay fp32; Megatron-LM casts the
        # whole model (Float16Module). Cast parameters only: RoPE's inv_freq stays fp32.
        for param in model.parameters():
            if param.dtype != config.params_dtype:
                param.data = param.data.to(config.params_dtype)
        if not config.perform_initialization:
            mark_tensor_parallel_weights(model)
        chunks.append(model)
    return chunks


def _apply_llama3_rope_parameters(model, spec: ModelSpec) -> None:
    # GPTModel passes only the scaling factor to RotaryEmbedding; the other three
    # Llama-3 parameters are fixed at Llama 3.1's values (1, 4, 8192). Recompute
    # the frequencies with Megatron's own _apply_scaling and the model's values.
    scaling = spec.rope_scaling
    rope = getattr(model, "rotary_pos_emb", None)
    if not isinstance(scaling, Llama3RopeScaling) or rope is None:
        return
    if (scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_position_embeddings) == (1, 4, 8192):
        return
    dim = int(spec.head_dim * spec.rotary_percent)
    base = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rope.inv_freq.device) / dim))
    rope.inv_freq = rope._apply_scaling(
        base,
        factor=scaling.factor,
        low_freq_factor=scaling.low_freq_factor,
        high_freq_factor=scaling.high_freq_factor,
        original_max_position_embeddings=scaling.original_max_position_embeddings,
    )
