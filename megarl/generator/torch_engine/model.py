"""A Llama / Qwen2 / Qwen3 / Qwen3-MoE forward pass over weights held in SGLang's tensor-parallel layout.

The reference engine's model: plain PyTorch, the same math as transformers'
LlamaForCausalLM (RMSNorm in fp32, RoPE incl. Llama-3 scaling, GQA, SwiGLU),
Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm before RoPE, and Qwen3-MoE's
sparse layers (softmax router in fp32, top-k, optionally renormalised; SwiGLU
experts weighted and summed),
reading the parameters exactly as an SGLang TP worker holds them
(``qkv_proj`` = [q heads; k heads; v heads] of this rank with KV heads
replicated when TP > KV heads, ``gate_up_proj`` = [gate; up], row-parallel
``o_proj`` / ``down_proj``, vocabulary rows padded SGLang's way, FusedMoE's
stacked ``w13_weight`` / ``w2_weight`` of this rank's experts). So the weight
sync that fills SGLang fills this model too, and the two generators behave alike.

Tensor parallelism over the engine's own process group: row-parallel outputs
and the vocabulary-parallel embedding are all-reduced, the logits all-gathered.
Experts as SGLang runs them at --ep-size (EP inside TP): each rank applies its
experts' shards to the tokens routed to them, and one all-reduce over the TP
group sums experts and shards. Every forward records each token's routed
experts per layer (``routes``), what SGLang returns with --enable-return-routed-experts.

Block-fp8 weights (float8_e4m3fn + 128x128 ``weight_scale_inv``) are
dequantised inside each matmul, as SGLang's fp8 linear does on the fly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarl.generator.torch_engine import moe as moe_ops
from megarl.generator.torch_engine import native
from megarl.generator.torch_engine.kernels import LinearKernels
from megarl.models.spec import ModelSpec
from megarl.weight_sync import fp8 as fp8_format
from megarl.weight_sync.layouts import sglang_expert_shard, sglang_kv_head_of, sglang_padded_vocab


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """transformers' inverse frequencies, with Llama-3 frequency-dependent scaling."""
    d = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = spec.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` with the negation folded into the sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


@dataclass
class Segment:
    """One sequence's new tokens in a forward: they sit at rows [offset, offset + length) of
    the flattened batch, at positions [start, start + length), and write KV-cache slot ``slot``."""

    slot: int
    start: int
    length: int
    offset: int


class KVCache:
    """Preallocated keys and values: [slots, local KV heads, max_len, head_dim] per layer."""

    def __init__(
        self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype, device="cpu"
    ):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.max_len = max_len

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class SglangLayoutModel:
    def __init__(
        self,
        spec: ModelSpec,
        params: Dict[str, torch.Tensor],
        tp: int = 1,
        tp_rank: int = 0,
        group=None,
        fp8: bool = False,
        decode_rows: int = 0,
        linear_path: str = "mkl",
        cpu_kernels: str = "auto",
        ep: int = 1,
    ):
        """``linear_path`` "auto": time MKL against oneDNN at ``decode_rows`` rows per weight shape
        and use the faster (kernels.py); "mkl": plain ``F.linear``; "onednn": oneDNN wherever it runs.
        ``cpu_kernels`` "auto": on CPU, megarl's C kernels where they build (native.py: decode
        attention where head_dim is a multiple of 16, and the layer's residual add + RMSNorm, RoPE
        and SwiGLU), else torch's; "torch": torch's SDPA and ops always (what a GPU runs).
        ``ep``: SGLang's --ep-size for the experts (layouts.sglang_expert_shard)."""
        self.spec, self.params, self.tp, self.tp_rank, self.group, self.fp8 = spec, params, tp, tp_rank, group, fp8
        self.first_expert = sglang_expert_shard(spec, tp, tp_rank, ep)[0][0] if spec.moe else 0
        # [T, layers, top_k] of the last forward (-1: dense layer), on the device until the forward returns
        self.routes: Optional[torch.Tensor] = None
        self.heads = spec.num_attention_heads // tp
        kv0, kv1 = sglang_kv_head_of(spec, tp, tp_rank)
        self.kv_heads = kv1 - kv0
        self.vocab_rows = sglang_padded_vocab(spec.vocab_size, tp) // tp
        self.vocab_start = tp_rank * self.vocab_rows
        self.inv_freq = rope_inv_freq(spec)
        self.dtype = params["model.norm.weight"].dtype
        self.device = params["model.norm.weight"].device
        linears = [n for n in params if n.endswith("_proj.weight")]
        linears.append("model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight")
        self.kernels = LinearKernels(params, linears, decode_rows, linear_path)
        if cpu_kernels not in ("auto", "torch"):
            raise ValueError(f"cpu_kernels {cpu_kernels!r}: 'auto' or 'torch'")
        self.native_ops = (
            cpu_kernels == "auto"
            and self.device.type == "cpu"
            and self.dtype in (torch.float32, torch.bfloat16)
            and native.load() is not None
        )
        self.native_decode = self.native_ops and spec.head_dim % 16 == 0

    # -- building blocks -----------------------------------------------------------------------

    def _weight(self, name: str) -> torch.Tensor:
        w = self.params[name]
        if w.dtype == fp8_format.FP8_DTYPE:
            return fp8_format.dequantize(w, self.params[fp8_format.scale_name(name)]).to(self.dtype)
        return w

    def _expert_weights(self, name: str) -> torch.Tensor:
        """A stacked w13 / w2 of the local experts, dequantised (each expert its own scales) when block fp8."""
        w = self.params[name]
        if w.dtype == fp8_format.FP8_DTYPE:
            return fp8_format.dequantize(w, self.params[fp8_format.scale_name(name)]).to(self.dtype)
        return w

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if self.params[name].dtype == fp8_format.FP8_DTYPE:
            return F.linear(x, self._weight(name))
        return self.kernels.linear(x, name)

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def _add_norm(self, x: torch.Tensor, delta: Optional[torch.Tensor], name: str) -> torch.Tensor:
        """``x += delta`` (the residual add, in place; none before the first layer), then the RMSNorm
        of x: one pass in the C kernel, or torch's ops (the same roundings, native.py)."""
        if self.native_ops:
            return native.add_rms_norm(x, self.params[name], self.spec.rms_norm_eps, delta)
        if delta is not None:
            x.add_(delta)
        return self._norm(x, name)

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel, the same math
            return F.rms_norm(x, (x.shape[-1],), self.params[name], self.spec.rms_norm_eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return self.params[name] * h.to(x.dtype)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_rows)
        x = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.params["model.embed_tokens.weight"])
        x = x * inside.unsqueeze(-1).to(x.dtype)
        return self._all_reduce(x)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        name = "model.embed_tokens.weight" if self.spec.tie_embeddings else "lm_head.weight"
        local = self.kernels.linear(x, name).float()
        if self.tp > 1:
            parts = [torch.empty_like(local) for _ in range(self.tp)]
            dist.all_gather(parts, local.contiguous(), group=self.group)
            local = torch.cat(parts, dim=-1)
        return local[..., : self.spec.vocab_size]

    def _rope(self, positions: torch.Tensor):
        """cos and sin [T, 1, head_dim]; sin's first half negated, so that rotating is
        x * cos + swap_halves(x) * signed_sin (rotate_half without its negation per layer)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :].to(positions.device)
        cos = torch.cat((freqs, freqs), dim=-1).cos()
        signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        return cos.to(self.dtype)[:, None], signed_sin.to(self.dtype)[:, None]

    # -- the forward ---------------------------------------------------------------------------

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        segments: List[Segment],
        cache: KVCache,
        logit_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Run the new tokens of several sequences (flattened [T]); write their keys and values
        into the cache; return fp32 logits [len(logit_rows), vocab] (default: every row)."""
        d = self.spec.head_dim
        x = self._embed(tokens).to(self.dtype)
        cos, sin = self._rope(positions)
        # One pass over the weights per step: sequences decoding one token attend in one batched
        # call, sequences being prefilled one by one; the linear layers see all rows at once.
        decode = [s for s in segments if s.length == 1]
        ragged = [s for s in segments if s.length != 1]
        first = decode[0].offset if decode else 0
        if [s.offset for s in decode] == list(range(first, first + len(decode))):
            decode_rows = slice(first, first + len(decode))  # the engine puts them last, together: views
        else:
            decode_rows = torch.tensor([s.offset for s in decode], dtype=torch.long, device=tokens.device)
        plan = self._decode_plan(decode, cache, tokens.device) if decode else None
        if self.spec.moe is not None:
            self.routes = torch.full(
                (len(tokens), self.spec.num_layers, self.spec.moe.top_k), -1, dtype=torch.int16, device=tokens.device
            )
        delta = None  # the last sublayer's output, added to the residual x by the next norm
        for i in range(self.spec.num_layers):
            p = f"model.layers.{i}."
            h = self._add_norm(x, delta, p + "input_layernorm.weight")
            qkv = self._linear(h, p + "self_attn.qkv_proj.weight")
            # q and k heads are adjacent in qkv_proj: rotated in one pass
            rotated = self.heads + self.kv_heads
            if self.spec.qkv_bias:
                qkv += self.params[p + "self_attn.qkv_proj.bias"]
            if self.spec.qk_norm:  # each head's q and k RMS-normalised over head_dim, before RoPE
                heads = qkv[:, : rotated * d].view(-1, rotated, d)
                heads[:, : self.heads] = self._norm(heads[:, : self.heads], p + "self_attn.q_norm.weight")
                heads[:, self.heads :] = self._norm(heads[:, self.heads :], p + "self_attn.k_norm.weight")
            if self.native_ops:  # in place: q and k stay views of qkv
                native.rope_(qkv, cos, sin, rotated, d)
                qk = qkv[:, : rotated * d].view(-1, rotated, d)
            else:
                qk = _apply_rope(qkv[:, : rotated * d].view(-1, rotated, d), cos, sin)
            q, k = qk[:, : self.heads], qk[:, self.heads :]
            v = qkv[:, rotated * d :].view(-1, self.kv_heads, d)
            if ragged:
                attn = torch.empty_like(q)
                self._attend_ragged(q, k, v, ragged, cache, i, attn)
                if decode:
                    attn[decode_rows] = self._attend_decode(
                        q[decode_rows], k[decode_rows], v[decode_rows], plan, cache, i
                    )
            else:  # decode only: every row
                attn = self._attend_decode(q, k, v, plan, cache, i)
            delta = self._all_reduce(self._linear(attn.reshape(-1, self.heads * d), p + "self_attn.o_proj.weight"))
            h = self._add_norm(x, delta, p + "post_attention_layernorm.weight")
            if self.spec.is_moe_layer(i):
                delta = self._all_reduce(self._experts(h, p, i))
                continue
            gate_up = self._linear(h, p + "mlp.gate_up_proj.weight")
            if self.native_ops:
                act = native.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            delta = self._all_reduce(self._linear(act, p + "mlp.down_proj.weight"))
        x = self._add_norm(x, delta, "model.norm.weight")
        if logit_rows is not None:
            x = x[logit_rows]
        return self._logits(x)

    def _experts(self, h: torch.Tensor, p: str, layer: int) -> torch.Tensor:
        """This rank's part of a sparse MLP: route every token (the router is replicated), then
        apply the local experts' shards to their tokens, weighted by their routing weights, all
        on the device (moe.py); the routes stay on the device until the forward returns."""
        moe = self.spec.moe
        weights, experts = moe_ops.route(h, self.params[p + "mlp.gate.weight"], moe.top_k, moe.norm_topk_prob)
        self.routes[:, layer] = experts.to(torch.int16)
        w13, w2 = (self._expert_weights(p + "mlp.experts." + w) for w in ("w13_weight", "w2_weight"))
        return moe_ops.apply_experts(h, weights, experts, w13, w2, self.first_expert)

    def _attend_ragged(self, q, k, v, segments: List[Segment], cache: KVCache, layer: int, out: torch.Tensor) -> None:
        """Sequences with several new tokens: each attends causally to its cache prefix and new tokens."""
        scale = 1.0 / math.sqrt(self.spec.head_dim)
        for s in segments:
            rows = slice(s.offset, s.offset + s.length)
            end = s.start + s.length
            cache.k[layer][s.slot, :, s.start : end] = k[rows].transpose(0, 1)
            cache.v[layer][s.slot, :, s.start : end] = v[rows].transpose(0, 1)
            keys = cache.k[layer][s.slot, :, :end].unsqueeze(0)
            values = cache.v[layer][s.slot, :, :end].unsqueeze(0)
            query = q[rows].transpose(0, 1).unsqueeze(0)
            # causal over absolute positions: new token j (at start + j) sees keys 0..start + j
            mask = (
                torch.arange(end, device=q.device)[None, :]
                <= (s.start + torch.arange(s.length, device=q.device))[:, None]
            )
            o = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=scale, enable_gqa=self.heads != self.kv_heads
            )
            out[rows] = o[0].transpose(0, 1)

    def _decode_plan(self, segments: List[Segment], cache: KVCache, device) -> "_DecodePlan":
        """What every layer's decode attention needs, computed once per forward: the flat cache
        rows each new key lands in, the cache slots to read and the length mask."""
        slot_list = [s.slot for s in segments]
        slots = torch.tensor(slot_list, device=device)
        starts = torch.tensor([s.start for s in segments], device=device)
        if self.native_decode:  # the C kernel writes the new rows and stops at each length itself
            return _DecodePlan(None, None, 0, None, slots, starts + 1)
        heads = torch.arange(self.kv_heads, device=device)
        # cache.k[layer] is [slots, kv_heads, max_len, head_dim]: (slot, head, pos) -> one row of a [-1, head_dim] view
        write_rows = ((slots[:, None] * self.kv_heads + heads[None, :]) * cache.max_len + starts[:, None]).reshape(-1)
        longest = int(starts.max()) + 1
        if slot_list == list(range(slot_list[0], slot_list[0] + len(slot_list))):
            read = slice(slot_list[0], slot_list[0] + len(slot_list))  # a view: no copy of the cache
        else:
            read = slots
        mask = (torch.arange(longest, device=device)[None, :] <= starts[:, None])[:, None, None, :]
        return _DecodePlan(write_rows, read, longest, mask, slots, starts + 1)

    def _attend_decode(self, q, k, v, plan: "_DecodePlan", cache: KVCache, layer: int) -> torch.Tensor:
        """One new token per sequence (rows of q, k, v in segment order): one batched attention
        over the slots' cached prefixes. The query heads sharing a KV head attend as that head's
        queries ([B, kv_heads, group, d]): no copy of the keys per query head (GQA)."""
        d = self.spec.head_dim
        if self.native_decode:  # writes the new keys and values itself, reads q, k, v in place
            return native.decode_attention(
                q, cache.k[layer], cache.v[layer], plan.slots, plan.lengths, 1.0 / math.sqrt(d), new_k=k, new_v=v
            )
        cache.k[layer].view(-1, d).index_copy_(0, plan.write_rows, k.reshape(-1, d))
        cache.v[layer].view(-1, d).index_copy_(0, plan.write_rows, v.reshape(-1, d))
        grouped = q.reshape(q.shape[0], self.kv_heads, self.heads // self.kv_heads, d)
        keys = cache.k[layer][plan.read, :, : plan.longest]
        values = cache.v[layer][plan.read, :, : plan.longest]
        o = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=plan.mask, scale=1.0 / math.sqrt(d))
        return o.reshape(q.shape[0], self.heads, d)


@dataclass
class _DecodePlan:
    # SDPA's (None where the C kernel attends):
    write_rows: Optional[torch.Tensor]  # [decoding sequences x kv heads] rows of the cache's [-1, head_dim] view
    read: object  # slice or index tensor of cache slots
    longest: int
    mask: Optional[torch.Tensor]  # [B, 1, 1, longest]: key j visible to sequence b
    slots: torch.Tensor  # [B] cache slot of each sequence
    lengths: torch.Tensor  # [B] keys each sequence sees (its new one included)
