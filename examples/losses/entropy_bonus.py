"""A user-defined RL loss: AIPO plus an entropy bonus.

Select it in a run config with its dotted path (the module must be importable,
e.g. run from the repository root or put its package on PYTHONPATH):

    trainer:
      loss: examples.losses.entropy_bonus:aipo_with_entropy_bonus
      loss_params: {rho: 4.0, entropy_coef: 0.01}

Its keyword-only parameters (after ``*``) are the ones ``trainer.loss_params``
may set; a name it does not declare is refused by `megarl train` before any rank
starts (megarl.trainer.bound_loss binds the loss once).

A loss receives the trained response tokens of one micro-batch (a token the
sample's loss_mask leaves out is never among them) as megarl.trainer.losses.LossInputs:
log pi with gradient, log mu, advantages, entropy of pi with gradient, the
reference policy's log-probs when configured, each token's sample, lag and the
step's totals. It returns a per-token loss, unreduced: the hook aggregates it
as ``trainer.loss_agg`` says (token_mean by default) over the whole optimizer
step. (The built-in ``trainer.entropy_coef`` adds the same bonus to any loss;
this file shows how a user loss declares parameters of its own. A sequence-level
user loss: examples/losses/gmpo.py.)
"""

from megarl.trainer.losses import LossInputs, LossOutput, aipo


def aipo_with_entropy_bonus(inputs: LossInputs, *, rho: float = 4.0, entropy_coef: float = 0.01) -> LossOutput:
    base = aipo(inputs, rho=rho)
    coef = entropy_coef
    # Subtracting the entropy rewards keeping the policy spread out; its gradient
    # flows through the fused vocab-parallel entropy.
    return LossOutput(base.per_token_loss - coef * inputs.entropy, clipped=base.clipped)
