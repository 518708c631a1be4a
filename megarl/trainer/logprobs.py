"""Per-token log-probabilities (and entropy) from tensor-parallel logits.

Megatron's output layer leaves each TP rank with a slice of the (padded)
vocabulary. ``vocab_parallel_logprobs`` computes, for every position,

    log pi(target)  = x_target - logsumexp(x)        x = logits / temperature
    entropy         = logsumexp(x) - sum_v p_v x_v

without ever gathering the vocabulary. Each rank makes one pass over its
slice computing, per token, its local max m_r, sum_r exp(x - m_r), the target
logit if it holds the target, and (for entropy) sum_r exp(x - m_r)(x - m_r);
these are combined across ranks with one MAX and one SUM all-reduce of a few
floats per token (the streaming-logsumexp identity, so no second pass). The
math is fp32 whatever the logits' dtype, Megatron's vocabulary padding is
excluded (so the result does not depend on the TP size), and the temperature
is the sampler's, so pi is the distribution the generator sampled from.

Memory: forward and backward walk the tokens in chunks, so besides the logits
(which autograd keeps anyway) the extra fp32 memory is one chunk of
[chunk_tokens, vocab/TP]. Backward recomputes the softmax chunk by chunk from
the logits and two floats per token; entropy's gradient is computed only when
the entropy is actually used in the loss.

On pipeline-parallel runs call it on the last stage (the only one with logits),
i.e. inside the loss function Megatron's schedule calls there.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

DEFAULT_CHUNK_TOKENS = 512


def _tp_group_and_rank():
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        return None, 0
    return mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_rank()


def _tp_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, temperature, vocab_size, want_entropy, chunk_tokens, group, tp_rank):
        tokens, shard = logits.shape
        vocab_start = tp_rank * shard
        valid = max(0, min(shard, vocab_size - vocab_start))  # real (unpadded) columns of this rank
        local_target = target - vocab_start
        on_rank = (local_target >= 0) & (local_target < valid)
        local_target = torch.where(on_rank, local_target, torch.zeros_like(local_target))
        ctx.set_materialize_grads(False)

        f32 = dict(dtype=torch.float32, device=logits.device)
        local_max = torch.full((tokens,), float("-inf"), **f32)
        # rows: sum exp(x - m_r), target logit (raw), sum exp(x - m_r)(x - m_r)
        parts = torch.zeros(3, tokens, **f32)
        if valid > 0:
            for s in range(0, tokens, chunk_tokens):
                e = min(s + chunk_tokens, tokens)
                x = _scaled_fp32(logits[s:e, :valid], temperature)
                m = x.amax(dim=-1)
                local_max[s:e] = m
                picked = x.gather(-1, local_target[s:e, None]).squeeze(-1)
                parts[1, s:e] = torch.where(on_rank[s:e], picked, torch.zeros_like(picked))
                x.sub_(m[:, None])  # x - m_r
                if want_entropy:
                    exp = x.exp()
                    parts[0, s:e] = exp.sum(dim=-1)
                    parts[2, s:e] = (exp * x).sum(dim=-1)
                else:
                    parts[0, s:e] = x.exp_().sum(dim=-1)
        global_max = local_max.clone()
        if _tp_size(group) > 1:
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        # Rescale this rank's sums from its own max to the global max.
        scale = torch.where(torch.isfinite(local_max), (local_max - global_max).exp(), torch.zeros_like(local_max))
        shift = local_max - global_max
        parts[2] = (parts[2] + parts[0] * torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))) * scale
        parts[0] = parts[0] * scale
        if _tp_size(group) > 1:
            dist.all_reduce(parts, group=group)
        log_z = parts[0].log()  # logsumexp - global_max
        logp = parts[1] - global_max - log_z
        entropy = log_z - parts[2] / parts[0] if want_entropy else None

        ctx.save_for_backward(logits, local_target, on_rank, global_max + log_z, logp if entropy is None else entropy)
        ctx.config = (temperature, valid, want_entropy, chunk_tokens)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, local_target, on_rank, log_norm, entropy = ctx.saved_tensors
        temperature, valid, want_entropy, chunk_tokens = ctx.config
        tokens, shard = logits.shape
        use_entropy = want_entropy and grad_entropy is not None
        if valid == 0 or (grad_logp is None and not use_entropy):
            return torch.zeros_like(logits), None, None, None, None, None, None, None
        grad = torch.empty_like(logits)
        grad[:, valid:] = 0  # Megatron's vocabulary padding: never a target, never in the softmax
        # Every pass below is over [chunk, vocab] fp32: each is a full read and write of ~100 MB per
        # 512 tokens of a 49k vocabulary, so none is spent on a tensor of zeros or a division by 1.
        for s in range(0, tokens, chunk_tokens):
            e = min(s + chunk_tokens, tokens)
            # log p = x / T - logsumexp(x / T), recomputed in place
            log_p = _scaled_fp32(logits[s:e, :valid], temperature).sub_(log_norm[s:e, None])
            gl = grad_logp[s:e].float() if grad_logp is not None else None
            if use_entropy:
                p = log_p.exp()
                # d entropy / dx_v = -p_v (log p_v + entropy)
                g = log_p.add_(entropy[s:e, None]).mul_(p).mul_(-grad_entropy[s:e, None])
                if gl is not None:
                    g.sub_(p.mul_(gl[:, None]))
            else:
                # d log p_target / dx_v = onehot_v(target) - p_v: here the -p_v part, in place
                g = log_p.exp_().mul_(-gl[:, None])
            if gl is not None:
                rows = torch.nonzero(on_rank[s:e]).squeeze(-1)
                g[rows, local_target[s:e][rows]] += gl[rows]
            if temperature != 1.0:
                g.div_(temperature)
            grad[s:e, :valid] = g
        return grad, None, None, None, None, None, None, None


def _scaled_fp32(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in a new fp32 tensor (the input is autograd's: never written)."""
    x = logits.float() if logits.dtype != torch.float32 else logits.clone()
    return x.div_(temperature) if temperature != 1.0 else x


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """log pi(target) per position (and the entropy of pi) from TP-sharded logits.

    ``logits``: [..., vocab/TP] this rank's vocabulary shard (Megatron's padded
    layout); ``target``: [...] global token ids; ``vocab_size``: the real
    (unpadded) vocabulary. Returns fp32 tensors shaped like ``target``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    group, tp_rank = _tp_group_and_rank()
    lead = target.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    logp, entropy = _VocabParallelLogProbs.apply(
        flat_logits,
        target.reshape(-1),
        float(temperature),
        int(vocab_size),
        bool(with_entropy),
        int(chunk_tokens),
        group,
        tp_rank,
    )
    return logp.reshape(lead), (entropy.reshape(lead) if entropy is not None else None)
