"""The forward-step hook: an RL loss as the forward_step_func Megatron's schedules call.

``make_forward_step(loss, vocab_size)`` (``loss``: the trainer's BoundLoss,
megarl.trainer.bound_loss) returns ``forward_step(data_iterator, model) ->
(output_tensor, loss_func)``. Megatron calls loss_func on the last pipeline
stage with the TP-sharded logits; it computes log pi of every target with the
fused vocab-parallel function, applies the loss to the trained response tokens
only, and returns

    (sum_t w_t l_t over this micro-batch's trained tokens, their count, stats)

The trained tokens are the micro-batch's mask row (packing: 1 at a response token
whose Sample.loss_mask is 1, 0 at prompt and padding positions and at masked
response tokens). The output layer computes logits for those positions alone
(trainer/response_logits.py) and nothing at any other position is read: a masked
token adds nothing to the loss, the gradient, the count or the statistics, and
its placeholder log mu and version never leave the packed rows.

With ``calculate_per_token_loss`` (set by trainer.setup.wrap_ddp) Megatron
then divides the gradient by the sum of the counts over all micro-batches and
data-parallel ranks of the step instead of averaging per micro-batch. The
weights w_t (megarl.trainer.aggregation) fold a sequence-level normaliser into
the sum using the step's totals each micro-batch carries, so every aggregation
mode is the exact value over the whole global batch however it was split.

``stats`` is one fixed-layout vector per micro-batch (megarl.trainer.stats), summed by
the trainer over micro-batches and DP ranks into the step's metrics. The
micro-batch keeps its detached log pi of the trained tokens (``mb.trainer_logprobs``)
for the trainer to hand back per sample.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Optional

import torch

from megarl.trainer.aggregation import aggregation_weights
from megarl.trainer.logprobs import vocab_parallel_logprobs
from megarl.trainer.losses import LossInputs, kl_penalty
from megarl.trainer.response_logits import logits_at
from megarl.trainer.stats import BASE_FIELDS, micro_batch_stats

if TYPE_CHECKING:
    from megarl.trainer.bound_loss import BoundLoss
    from megarl.trainer.router_replay import RoutingReplay

STAT_FIELDS = BASE_FIELDS  # without the lag buckets; stats.stat_fields(lag_bound) is the whole layout


def trained_positions(mb) -> torch.Tensor:
    """[L] bool: the positions of a micro-batch's packed row whose target the loss trains on."""
    return mb.loss_mask[0] > 0


def make_forward_step(loss: BoundLoss, vocab_size: int, routing: Optional[RoutingReplay] = None):
    """``routing``: the policy's routing replay (models with experts; trainer/router_replay.py)."""

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        # the generator's routes for this chunk's routers (replayed, or only compared with the trainer's)
        routers = routing.begin_micro_batch(model, mb) if routing is not None else None
        # only trained positions matter: the output layer computes their logits alone
        # (trainer/response_logits.py); without it the loss selects them from every position's
        on = trained_positions(mb).to(_device_of(model))
        with logits_at(model, on) as selected:
            output = model(*model_inputs(mb, model), packed_seq_params=_packed_on_device(mb, model))
        if routers is not None:  # its backward switches the routers to the backward's routes
            output = routing.wrap_output(output, routers)
        return output, partial(_loss_func, loss, vocab_size, mb, on, selected)

    return forward_step


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def model_inputs(mb, model) -> tuple:
    """(input ids, position ids, attention mask) on the model's device: micro-batches are packed
    on the host; on GPUs they must reach the device before the forward pass."""
    device = _device_of(model)
    mask = mb.attention_mask.to(device, non_blocking=True) if mb.attention_mask is not None else None
    return mb.input_ids.to(device, non_blocking=True), mb.position_ids.to(device, non_blocking=True), mask


def _packed_on_device(mb, model):
    params = mb.packed_seq_params
    if params is None:
        return None
    device = _device_of(model)
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        value = getattr(params, name, None)
        if isinstance(value, torch.Tensor) and value.device != device:
            setattr(params, name, value.to(device))
    return params


