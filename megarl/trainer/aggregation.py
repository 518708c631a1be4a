"""How per-token losses become the step's loss, exactly however the step is split.

Megatron runs with ``calculate_per_token_loss``: each micro-batch's loss
function returns (loss sum, response-token count) and Megatron divides the
gradient by the sum of the counts over every micro-batch and data-parallel rank
of the step, N. The count stays the response tokens; a mode that is not a token
mean is written as per-token weights w_t that fold its normaliser into the sum,
so that the step's loss is

    (1 / N) sum_t w_t l_t        (sum over all response tokens of the step)

    token_mean               w_t = 1                   -> (1/N) sum_t l_t
    seq_mean_token_mean      w_t = N / (S len_i)       -> (1/S) sum_i (1/len_i) sum_{t in i} l_t
    seq_mean_token_sum       w_t = N / S               -> (1/S) sum_i sum_{t in i} l_t
    seq_mean_token_sum_norm  w_t = N / (S M)           -> (1/S) sum_i (1/M) sum_{t in i} l_t   (Dr.GRPO)

with S the sequences and N the response tokens of the whole step (computed by
PolicyTrainer.plan, which sees every sample, and carried by every micro-batch),
len_i the response length of the token's sample (a sample never straddles
micro-batches: packing places whole samples) and M = rollout.max_new_tokens, a
constant. Every term only needs its own sample and the step's totals, so the
sum over micro-batches and DP ranks divided by N is the exact global value.
l_t is the loss's per-token value plus the KL penalty and minus the entropy
bonus: all three are aggregated alike. (Context parallelism, which would split
a sample over ranks, is refused by `megarl train` today; it would need the
per-sample reductions all-reduced over the CP group.)

Overlong samples (finish_reason "length", cut by rollout.max_new_tokens):
``trainer.overlong=mask`` leaves them out of the loss (their rewards still count
in their group's baseline); ``penalty`` adds DAPO's soft overlong penalty
(arXiv 2503.14476, eq. 13) to the reward before the advantages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megarl.errors import ConfigError

if TYPE_CHECKING:  # imported where the weights are made: config checks need no torch
    import torch

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
OVERLONG_MODES = ("none", "mask", "penalty")


def default_agg(loss_fn) -> str:
    """A loss's own aggregation (its ``loss_agg`` attribute), else token_mean."""
    return getattr(loss_fn, "loss_agg", "token_mean")


def resolve_agg(loss_fn, configured: Optional[str]) -> str:
    agg = default_agg(loss_fn) if configured is None else configured
    if agg not in AGG_MODES:
        raise ConfigError(f"trainer.loss_agg: {agg!r} is not one of {list(AGG_MODES)}")
    return agg


def aggregation_weights(
    agg: str,
    sample_index: torch.Tensor,
    response_lengths: torch.Tensor,
    step_sequences: int,
    step_tokens: int,
    max_new_tokens: int,
) -> Optional[torch.Tensor]:
    """Per-token weights w_t in float64 (None for token_mean: the plain sum, bitwise as before)."""
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


def check_loss_settings(cfg) -> None:
    """trainer.loss_agg / entropy_coef / overlong*: used or refused when the config is loaded."""
    from megarl.trainer.losses import resolve_loss

    t = cfg.trainer
    if t.loss_agg is not None and t.loss_agg not in AGG_MODES:
        raise ConfigError(f"trainer.loss_agg: {t.loss_agg!r} is not one of {list(AGG_MODES)}")
    if t.entropy_coef < 0:
        raise ConfigError(f"trainer.entropy_coef: an entropy bonus, must be >= 0, got {t.entropy_coef}")
    if t.overlong not in OVERLONG_MODES:
        raise ConfigError(f"trainer.overlong: {t.overlong!r} is not one of {list(OVERLONG_MODES)}")
    if t.overlong == "penalty":
        if not 0 < t.overlong_buffer <= cfg.rollout.max_new_tokens:
            raise ConfigError(
                f"trainer.overlong_buffer: the penalty's final stretch of tokens, must be in "
                f"[1, rollout.max_new_tokens={cfg.rollout.max_new_tokens}], got {t.overlong_buffer}"
            )
    elif t.overlong_buffer:
        raise ConfigError(f"trainer.overlong_buffer: used only with trainer.overlong=penalty (it is {t.overlong!r})")
    fn = resolve_loss(t.loss)
    if getattr(fn, "fixed_agg", False) and t.loss_agg not in (None, default_agg(fn)):
        raise ConfigError(
            f"trainer.loss_agg: loss {t.loss!r} is defined by its aggregation {default_agg(fn)!r}, got {t.loss_agg!r}"
        )
    if getattr(fn, "no_std_normalisation", False) and t.normalize_advantage_std:
        raise ConfigError(
            f"trainer.normalize_advantage_std: loss {t.loss!r} removes the division by the group's "
            f"reward std (Dr.GRPO); set it to false"
        )
