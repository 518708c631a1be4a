"""What an SGLang TP rank holds after loading a Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE checkpoint.

Written from SGLang 0.5's loaders (QKVParallelLinear / MergedColumnParallelLinear /
RowParallelLinear / VocabParallelEmbedding weight_loader; Qwen3-MoE's FusedMoE
weight_loader and parallel_state's MoE groups: at --ep-size ep the TP rank is
ep_rank x (tp/ep) + moe_tp_rank, experts are contiguous per ep_rank), independently
of megarl.weight_sync, as the reference the weight sync must reproduce bitwise.
"""

import torch


def sglang_vocab_rows(vocab_size: int, tp: int):
    padding = 64  # DEFAULT_VOCAB_PADDING_SIZE
    if ((vocab_size + padding - 1) // padding * padding) % tp != 0:
        padding *= tp
    padded = (vocab_size + padding - 1) // padding * padding
    return padded // tp


def num_experts(config: dict) -> int:
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute_map)
    return config.get("num_experts") or config.get("num_local_experts") or 0


def sparse_layers(config: dict) -> set:
    """Qwen3-MoE's decoder layers with experts (its modeling code's rule)."""
    if not num_experts(config):
        return set()
    step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers", []))
    return {i for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0}


def sglang_shard(full: dict, config: dict, tp: int, rank: int, ep: int = 1) -> dict:
    """``full``: HF tensors by name; returns SGLang parameter name -> tensor for TP rank ``rank``."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // heads
    heads_here = heads // tp
    if tp >= kv_heads:
        kv_here, kv_shard = 1, rank // (tp // kv_heads)
    else:
        kv_here, kv_shard = kv_heads // tp, rank

    def rows(t, start, n):
        return t.narrow(0, start, n)

    def cols(t):
        n = t.shape[1] // tp
        return t.narrow(1, rank * n, n)

    def vocab(t):
        per_rank = sglang_vocab_rows(t.shape[0], tp)
        out = torch.zeros(per_rank, t.shape[1], dtype=t.dtype)
        start, end = rank * per_rank, min((rank + 1) * per_rank, t.shape[0])
        if end > start:
            out[: end - start] = t[start:end]
        return out

    out = {
        "model.embed_tokens.weight": vocab(full["model.embed_tokens.weight"]),
        "model.norm.weight": full["model.norm.weight"],
    }
    if not config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = vocab(full["lm_head.weight"])
    for i in range(layers):
        p = f"model.layers.{i}."
        q = rows(full[p + "self_attn.q_proj.weight"], rank * heads_here * head_dim, heads_here * head_dim)
        k = rows(full[p + "self_attn.k_proj.weight"], kv_shard * kv_here * head_dim, kv_here * head_dim)
        v = rows(full[p + "self_attn.v_proj.weight"], kv_shard * kv_here * head_dim, kv_here * head_dim)
        out.update(
            {
                p + "self_attn.qkv_proj.weight": torch.cat([q, k, v]),
                p + "self_attn.o_proj.weight": cols(full[p + "self_attn.o_proj.weight"]),
                p + "input_layernorm.weight": full[p + "input_layernorm.weight"],
                p + "post_attention_layernorm.weight": full[p + "post_attention_layernorm.weight"],
            }
        )
        if p + "self_attn.q_proj.bias" in full:
            out[p + "self_attn.qkv_proj.bias"] = torch.cat(
                [
                    rows(full[p + "self_attn.q_proj.bias"], rank * heads_here * head_dim, heads_here * head_dim),
                    rows(full[p + "self_attn.k_proj.bias"], kv_shard * kv_here * head_dim, kv_here * head_dim),
                    rows(full[p + "self_attn.v_proj.bias"], kv_shard * kv_here * head_dim, kv_here * head_dim),
                ]
            )
        for x in ("q_norm", "k_norm"):
            if p + f"self_attn.{x}.weight" in full:
                out[p + f"self_attn.{x}.weight"] = full[p + f"self_attn.{x}.weight"]
        if i in sparse_layers(config):
            moe_tp = tp // ep
            ep_rank, moe_tp_rank = rank // moe_tp, rank % moe_tp
            local = num_experts(config) // ep
            inter = config["moe_intermediate_size"] // moe_tp
            w13, w2 = [], []
            for e in range(ep_rank * local, (ep_rank + 1) * local):
                x = f"{p}mlp.experts.{e}."
                gate = rows(full[x + "gate_proj.weight"], moe_tp_rank * inter, inter)
                up = rows(full[x + "up_proj.weight"], moe_tp_rank * inter, inter)
                w13.append(torch.cat([gate, up]))  # shard w1 then w3
                w2.append(full[x + "down_proj.weight"].narrow(1, moe_tp_rank * inter, inter))
            out[p + "mlp.experts.w13_weight"] = torch.stack(w13)
            out[p + "mlp.experts.w2_weight"] = torch.stack(w2)
            out[p + "mlp.gate.weight"] = full[p + "mlp.gate.weight"]
            continue
        ffn = full[p + "mlp.gate_proj.weight"].shape[0] // tp
        out.update(
            {
                p + "mlp.gate_up_proj.weight": torch.cat(
                    [
                        rows(full[p + "mlp.gate_proj.weight"], rank * ffn, ffn),
                        rows(full[p + "mlp.up_proj.weight"], rank * ffn, ffn),
                    ]
                ),
                p + "mlp.down_proj.weight": cols(full[p + "mlp.down_proj.weight"]),
            }
        )
    return out


# The weights a block-fp8 checkpoint serves in fp8 (SGLang's Fp8LinearMethod on QKV / merged / row
# parallel linears, Fp8MoEMethod on FusedMoE); the router (a ReplicatedLinear built with
# quant_config=None), norms, embeddings and lm_head stay unquantised.
SGLANG_FP8_WEIGHTS = (
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
    "mlp.experts.w13_weight",
    "mlp.experts.w2_weight",
)


def block_fp8(weight: torch.Tensor, block: int = 128):
    """Block-fp8 of a 2-D weight, block by block: scale_inv = max(amax, 1e-4) / 448, q = w / scale_inv.
    FusedMoE's stacked experts [E, R, C] (w13_weight, w2_weight) expert by expert, scales
    [E, ceil(R/128), ceil(C/128)], as SGLang's Fp8MoEMethod allocates w13/w2_weight_scale_inv and
    its loader fills them from each expert's own HF weight_scale_inv."""
    if weight.dim() == 3:
        pairs = [block_fp8(w, block) for w in weight]
        return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
    rows, cols = weight.shape
    rb, cb = -(-rows // block), -(-cols // block)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(rb, cb, dtype=torch.float32)
    w = weight.float()
    for i in range(rb):
        for j in range(cb):
            tile = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            s = max(tile.abs().max().item(), 1e-4) / 448.0
            scale_inv[i, j] = s
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (
                (tile / scale_inv[i, j]).clamp(-448, 448).to(torch.float8_e4m3fn)
            )
    return q, scale_inv
