"""The forward-step hook: an RL loss as the forward_step_func Megatron's schedules call.

``make_forward_step`` returns ``forward_step(data_iterator, model) ->
(output_tensor, loss_func)``. Megatron calls loss_func on the last pipeline
stage with the TP-sharded logits; it computes log pi of every target with the
fused vocab-parallel function, applies the configured loss to the response
tokens only (prompt and padding positions never contribute), and returns

    (loss summed over this micro-batch's response tokens, their count, stats)

With ``calculate_per_token_loss`` (set by trainer.setup.wrap_ddp) Megatron
then divides the gradient by the sum of the counts over all micro-batches and
data-parallel ranks of the step instead of averaging per micro-batch, so the
gradient is the per-token mean over the whole global batch however it was split.

``stats`` is one fixed-layout vector per micro-batch (STAT_FIELDS), summed by
the trainer over micro-batches and DP ranks into the step's metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from megarl.trainer.logprobs import vocab_parallel_logprobs
from megarl.trainer.losses import LossFn, LossInputs, kl_penalty

# Summed over micro-batches and DP ranks, except ratio_max (max).
STAT_FIELDS = (
    "loss_sum", "tokens", "ratio_sum", "ratio_sq_sum", "ratio_max", "clipped",
    "kl_mu_pi_sum", "entropy_sum", "kl_ref_sum",
)


@dataclass(frozen=True)
class LossConfig:
    name: str = "aipo"  # built-in name or 'package.module:function'
    params: dict = field(default_factory=dict)  # the loss's keyword parameters (bind_loss_params)
    temperature: float = 1.0  # the sampler's: pi must be the distribution sampled from
    kl_coef: float = 0.0  # > 0 needs a reference model
    kl_estimator: str = "k3"
    advantage_estimator: str = "group_mean"
    normalize_advantage_std: bool = False


def make_forward_step(loss_fn: LossFn, cfg: LossConfig, vocab_size: int):
    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        output = model(mb.input_ids, mb.position_ids, mb.attention_mask, packed_seq_params=mb.packed_seq_params)
        return output, partial(_loss_func, loss_fn, cfg, vocab_size, mb)

    return forward_step


def per_token_loss(loss_fn: LossFn, cfg: LossConfig, inputs: LossInputs):
    """(the loss's output, its per-token loss with the KL penalty added, the KL term per token)."""
    out = loss_fn(inputs, **cfg.params)
    per_token = out.per_token_loss
    kl_ref = torch.zeros_like(per_token)
    if cfg.kl_coef:
        kl_ref = kl_penalty(inputs.logprobs, inputs.ref_logprobs, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl_ref
    return out, per_token, kl_ref


def _loss_func(loss_fn: LossFn, cfg: LossConfig, vocab_size: int, mb, logits: torch.Tensor):
    # Only response positions matter: select their logits rows before the
    # vocabulary-sized work (prompt positions are often half of a row).
    on = mb.loss_mask[0] > 0
    logp, entropy = vocab_parallel_logprobs(logits[0][on], mb.targets[0][on], vocab_size, cfg.temperature, True)
    inputs = LossInputs(
        logprobs=logp,
        behaviour_logprobs=mb.behaviour_logprobs[0][on],
        advantages=mb.advantages[0][on],
        entropy=entropy,
        ref_logprobs=mb.ref_logprobs[0][on] if mb.ref_logprobs is not None else None,
        policy_versions=mb.policy_versions[0][on],
    )
    out, per_token, kl_ref = per_token_loss(loss_fn, cfg, inputs)
    loss_sum = per_token.sum()
    count = on.sum()
    with torch.no_grad():
        log_ratio = inputs.logprobs.detach() - inputs.behaviour_logprobs
        ratio = log_ratio.exp()
        clipped = out.clipped if out.clipped is not None else torch.zeros_like(ratio, dtype=torch.bool)
        stats = torch.stack([
            loss_sum.detach().float(),
            count.float(),
            ratio.sum(),
            (ratio * ratio).sum(),
            ratio.max() if ratio.numel() else torch.tensor(0.0),
            clipped.float().sum(),
            # KL(mu || pi) from tokens sampled from mu: E_mu[r - 1 - log r], r = pi / mu (k3)
            (ratio - 1.0 - log_ratio).sum(),
            inputs.entropy.detach().sum(),
            kl_ref.detach().sum(),
        ])
    return loss_sum, count.to(torch.int), {"stats": stats}


def make_logprob_collector(vocab_size: int, temperature: float):
    """forward_step for a forward-only pass storing log pi of every target in mb.ref_logprobs."""

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        output = model(mb.input_ids, mb.position_ids, mb.attention_mask, packed_seq_params=mb.packed_seq_params)

        def collect(logits, non_loss_data=True):
            logp, _ = vocab_parallel_logprobs(logits, mb.targets, vocab_size, temperature)
            mb.ref_logprobs = logp.detach()
            return None

        return output, collect

    return forward_step
