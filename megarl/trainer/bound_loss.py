"""The trainer's loss, resolved once: the function, its checked parameters, its aggregation, its settings.

``bind_loss(trainer, rollout, lag_bound)`` reads the config's trainer and rollout
sections and returns a frozen ``BoundLoss``: the loss function looked up (a
built-in name or a dotted path), ``trainer.loss_params`` checked against its
declared parameters with the defaults filled in, ``trainer.loss_agg`` resolved
(the loss's own when unset) and every other setting the loss hook and the step
read. It is the only place a loss is looked up or its settings are checked
against it; the trainer executor binds it once when it is built and
PolicyTrainer and the forward-step hook take it as it is. `megarl train` calls
it too, before any rank starts, so a bad loss setting is refused there naming
its field. Settings that need no loss (ranges, choices) are checked when the
config loads (megarl/config.py).

Imports no torch: the launcher binds the loss without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from megarl.errors import ConfigError
from megarl.trainer.aggregation import resolve_agg
from megarl.trainer.losses import LossFn, bind_loss_params, resolve_loss


@dataclass(frozen=True)
class BoundLoss:
    name: str  # trainer.loss as configured: a built-in name or 'package.module:function'
    fn: LossFn
    params: Mapping[str, Any]  # the loss's keyword parameters, checked, defaults filled in (read-only)
    agg: str  # megarl.trainer.aggregation.AGG_MODES, resolved
    # the sampler's (rollout.temperature): pi must be the distribution sampled from; 1 for a loss on
    # targets nobody sampled (the sft loss's unsampled_targets)
    temperature: float
    kl_coef: float  # > 0 needs a reference model
    kl_estimator: str
    advantage_estimator: str
    normalize_advantage_std: bool
    entropy_coef: float  # entropy bonus, added to any loss
    max_new_tokens: int  # rollout.max_new_tokens: Dr.GRPO's constant, the overlong penalty's end
    overlong: str  # none | mask | penalty
    overlong_buffer: int
    lag_bound: int  # the largest lag trained on (0 in sync mode): the mismatch metrics' buckets 0..lag_bound


def bind_loss(trainer, rollout, lag_bound: int) -> BoundLoss:
    """The loss of ``trainer`` (a TrainerConfig) with ``rollout``'s sampler settings (a RolloutConfig);
    ConfigError naming the field when a setting does not fit the loss."""
    fn = resolve_loss(trainer.loss)
    params = bind_loss_params(fn, trainer.loss, dict(trainer.loss_params))
    agg = resolve_agg(trainer.loss, fn, trainer.loss_agg)
    if getattr(fn, "no_std_normalisation", False) and trainer.normalize_advantage_std:
        raise ConfigError(
            f"trainer.normalize_advantage_std: loss {trainer.loss!r} removes the division by the group's "
            f"reward std (Dr.GRPO); set it to false"
        )
    if (agg == "seq_mean_token_sum_norm" or trainer.overlong == "penalty") and rollout.max_new_tokens < 1:
        raise ConfigError(
            f"rollout.max_new_tokens: loss {trainer.loss!r} ({agg}, trainer.overlong={trainer.overlong}) "
            f"needs it >= 1, got {rollout.max_new_tokens}"
        )
    if lag_bound < 0:
        raise ValueError(f"lag_bound: the largest lag trained on, must be >= 0, got {lag_bound}")
    return BoundLoss(
        name=trainer.loss,
        fn=fn,
        params=MappingProxyType(params),
        agg=agg,
        temperature=1.0 if getattr(fn, "unsampled_targets", False) else rollout.temperature,
        kl_coef=trainer.kl_coef,
        kl_estimator=trainer.kl_estimator,
        advantage_estimator=trainer.advantage_estimator,
        normalize_advantage_std=trainer.normalize_advantage_std,
        entropy_coef=trainer.entropy_coef,
        max_new_tokens=rollout.max_new_tokens,
        overlong=trainer.overlong,
        overlong_buffer=trainer.overlong_buffer,
        lag_bound=lag_bound,
    )
