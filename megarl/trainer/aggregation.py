"""How per-token losses become the step's loss, exactly however the step is split.

Only trained tokens take part: a response token whose ``Sample.loss_mask`` is 0
(a multi-turn episode's tool output, user turn, template glue) never reaches the
loss (packing marks it off the micro-batch's mask row, so the hook does not even
compute its logits), and every count below is of trained tokens: t ranges over the
trained tokens of the step, N is their number, len_i is the number of trained
tokens of sample i, and S counts the samples that have at least one. A masked
token adds nothing to the gradient, to N, to len_i or to any metric; its
placeholder behaviour log-prob (NaN) and version (-1) are never read.

Megatron runs with ``calculate_per_token_loss``: each micro-batch's loss
function returns (loss sum, trained-token count) and Megatron divides the
gradient by the sum of the counts over every micro-batch and data-parallel rank
of the step, N. The count stays the trained tokens; a mode that is not a token
mean is written as per-token weights w_t that fold its normaliser into the sum,
so that the step's loss is

    (1 / N) sum_t w_t l_t        (sum over all trained tokens of the step)

    token_mean               w_t = 1                   -> (1/N) sum_t l_t
    seq_mean_token_mean      w_t = N / (S len_i)       -> (1/S) sum_i (1/len_i) sum_{t in i} l_t
    seq_mean_token_sum       w_t = N / S               -> (1/S) sum_i sum_{t in i} l_t
    seq_mean_token_sum_norm  w_t = N / (S M)           -> (1/S) sum_i (1/M) sum_{t in i} l_t   (Dr.GRPO)

with S and N the step's totals (computed by PolicyTrainer.plan, which sees every
sample, and carried by every micro-batch), len_i as above (a sample never
straddles micro-batches: packing places whole samples) and M =
rollout.max_new_tokens, a constant. Every term only needs its own sample and the
step's totals, so the sum over micro-batches and DP ranks divided by N is the
exact global value. l_t is the loss's per-token value plus the KL penalty and
minus the entropy bonus: all three are aggregated alike. (Context parallelism,
which would split a sample over ranks, is refused by `megarl train` today; it
would need the per-sample reductions all-reduced over the CP group.)

A sample with every token masked counts in its group's baseline (its reward is a
member of the group's mean, like an overlong-masked sample's) but adds nothing
to the loss, to N or to S: it is left out of the micro-batches (shape_batch), so
it gets no trainer_logprobs.

Overlong samples (finish_reason "length", cut by rollout.max_new_tokens):
``trainer.overlong=mask`` leaves them out of the loss (their rewards still count
in their group's baseline); ``penalty`` adds DAPO's soft overlong penalty
(arXiv 2503.14476, eq. 13) to the reward before the advantages. An episode's
limit is per turn (each turn is sampled with its own rollout.max_new_tokens), so
its penalty is that of its worst turn, never of the episode's whole length:
tool output and later turns are not the length the policy chose in one go.
An episode is "length" (masked by ``mask``) when its last turn was cut or it
ran out of context; a cut earlier turn whose episode went on to an end has a
meaningful reward and is left to the penalty.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megarl.errors import ConfigError
from megarl.rollout import Sample, sampled_turn_lengths

if TYPE_CHECKING:  # imported where the weights are made: config checks need no torch
    import torch

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def default_agg(loss_fn) -> str:
    """A loss's own aggregation (its ``loss_agg`` attribute), else token_mean."""
    return getattr(loss_fn, "loss_agg", "token_mean")


def resolve_agg(loss_name: str, loss_fn, configured: Optional[str]) -> str:
    """``trainer.loss_agg`` resolved: the configured mode, else the loss's own; a loss defined by its
    aggregation (``fixed_agg``, Dr.GRPO) refuses another."""
    agg = default_agg(loss_fn) if configured is None else configured
    if agg not in AGG_MODES:
        raise ConfigError(f"trainer.loss_agg: {agg!r} is not one of {list(AGG_MODES)}")
    if getattr(loss_fn, "fixed_agg", False) and agg != default_agg(loss_fn):
        raise ConfigError(
            f"trainer.loss_agg: loss {loss_name!r} is defined by its aggregation {default_agg(loss_fn)!r}, got {agg!r}"
        )
    return agg


def aggregation_weights(
    agg: str,
    sample_index: torch.Tensor,
    response_lengths: torch.Tensor,
    step_sequences: int,
    step_tokens: int,
    max_new_tokens: int,
) -> Optional[torch.Tensor]:
    """Per-token weights w_t in float64 (None for token_mean: the plain sum, bitwise as before).
    ``sample_index``: each trained token's sample; ``response_lengths``: each sample's trained tokens."""
    # imported here: torch (~1.5 s) stays out of `megarl train`'s launcher, which checks the loss through
    # bound_loss -> resolve_agg in this module (train.py check_loss); only the trainer's hook needs weights
    import torch

    if agg == "token_mean":
        return None
    scale = step_tokens / max(step_sequences, 1)
    if agg == "seq_mean_token_sum":
        return torch.full(sample_index.shape, scale, dtype=torch.float64, device=sample_index.device)
    if agg == "seq_mean_token_sum_norm":
        if max_new_tokens < 1:
            raise ValueError("loss aggregation seq_mean_token_sum_norm needs max_new_tokens (its constant)")
        return torch.full(sample_index.shape, scale / max_new_tokens, dtype=torch.float64, device=sample_index.device)
    if agg == "seq_mean_token_mean":
        return scale / response_lengths.to(torch.float64)[sample_index]
    raise ConfigError(f"trainer.loss_agg: {agg!r} is not one of {list(AGG_MODES)}")


def overlong_penalty(length: int, max_new_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to max - buffer, then linear down to -1 at max (-1 beyond)."""
    start = max_new_tokens - buffer
    if length <= start:
        return 0.0
    if length > max_new_tokens:
        return -1.0
    return -(length - start) / buffer


def sample_overlong_penalty(sample: Sample, max_new_tokens: int, buffer: int) -> float:
    """A sample's overlong penalty: its worst turn's (one completion: its only turn). The worst rather
    than a sum keeps an episode's penalty in [-1, 0] as a completion's is, and names the turn that ran on."""
    return min((overlong_penalty(n, max_new_tokens, buffer) for n in sampled_turn_lengths(sample)), default=0.0)
