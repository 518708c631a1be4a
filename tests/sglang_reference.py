"""What an SGLang TP rank holds after loading a Hugging Face Llama checkpoint.

Written from SGLang 0.5's loaders (QKVParallelLinear / MergedColumnParallelLinear /
RowParallelLinear / VocabParallelEmbedding weight_loader), independently of
megarl.weight_sync, as the reference the weight sync must reproduce bitwise.
"""

import torch


def sglang_vocab_rows(vocab_size: int, tp: int):
    padding = 64  # DEFAULT_VOCAB_PADDING_SIZE
    if ((vocab_size + padding - 1) // padding * padding) % tp != 0:
        padding *= tp
    padded = (vocab_size + padding - 1) // padding * padding
    return padded // tp


def sglang_shard(full: dict, config: dict, tp: int, rank: int) -> dict:
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
        ffn = full[p + "mlp.gate_proj.weight"].shape[0] // tp
        out.update(
            {
                p + "self_attn.qkv_proj.weight": torch.cat([q, k, v]),
                p + "self_attn.o_proj.weight": cols(full[p + "self_attn.o_proj.weight"]),
                p + "mlp.gate_up_proj.weight": torch.cat(
                    [
                        rows(full[p + "mlp.gate_proj.weight"], rank * ffn, ffn),
                        rows(full[p + "mlp.up_proj.weight"], rank * ffn, ffn),
                    ]
                ),
                p + "mlp.down_proj.weight": cols(full[p + "mlp.down_proj.weight"]),
                p + "input_layernorm.weight": full[p + "input_layernorm.weight"],
                p + "post_attention_layernorm.weight": full[p + "post_attention_layernorm.weight"],
            }
        )
    return out


def block_fp8(weight: torch.Tensor, block: int = 128):
    """Block-fp8 of a 2-D weight, block by block: scale_inv = max(amax, 1e-4) / 448, q = w / scale_inv."""
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