def per_token_loss(loss: BoundLoss, inputs: LossInputs):
    """(the loss's output, its per-token loss with the KL penalty and entropy bonus added, the KL term per token)."""
    out = loss.fn(inputs, **loss.params)
    per_token = out.per_token_loss
    kl_ref = torch.zeros_like(per_token)
    if loss.kl_coef:
        kl_ref = kl_penalty(inputs.logprobs, inputs.ref_logprobs, loss.kl_estimator)
        per_token = per_token + loss.kl_coef * kl_ref
    if loss.entropy_coef:
        # the bonus rewards keeping pi spread out; its gradient flows through the fused entropy
        per_token = per_token - loss.entropy_coef * inputs.entropy
    return out, per_token, kl_ref


def aggregate(agg: str, inputs: LossInputs, per_token: torch.Tensor, max_new_tokens: int = 0) -> torch.Tensor:
    """sum_t w_t l_t: divided by the step's trained tokens (Megatron) it is the ``agg`` loss."""
    index, n = inputs.segments()
    lengths = inputs.response_lengths if inputs.response_lengths is not None else torch.bincount(index, minlength=n)
    # inputs without the step's totals (hand-built) are a whole step by themselves
    weights = aggregation_weights(
        agg, index, lengths, inputs.step_sequences or n, inputs.step_tokens or index.numel(), max_new_tokens
    )
    return per_token.sum() if weights is None else (per_token * weights.to(per_token.dtype)).sum()


def loss_inputs(mb, on: torch.Tensor, logp: torch.Tensor, entropy: Optional[torch.Tensor]) -> LossInputs:
    """The trained tokens of a micro-batch (``on``: trained_positions) as the loss sees them."""
    device = logp.device

    def tokens(row):
        # the batch's rows stay on the host; the mask is on the logits' device (a GPU)
        return row[0].to(device)[on.to(device)]

    return LossInputs(
        logprobs=logp,
        behaviour_logprobs=tokens(mb.behaviour_logprobs),
        advantages=tokens(mb.advantages),
        entropy=entropy,
        ref_logprobs=tokens(mb.ref_logprobs) if mb.ref_logprobs is not None else None,
        policy_versions=tokens(mb.policy_versions),
        sample_index=tokens(mb.sample_ids),
        response_lengths=mb.response_lengths.to(device),
        group_ids=mb.group_ids.to(device),
        lags=tokens(mb.lags),
        step_sequences=mb.step_sequences,
        step_tokens=mb.step_tokens,
    )


def micro_batch_loss(loss: BoundLoss, mb, on: torch.Tensor, logp: torch.Tensor, entropy: Optional[torch.Tensor]):
    """(sum_t w_t l_t, trained-token count, {"stats": ...}) of one micro-batch from log pi and the entropy
    at its trained positions ``on``, in row order; leaves the detached log pi in ``mb.trainer_logprobs``."""
    inputs = loss_inputs(mb, on, logp, entropy)
    out, per_token, kl_ref = per_token_loss(loss, inputs)
    loss_sum = aggregate(loss.agg, inputs, per_token, loss.max_new_tokens)
    mb.trainer_logprobs = logp.detach()
    stats = micro_batch_stats(inputs, out, loss_sum, kl_ref, loss.lag_bound)
    return loss_sum, on.sum().to(torch.int), {"stats": stats}


def _loss_func(loss: BoundLoss, vocab_size: int, mb, on: torch.Tensor, selected: bool, logits: torch.Tensor):
    # ``selected``: the logits are the trained positions' already; else every position's
    rows = logits[0] if selected else logits[0][on]
    logp, entropy = vocab_parallel_logprobs(
        rows, mb.targets[0].to(logits.device)[on], vocab_size, loss.temperature, True
    )
    return micro_batch_loss(loss, mb, on, logp, entropy)


def make_logprob_collector(vocab_size: int, temperature: float):
    """forward_step for a forward-only pass storing log pi of every target in mb.ref_logprobs."""

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        output = model(*model_inputs(mb, model), packed_seq_params=_packed_on_device(mb, model))

        def collect(logits, non_loss_data=True):
            logp, _ = vocab_parallel_logprobs(logits, mb.targets.to(logits.device), vocab_size, temperature)
            mb.ref_logprobs = logp.detach()
            return None

        return output, collect

    return forward_step
